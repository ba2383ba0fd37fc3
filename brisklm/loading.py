"""Loading a model: `load(path, options) -> LLM`, in three steps: read the
weights (quantized or split for tensor parallelism tensor by tensor as they
are read, the memory planned before the first), build the model and prepare
it for its device, and wrap it in an LLM (its drafter, its warm-up).

LoadOptions holds how to load; the CLI, the benchmarks and the draft model
build one and pass it on."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch

from .api import LLM
from .console import log, progress_bar
from .errors import BriskError, as_user_error
from .memory import out_of_memory, plan_memory
from .model import ModelArgs, Transformer, build_model, random_state_dict
from .modes import LOAD_MODES, RTN_MODES
from .quantize import FORMATS


@dataclasses.dataclass
class LoadOptions:
    """How to load a model.

    device, dtype: by default CUDA if there is one, and bf16.
    quantize: "int8" (per channel), "q8_0" (a scale per 32 inputs, GGUF's
    layout), "int4" (groupsize), "fp8", "int4-gptq" (calibrated) weight-only
    as the weights are read; "gguf" keeps a GGUF file's Q4_0/Q4_1 (and on
    GPUs Q8_0) matrices as stored; "auto" (the default) does that for a GGUF
    file and nothing otherwise; None or "none" keeps every weight dense.
    kv_int8: the KV cache in int8 with a scale per position and head (half
    the memory, at some speed). max_seq_length: the KV cache's length (by
    default the model's context, capped by free memory; past the context
    only with allow_long_context).
    compile: the decode step compiled (None: on CUDA, not on CPUs;
    default_compile); compile_prefill: the prefill too, with dynamic shapes
    (a new length may compile again). compile_options: inductor's.
    fused_kernels=False leaves out our Triton kernels (fusion.py), to compare.
    tensor_parallel: None splits the model over the default process group's
    ranks where it has more than one (torchrun; tp.py); False loads it whole.
    speculate: "ngram" (prompt lookup), "self" (the first draft_layers layers
    draft) or "draft" (a second model sharing the tokenizer:
    draft_checkpoint_path, by default this checkpoint, in draft_quantize; or
    draft_preset); each verify step checks up to draft_tokens drafts, and the
    output is what plain decoding gives.
    warm_up: capture (and start compiling) every step before load returns
    (LLM.warm_up), so that no request waits for the compiler.
    quiet: no progress lines."""
    device: str | None = None
    dtype: str | torch.dtype | None = None
    quantize: str | None = "auto"
    groupsize: int = 128
    kv_int8: bool = False
    max_seq_length: int | None = None
    allow_long_context: bool = False
    compile: bool | None = None
    compile_prefill: bool | None = None
    compile_options: dict | None = None
    fused_kernels: bool = True
    tensor_parallel: bool | None = None
    speculate: str | None = None
    draft_tokens: int | None = None  # (None: api.default_draft_tokens)
    draft_layers: int | None = None
    draft_checkpoint_path: str | None = None
    draft_quantize: str | None = None
    draft_preset: str | None = None
    warm_up: bool = True
    quiet: bool = True

    @classmethod
    def from_args(cls, args, **given) -> "LoadOptions":
        """The options a parsed command line holds (those of its flags named as
        the fields), and `given`."""
        flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**flags, **given})


@dataclasses.dataclass
class Weights:
    """What the reading step gives: the model's shapes, its tensors (already
    quantized or split as asked), its tokenizer (None for a preset) and name."""
    args: ModelArgs
    state: dict
    tokenizer: object
    name: str


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_compile(device) -> bool:
    """Whether the decode step is compiled when the caller does not say. On
    CUDA, yes: one TransformerBlock is compiled and shared by every layer
    (steps.py), inside the CUDA graph of the step. On CPUs, no: a cold
    compile of the whole step takes minutes on a few cores, more than a
    typical short generation gains (RESULTS.md)."""
    return torch.device(device).type == "cuda"


def default_dtype(device: str) -> torch.dtype:
    # bf16 halves the bytes read per token; on CPUs it measured faster than
    # fp32 too. Pass dtype="float32" for exactness.
    return torch.bfloat16


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise BriskError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def gguf_blocks_to_keep(device, fused_kernels: bool = True) -> str:
    """Which of a GGUF file's quantized matrices stay quantized on `device`
    (checkpoints.load's keep_gguf_blocks): the Q4 ones always; the Q8_0 ones
    where our Triton GEMVs run them (fused_kernels); elsewhere only a Q8_0 output
    layer, where aten's int8 matmul, once per group of 32 inputs, beats its
    dense copy (quantize.GroupedInt8Linear), which it does not at the layers'
    sizes."""
    from .kernels import may_run
    if not (fused_kernels and may_run(device)):
        return "output"
    from .kernels import gemv
    return "all" if gemv.available(torch.device(device)) else "output"


def check_kept_blocks(state, mode: str, name="model", quiet=True):
    """Where a GGUF file's blocks were kept as they are ("gguf" / "auto":
    checkpoints.load(keep_gguf_blocks=gguf_blocks_to_keep(device))), say how
    many; "gguf" with none to keep is an error. (Every other mode quantizes
    as the reader reads: quantize.quantizer, gptq.GPTQStream.)"""
    int4 = sum(k.endswith("_int4") for k in state)
    q8 = sum(k.endswith("_int8") and state[k[:-5] + "_scale"].dim() == 2 for k in state
             if not k.startswith("tok_embeddings"))
    if mode == "gguf" and not int4 + q8:
        raise BriskError(f"{name}: quantization 'gguf' needs a GGUF file with Q4_0/Q4_1 (or, on a GPU, "
                         f"Q8_0) matrices")
    if int4 + q8 and mode in ("gguf", "auto"):
        log(f"Kept {int4} int4 and {q8} grouped int8 (Q8_0) matrices as stored "
            f"(--quantize none to dequantize them)", quiet)


@contextlib.contextmanager
def gptq_errors(where: str, mode: str):
    """GPTQ's refusals while it quantizes as the reader reads (a model it
    cannot calibrate) as one-line errors naming the checkpoint."""
    try:
        yield
    except ValueError as e:
        if mode != "int4-gptq":
            raise
        raise BriskError(f"{where}: {e}") from None


def gptq_transform(path: str | None, groupsize: int, quiet: bool = True):
    """GPTQ as a reader transform for the checkpoint at `path` (None: the
    bundled model), calibrated on a fixed text through its own tokenizer,
    with a line for each layer quantized (minutes for a large model)."""
    from .checkpoints import read_tokenizer
    from .gptq import GPTQStream, calibration_ids
    from .quantize import check_mode
    with as_user_error():
        check_mode("int4", groupsize)
    t0 = time.perf_counter()
    return GPTQStream(groupsize, lambda: calibration_ids(read_tokenizer(path)),
                      progress=lambda done, total: log(f"  GPTQ: layer {done} of {total} quantized "
                                                       f"({time.perf_counter() - t0:.0f} s)", quiet))


def tp_world() -> tuple[int, int, object]:
    """(rank, world size, group) of the default process group, (0, 1, None) without one."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, None
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD


