"""Triton kernels for the GPU decode path (see gemv.py)."""
import os
import threading


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1: CPU tensors, no PTX)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def may_run(device) -> bool:
    """Whether the kernels could run for tensors on `device` (a CUDA GPU, or
    any device under Triton's interpreter), asked without importing Triton
    (a fifth of a second of a CPU process's start); gemv.available decides."""
    return str(device).startswith("cuda") or interpreted()


def hash_triton_meanwhile():
    """Before a process's first kernel launch Triton hashes its own library (the
    key of its kernel cache); the hashing releases the GIL, so a thread started
    before the weights load does it while they load."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # (no triton, or another layout of it: hashed at the first launch)
        return

    def run():
        try:
            triton_key()
        except Exception:  # (the first launch hashes again and reports what is wrong)
            pass
    threading.Thread(target=run, name="brisklm-triton-key", daemon=True).start()
