import os

import pytest

GGUF_ENV = "BRISKLM_TEST_GGUF"

if os.environ.get("PYTEST_XDIST_WORKER"):  # (before any test imports torch)
    # The workers share the cores: one thread each, and for their servers,
    # CLIs and ranks too, or their torch threads wait on each other's.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (no path, -m or -k given) runs in two workers where
    pytest-xdist is installed, a test file each at a time (module fixtures,
    servers, built once); -n says otherwise, and a part runs in this process."""
    whole = (config.args_source == pytest.Config.ArgsSource.TESTPATHS
             and not config.option.markexpr and not config.option.keyword)
    if (whole and config.pluginmanager.hasplugin("xdist") and config.option.numprocesses is None
            and not os.environ.get("PYTEST_XDIST_WORKER")):
        config.option.numprocesses, config.option.dist = 2, "loadfile"


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the bundled SmolLM2-135M-Instruct GGUF (fetched into the cache once)."""
    path = os.environ.get(GGUF_ENV)
    if path:
        return path
    from brisklm.checkpoints.hub import default_model_path
    return default_model_path(quiet=True)


@pytest.fixture(scope="session")
def smol_llm(smollm2_gguf):
    """The real SmolLM2 model, fp32 on the CPU, every weight dequantized (the exact
    reference path; test_quantize.py covers the int4 blocks kept as they are)."""
    import brisklm
    return brisklm.load(smollm2_gguf, device="cpu", dtype="float32", max_seq_length=1024,
                        quantize="none")


@pytest.fixture(autouse=True)
def _fresh_compiler(request):
    """Each compiling test starts with dynamo's caches empty: the compiled
    decode step is one function whose recompilations (one per model shape)
    count against dynamo's per-function limit across the whole session."""
    yield
    if request.node.get_closest_marker("compile"):
        import torch
        torch._dynamo.reset()