def usable_device(device: str, meanwhile: bool = False) -> str:
    """device, or a one-line error if torch cannot use it here. meanwhile: a
    CUDA device's context (about 0.2 s, which releases the GIL) is created on
    a thread while the load goes on; device_ready waits for it."""
    def start():
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as e:
            return BriskError(f"device {device!r} is not usable: {str(e).splitlines()[0]}")

    name = str(device)
    index = "0" if name == "cuda" else name.removeprefix("cuda:")
    if meanwhile and name.startswith("cuda") and index.isdigit() and int(index) < torch.cuda.device_count():
        import concurrent.futures
        pool = concurrent.futures.ThreadPoolExecutor(1)
        _starting[name] = pool.submit(start)
        pool.shutdown(wait=False)  # (its thread ends after this one task)
    elif error := start():
        raise error
    return device


_starting = {}  # device: the future of its context's creation (usable_device's meanwhile)


def device_ready(device: str):
    """Wait for usable_device's creation of `device`'s context, if any; its error, if it failed."""
    future = _starting.pop(str(device), None)
    if future is not None and (error := future.result()):
        raise error


def load(path: str | None = None, *, preset: str | None = None, options: LoadOptions | None = None,
         **given) -> LLM:
    """Load a checkpoint (an HF folder, a GGUF file, a native folder, a hub
    repo id; None: the bundled default model) or, with preset=NAME, a model
    of that shape with random weights, as `options` and the keywords `given`
    (LoadOptions' fields, which override it) say."""
    known = [f.name for f in dataclasses.fields(LoadOptions)]
    for name in given:
        if name not in known:
            import difflib
            close = difflib.get_close_matches(name, known, 1)
            raise TypeError(f"load() got an unexpected keyword argument {name!r}"
                            + (f"; did you mean {close[0]!r}?" if close else ""))
    opts = dataclasses.replace(options or LoadOptions(), **given)
    opts = resolved(opts)
    if torch.device(opts.device).type == "cuda":
        from .kernels import hash_triton_meanwhile
        hash_triton_meanwhile()
        expandable_segments()
    rank, world, group = tp_world() if opts.tensor_parallel is not False else (0, 1, None)
    t0 = time.perf_counter()
    weights = read_weights(path, preset, opts, rank, world)
    model = build(weights, opts, rank, world, group)
    if torch.device(opts.device).type == "cuda":  # (what the load's passing tensors held goes back to the
        torch.cuda.empty_cache()  # device, for the CUDA graphs' own pool)
    log(f"Loaded in {time.perf_counter() - t0:.2f} s", opts.quiet)
    llm = LLM(model, weights.tokenizer, max_seq_length=opts.max_seq_length, compile=opts.compile,
              compile_prefill=opts.compile_prefill, compile_options=opts.compile_options, name=weights.name,
              kv_int8=opts.kv_int8, allow_long_context=opts.allow_long_context, quiet=opts.quiet,
              speculate=opts.speculate, draft_tokens=opts.draft_tokens, draft_layers=opts.draft_layers)
    if opts.speculate == "draft":
        with_draft_model(llm, path, preset, opts)
    if opts.warm_up:  # (no request waits for the compiler)
        llm.warm_up(quiet=opts.quiet)
    return llm


