"""The compiled decode step kept across processes, Dynamo's tracing included.

PyTorch's caches already keep the compiled kernels and graphs, but every
start still traces the step in Python (Dynamo): ~10 s of a warm start for an
8B model. With torch's caching_precompile, the traced result and its guards
are saved too (torch.compiler.save_cache_artifacts) and loaded back
(load_cache_artifacts) before compiling, and the next start skips tracing.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil

import torch


@functools.cache
def source_digest() -> str:
    """A digest of this package's Python source: a traced step skips our code,
    so one saved by another version of it must not be loaded."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def artifacts_path(model, options: dict, step: str = "decode") -> str:
    """Where the compiled `step` ("decode" or "prefill") of this model (shapes,
    dtypes, options, torch version, our source) is saved: in the compiler's
    cache folder, so a cold start, with that folder empty, has none."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    tensors = [(n, tuple(t.shape), t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]]
    device = model.rope_cos.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # (decode_kernels: the fused kernels' tuned blocks, constants of the traced step)
    what = repr((torch.__version__, source_digest(), model.args, tensors, sorted(options.items()), where,
                 model.decode_kernels))
    return os.path.join(cache_dir(), "brisklm", f"{step}-{hashlib.sha256(what.encode()).hexdigest()[:20]}.bin")


def compiled_before(path: str | None) -> bool:
    """Whether a step saved at `path` (artifacts_path) was compiled in an
    earlier process, so that the compiler's caches hold it."""
    return path is not None and (os.path.exists(path) or os.path.exists(path + ".done"))


def mark_compiled(path: str | None):
    """Record that the step for `path` compiled (a step compiled plainly,
    with nothing of ours saved, leaves only this mark)."""
    if path is not None and not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path + ".done", "w").close()


def forget_traced(fn):
    """Remove what torch's caching precompile saved for `fn` by itself. It keys
    that entry by the function's name and first line only and loads it at
    every compile, so a step traced under another GEMV table (the blocks are
    constants of the graph, not guarded) or other options could come back
    (after a retune, a stale int4 step ran 12% slower until the caches were
    emptied). Our saved file (artifacts_path) is keyed by all of
    these and, when loaded, writes the entry anew."""
    try:
        from torch._dynamo.package import CompilePackage, DynamoCache
        entry = os.path.join(DynamoCache.path_prefix(), CompilePackage.source_id_from_fn(fn))
    except (ImportError, AttributeError):  # another torch: nothing of the kind to remove
        return
    shutil.rmtree(entry, ignore_errors=True)


def precompiled(fn, options: dict, path: str, dynamic: bool | None = None):
    """torch.compile(fn) whose traced graph (Dynamo's output with its guards)
    is saved with the compiled code after the first call and loaded at the
    next start, which then skips tracing (torch's caching_precompile): most of
    a warm start. It is experimental in torch: an entry that does not load
    back leaves a marker and a plain compile."""
    broken = path + ".broken"

    def plain(mark=True):  # the fallback, and what every failure leaves a marker for
        if mark:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(broken, "w").close()
        return torch.compile(fn, fullgraph=True, options=options, dynamic=dynamic)

    if os.environ.get("BRISKLM_PRECOMPILE") == "0":  # opted out: nothing saved or marked
        return plain(mark=False)
    if os.path.exists(broken):
        return plain()
    loaded = os.path.exists(path)
    if not loaded:
        forget_traced(fn)
    try:
        # A loaded entry is rebuilt inside torch.compile() from the global
        # inductor config, not from `options` (torch reads
        # config.triton.cudagraphs there): without this patch it ran with no
        # CUDA graph, several times slower.
        with torch._dynamo.config.patch(caching_precompile=True), torch._inductor.config.patch(options):
            if loaded:
                with open(path, "rb") as f:
                    torch.compiler.load_cache_artifacts(f.read())
            compiled = torch.compile(fn, fullgraph=True, options=options, dynamic=dynamic)
    except Exception:
        return plain()
    state = {"step": compiled, "first": True, "precompiling": True}

    def step(*args, **kwargs):
        if not state["first"] and not (dynamic and state["precompiling"]):
            return state["step"](*args, **kwargs)
        if not state["first"]:  # a new length may compile again, which torch 2.11 refuses outside the
            try:  # setting it was traced under
                with torch._dynamo.config.patch(caching_precompile=True):
                    return state["step"](*args, **kwargs)
            except Exception:  # (torch 2.11, an H200 with a draft model in the process: an
                state["step"], state["precompiling"] = plain(), False  # AssertionError in Dynamo's install_global)
                return state["step"](*args, **kwargs)
        state["first"] = False
        guards_log = logging.getLogger("torch._dynamo.guards")  # one warning per global guard it drops
        level = guards_log.level
        guards_log.setLevel(logging.ERROR)
        try:
            with torch._dynamo.config.patch(caching_precompile=True):  # traces here unless loaded
                out = compiled(*args, **kwargs)
                artifacts = None if loaded else torch.compiler.save_cache_artifacts()
        except Exception:  # not saved: the step compiled as usual
            state["step"] = plain()
            return state["step"](*args, **kwargs)
        finally:
            guards_log.setLevel(level)
        if artifacts:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "wb") as f:
                f.write(artifacts[0])
            os.replace(path + ".tmp", path)
        return out

    return step
