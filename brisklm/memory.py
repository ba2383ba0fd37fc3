"""Memory planning before a load: what the weights and the KV cache take
against the memory free on the device, refused in one line (with what would
fit) before anything is read, and the KV cache's default length."""
from __future__ import annotations

import contextlib

import torch

from .console import log
from .errors import BriskError
from .model import canonical_names, kv_bytes_per_position
from .modes import RTN_MODES


@contextlib.contextmanager
def out_of_memory(name: str, device, doing: str):
    """An out-of-memory error inside this block as a one-line BriskError with the numbers."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        free = free_memory_bytes(torch.device(device))
        first = str(e).splitlines()[0][:200]
        raise BriskError(f"{name}: out of memory on {device} while {doing}"
                         + (f" ({free / 1e9:.1f} GB free now)" if free is not None else "") + f": {first}") from None


def supported_context(args) -> int:
    """The longest context the model was trained for, or its RoPE scaling
    extends to (factor x the original length, where the config gives both)."""
    scaling = args.rope_scaling or {}
    if scaling.get("factor") and scaling.get("original_max_position_embeddings"):
        return max(args.max_position_embeddings,
                   int(scaling["factor"] * scaling["original_max_position_embeddings"]))
    return args.max_position_embeddings


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device` (the OS's MemAvailable on CPUs), or None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


KV_MEMORY_SHARE = 0.5  # of the memory free after loading, at most, for a default-sized KV cache
PLAN_SHARE = 0.95  # of the free memory, at most, for weights and a requested KV cache (the rest: activations)


def weight_bytes(args, dtype, quantize: str = "none", groupsize: int = 128) -> int:
    """Bytes the weights take once loaded with `quantize` (an RTN mode, or
    dense): each tensor made on the meta device, shapes only, and passed
    through the quantizer the loading uses."""
    from .quantize import quantizer
    quantize = "int4" if quantize == "int4-gptq" else quantize  # (the same format, made otherwise)
    transform = quantizer(quantize, groupsize) if quantize in RTN_MODES else None
    sizes = {}  # every layer's tensors are alike: each kind is sized once
    for name, shape in canonical_names(args).items():
        kind = "layers.0." + name.split(".", 2)[2] if name.startswith("layers.") else name
        if kind not in sizes:
            t = torch.empty(shape, dtype=dtype, device="meta")
            entries = transform(args, kind, t) if transform else {kind: t}
            sizes[kind] = [sum(e.numel() * e.element_size() for e in entries.values()), 0]
        sizes[kind][1] += 1
    return sum(size * count for size, count in sizes.values())


def plan_memory(args, device: torch.device, dtype, quantize: str, groupsize: int, kv_int8=False,
                max_seq_length=None, weights: int | None = None, name="model", quiet=True):
    """Before loading: say what the weights (and a requested KV cache) take
    against the memory free on `device`, and refuse in one line, with what
    would fit, when they do not. `weights` overrides the computed bytes (a
    GGUF file's kept blocks: its size)."""
    free = free_memory_bytes(device)
    given = weights is not None
    weights = weight_bytes(args, dtype, quantize, groupsize) if weights is None else weights
    per_position = kv_bytes_per_position(args, dtype, kv_int8)
    cache = per_position * max_seq_length if max_seq_length else 0
    gb = lambda n: f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"  # noqa: E731
    what = {"none": f"{str(dtype).replace('torch.', '')} weights", "auto": "weights",
            "gguf": "weights"}.get(quantize, f"{quantize} weights") + (" (as stored)" if given else "")
    if free is None:
        return
    log(f"Memory plan on {device}: {gb(weights)} of {what}"
        + (f" + {gb(cache)} of KV cache ({max_seq_length} tokens)" if cache else "")
        + f", {gb(free)} free", quiet)
    budget = free * PLAN_SHARE
    if weights > budget:
        smaller = [(m, weight_bytes(args, dtype, m, 128)) for m in ("int8", "int4")]
        fits = [f"--quantize {m}{' --groupsize 128' if m == 'int4' else ''} ({gb(b)})"
                for m, b in smaller if b <= budget and b < (0.8 if given else 1) * weights]  # (not what it is)
        raise BriskError(f"{name}: {gb(weights)} of {what} do not fit the {gb(free)} free on {device}"
                         + (f"; {' or '.join(fits)} would" if fits else "; not even as int4 (a smaller model, "
                            "or a device with more memory)"))
    if weights + cache > budget:
        tokens = min(int((budget - weights) // per_position) // 256 * 256, supported_context(args))
        raise BriskError(f"{name}: a KV cache of {max_seq_length} tokens ({gb(cache)}) and {gb(weights)} of {what} "
                         f"do not fit the {gb(free)} free on {device}; --max_seq_length {tokens} would"
                         + ("" if kv_int8 else ", or --kv_int8 (half the cache)"))


def cache_length(args, device: torch.device, dtype, kv_int8=False, requested=None,
                 allow_long_context=False, quiet=True) -> int:
    """The KV cache's length: `requested`, else the model's whole context
    capped by free memory (the cap is printed)."""
    context = supported_context(args)
    if requested is not None:
        if requested < 1:
            raise BriskError(f"max_seq_length must be >= 1, got {requested}")
        if requested > context:
            if not allow_long_context:
                raise BriskError(f"max_seq_length {requested} is past the model's context of {context} tokens "
                                 f"(its RoPE is not scaled that far); --allow_long_context runs it anyway, "
                                 f"with quality degrading past {context}")
            log(f"Warning: a KV cache of {requested} tokens, past the model's context of {context}: "
                f"output quality degrades beyond it", quiet)
        return requested
    per_position = kv_bytes_per_position(args, dtype, kv_int8)
    free = free_memory_bytes(device)
    fits = context if free is None else int(free * KV_MEMORY_SHARE) // per_position // 256 * 256
    if fits < context:
        length = max(fits, min(context, 256))
        log(f"KV cache capped at {length} tokens ({length * per_position / 1e9:.2f} GB) by free memory "
            f"({free / 1e9:.1f} GB); the model's context is {context} (--max_seq_length sets the cache)", quiet)
        return length
    log(f"KV cache: {context} tokens, the model's context ({context * per_position / 1e9:.2f} GB)", quiet)
    return context