def expandable_segments():
    """Let the CUDA allocator give back memory between live tensors, unless
    the user configured it: quantizing tensor by tensor leaves the freed
    dense tensors' memory in segments that also hold kept weights, which
    empty_cache cannot free and CUDA graphs' own pool cannot use (a large
    quantized MoE model ran out of memory capturing its graphs)."""
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        # (the environment variable counts only before CUDA starts; torch.cuda's setter is deprecated)
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")


def resolved(opts: LoadOptions) -> LoadOptions:
    """opts with the device's defaults filled in; a bad value is a one-line error here, before any loading."""
    quantize = opts.quantize or "none"
    if quantize not in LOAD_MODES:
        raise BriskError(f"unknown quantization {quantize!r} (choose from {', '.join(LOAD_MODES)})")
    device = usable_device(opts.device or default_device(), meanwhile=True)
    compile = default_compile(device) if opts.compile is None else opts.compile
    if opts.compile_prefill:  # (compiled at the first prefill, on this thread)
        from .kernels import gemv
        gemv.traced_as_constants()
    if opts.compile_options:  # checked before loading, not at the first compile
        from torch._inductor import list_options
        unknown = sorted(set(opts.compile_options) - set(list_options()))
        if unknown:
            raise BriskError(f"unknown compile option {unknown[0]!r} (torch._inductor.list_options() names them)")
    if opts.speculate == "draft" and opts.draft_checkpoint_path and opts.draft_preset:
        raise BriskError("give either draft_checkpoint_path or draft_preset, not both")
    if opts.speculate != "draft" and (opts.draft_checkpoint_path or opts.draft_quantize or opts.draft_preset):
        raise BriskError("draft_checkpoint_path, draft_quantize and draft_preset need speculate='draft'")
    return dataclasses.replace(opts, quantize=quantize, device=device, compile=compile,
                               dtype=parse_dtype(opts.dtype) or default_dtype(device),
                               compile_prefill=bool(opts.compile_prefill))


def reader_transform(path: str | None, preset: str | None, opts: LoadOptions, rank: int, world: int):
    """What the reader applies to each tensor as it reads it (quantizing,
    taking this rank's share), or None."""
    transform = None
    if opts.quantize in RTN_MODES:  # quantized tensor by tensor as it loads: the dense model never exists whole
        from .quantize import quantizer
        with as_user_error():
            transform = quantizer(opts.quantize, opts.groupsize)
    elif opts.quantize == "int4-gptq":  # layer by layer as it loads, calibrated on a fixed text
        if preset is not None:
            raise BriskError(f"{preset}: int4-gptq needs a tokenizer for its calibration text (a preset has none)")
        transform = gptq_transform(path, opts.groupsize, opts.quiet)
    if world > 1:
        from . import tp
        if opts.quantize == "int4-gptq" or opts.speculate == "draft":
            raise BriskError("tensor parallelism runs with --quantize none/int8/q8_0/int4/fp8, "
                             "not GPTQ or a draft model yet")
        transform = tp.sharder(rank, world, transform)
    return transform


def local_shapes(args: ModelArgs, world: int) -> ModelArgs:
    """The shapes of one rank's share of the model."""
    if world == 1:
        return args
    from . import tp
    with as_user_error():
        return tp.local_args(args, world)


def read_weights(path: str | None, preset: str | None, opts: LoadOptions, rank: int, world: int) -> Weights:
    """Step one: the weights, read (or made: a preset) with the reader's transform."""
    transform = reader_transform(path, preset, opts, rank, world)
    device, dtype, quantize = opts.device, opts.dtype, opts.quantize
    as_loaded = (f", quantizing to {quantize} tensor by tensor" if quantize in RTN_MODES else
                 f", quantizing to int4 (group {opts.groupsize}) with GPTQ layer by layer"
                 if quantize == "int4-gptq" else "")
    as_loaded += f", rank {rank}'s share of {world}" if world > 1 else ""

    def plan(args, stored=None, name=None):  # (before any tensor is read)
        device_ready(device)
        plan_memory(local_shapes(args, world), torch.device(device), dtype, quantize, opts.groupsize, opts.kv_int8,
                    opts.max_seq_length, weights=stored, name=name, quiet=opts.quiet)

    if preset is not None:
        from .presets import preset as get_preset
        try:
            args = get_preset(preset)
        except KeyError as e:
            raise BriskError(str(e.args[0])) from None
        plan(args, name=preset)
        log(f"Building preset {preset} with random weights on {device} ({dtype}){as_loaded}...", opts.quiet)
        with out_of_memory(preset, device, "building the weights"):
            weights = Weights(args, random_state_dict(args, dtype, device, transform=transform), None, preset)
    else:
        from .checkpoints import load as load_checkpoint
        from .checkpoints import resolve
        kind, where = resolve(path)
        keep = quantize in ("gguf", "auto") and kind == "gguf" and world == 1  # (tp: blocks are widened, then split)
        if keep and quantize == "auto" and dtype == torch.float32 and torch.device(device).type == "cpu":
            # (the CPU's int4 kernel takes fp32 inputs one row at a time: a prefill or a scoring pass
            # would run many times slower than the dense fp32 model, which is the exact one anyway)
            keep = False
            log("float32 on a CPU: the GGUF's quantized matrices are dequantized (--quantize gguf keeps them)",
                opts.quiet)

        def plan_stored(args):  # what the file or folder stores, where the load keeps it so
            stored = None
            if keep:
                stored = os.path.getsize(where)
            elif kind == "native" and transform is None:
                from .checkpoints.native import stored_bytes
                stored = stored_bytes(where, dtype)
            plan(args, stored, where)

        log(f"Loading {path or 'the bundled default model'} on {device} ({dtype}){as_loaded}...", opts.quiet)
        with out_of_memory(where, device, "loading the weights"), gptq_errors(where, quantize):
            ckpt = load_checkpoint(where, device=device, dtype=dtype, progress=None if opts.quiet else progress_bar,
                                   keep_gguf_blocks=keep and gguf_blocks_to_keep(device, opts.fused_kernels),
                                   transform=transform, plan=plan_stored)
        weights = Weights(ckpt.args, ckpt.state_dict, ckpt.tokenizer, ckpt.path)
        del ckpt
    if quantize in (*RTN_MODES, "int4-gptq"):  # (quantized as read)
        from .quantize import untied
        weights.args = untied(weights.args, weights.state)
    elif world == 1:
        check_kept_blocks(weights.state, quantize, weights.name, opts.quiet)
    weights.args = local_shapes(weights.args, world)
    return weights


def build(weights: Weights, opts: LoadOptions, rank: int, world: int, group) -> Transformer:
    """Step two: the model, prepared for its device: our kernels fused in,
    split over the ranks."""
    if opts.quantize == "q8_0" and torch.device(opts.device).type == "cpu" and not opts.compile:
        log("Note: uncompiled, q8_0 runs group by group on CPUs, slower than int8 (as fast compiled)", opts.quiet)
    model = build_model(weights.args, weights.state, FORMATS)
    # The model holds the tensors now: a reference kept in the state dict would
    # keep each one alive after preparing copies it (an MoE's stacked experts:
    # bf16 Mixtral held 2x its 93 GB and did not fit an H200).
    weights.state.clear()
    from .kernels import may_run
    if opts.fused_kernels and may_run(model.device):
        from .fusion import fuse_for_decode
        fuse_for_decode(model)
    if world > 1:
        from . import tp
        tp.parallelize(model, group)
        log(f"Tensor parallel: rank {rank} of {world} holds 1/{world} of each layer", opts.quiet)
    return model


def with_draft_model(llm: LLM, path: str | None, preset: str | None, opts: LoadOptions):
    """Step three's speculate="draft": load the draft model (by default the
    target's checkpoint again, in draft_quantize) and draft with it."""
    draft = dataclasses.replace(opts, compile=False, max_seq_length=llm.generator.max_seq_length,
                                allow_long_context=True, quantize=opts.draft_quantize or opts.quantize,
                                speculate=None, draft_checkpoint_path=None, draft_quantize=None, draft_preset=None,
                                warm_up=False)
    llm.draft = load(None if opts.draft_preset else opts.draft_checkpoint_path or path,
                     preset=opts.draft_preset or (None if opts.draft_checkpoint_path or path else preset),
                     options=draft)
    theirs, ours = llm.draft.model.args.vocab_size, llm.model.args.vocab_size
    if theirs != ours:
        raise BriskError(f"{llm.draft.name}: the draft model's vocabulary ({theirs} tokens) is not the "
                         f"target's ({ours}); a draft must share the target's tokenizer")
    from .speculative import ModelDrafter
    llm.drafter = ModelDrafter(llm.draft.model)
