"""How each step of generation runs, chosen in one place: `Steps`.

A step is the prefill of new prompt tokens, the decode of one token, or the
logits of a few tokens (a speculative verify or draft step, scoring). Each
runs in one of these ways:

- eager: PyTorch ops launched from Python (CPUs; BRISKLM_CUDA_GRAPHS=0);
- graphed: captured in a CUDA graph, one per shape, and replayed (`replayed`);
- block-compiled (CUDA with the fused attention kernel; decode, verify, and
  prompts the attention kernel takes whole, up to 64 tokens):
  the layers run torch.compile'd calls that they share (their weights are
  its inputs; LayerCalls), inside the CUDA graph of the whole step, so a
  cold compile costs about two layers', not every layer's;
- block-compiled from Python (CPUs, when the compile runs beside requests):
  the same compiled block, each step launched eagerly around it, attention
  reading the cache through whole-cache block masks (seconds to compile);
- compiled whole (CPUs when the caller waits for it, or CUDA without the
  fused attention kernel): the decode step as one compiled function.

Nothing a request varies compiles or captures anything once `warm_up` has
run: the sampling settings are a tensor (SamplingParams.on), and a prompt
pads to a bucket whose graphs exist, a long one in chunks of the largest.

No request waits for the compiler either (`compile_later`): the steps start
graphed with the block uncompiled, the block compiles on another thread,
and the next request after it is ready switches to it (`adopt`): first for
the decode step, whose shape compiles first, then for the other shapes.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time

import torch

from .model import MoEFeedForward, Transformer, causal_block_mask, decode_block_mask, head, rows_block_mask
from .sampling import SamplingParams, sample
from .speculative import sampled_choices


class OnePassReductions:
    """Inductor's choices, except for two kinds of reductions.

    A reduction over up to 8192 values is compiled "persistent" (one pass, the
    values held in registers) instead of looped (two passes over memory,
    inductor's choice above 1024 values): each decode layer ends two
    reductions of 4096 values (residual + RMSNorm), one program each.

    Many short reductions (under 256 values each, e.g. gemv.pack_x's groups)
    get a fixed block of reductions a program (SHORT_REDUCTION_BLOCK) instead
    of the fastest of up to three configurations timed at the first run,
    whose pick for these few-microsecond kernels varied between compiles, and
    the int4 step's speed with it. (A class, not a function: its repr keys
    the on-disk cache.)"""

    def __new__(cls):
        from torch._inductor.choices import InductorChoices
        from torch._inductor.codegen.triton import FixedTritonConfig
        from torch._inductor.virtualized import V

        class Choices(InductorChoices):
            @staticmethod
            def should_use_persistent_reduction(features, cooperative_reduction) -> bool:
                return (V.graph.sizevars.statically_known_leq(features.reduction_numel, 8192)
                        or InductorChoices.should_use_persistent_reduction(features, cooperative_reduction))

            def triton_kernel_kwargs(self, kernel_cls, features, groups, kernel_kwargs):
                tiling = groups[0] if len(groups) == 1 and isinstance(groups[0], dict) else {}
                if (features.is_reduction() and set(tiling) == {"x", "r0_"} and short_reductions(**tiling)
                        and not kernel_kwargs.get("fixed_config") and not kernel_kwargs.get("mix_order_reduction")):
                    return {**kernel_kwargs, "override_persistent_reduction": True,
                            "fixed_config": FixedTritonConfig(dict(SHORT_REDUCTION_BLOCK))}
                return kernel_kwargs

            def uuid(self):  # for the compiler's cache key; also the few-rows kernels' blocks, which set
                # the shape of their partial sums (a graph cached under other blocks expects another shape)
                matmul = sys.modules.get("brisklm.kernels.matmul")  # (looked up: the core imports no kernels)
                blocks = (sorted(matmul.CONFIG.items()), matmul.WORDS, matmul.MIN_WORDS_GROUP) if matmul else ()
                return f"brisklm-one-pass-reductions-8192-short-ones-{sorted(SHORT_REDUCTION_BLOCK.items())}-{blocks}"

        return Choices()


SHORT_REDUCTION_BLOCK = {"XBLOCK": 8, "num_warps": 2}  # reductions a program, and its warps


def short_reductions(x, r0_) -> bool:
    """Up to 1024 reductions of 2-255 values each, of static sizes: compiled with SHORT_REDUCTION_BLOCK."""
    return x.is_number and r0_.is_number and int(x) <= 1024 and 1 < int(r0_) < 256


def start_layer(layer, x, cos, sin, mask, input_pos):
    return layer.attend(x, cos, sin, mask, input_pos)


def finish_layer(layer, x, y, real, norm, output, last=None):
    return head(layer.finish(x, y, real), norm, output, last)


def finish_and_start(done, layer, x, y, cos, sin, mask, input_pos, real=None):
    x = done.finish(x, y, real)
    return x, layer.attend(x, cos, sin, mask, input_pos)


class LayerCalls:
    """The layers as the block-compiled steps run them (Transformer.forward's
    `block`): each call finishes one layer and starts the next, up to its
    attention's output, and every layer shares it (their weights are its
    inputs: compiled once, not once a layer); the first layer's start and the
    last one's finish are calls of their own. The boundary between two calls
    so lies between two kernels of ours (attention's, then wo's GEMV), with
    no elementwise work to fuse across it. At a layer's end it split the
    residual add from the next layer's norm (int4: its packing of x), which
    a whole compile fuses into one kernel: one kernel more a layer (the 8B's
    int4 step: 385 kernels against 350 compiled whole, 0.973x the speed;
    RESULTS.md). The last call ends with the model's head (its norm and
    output layer), which eager took several kernels."""

    def __init__(self, wrap=lambda f: f):
        self.start, self.between, self.finish = wrap(start_layer), wrap(finish_and_start), wrap(finish_layer)


def planless_attention(step):
    """step with PyTorch's attention choosing among the flash, memory-efficient
    and math kernels, never cuDNN's: cuDNN builds a plan for each new
    (queries, keys) shape, which an eager step meets at each new prompt length
    (up to a second or more; RESULTS.md); the others need none."""
    @functools.wraps(step)
    def run(*args, **kwargs):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return step(*args, **kwargs)
    return run


def decode_one_token(model: Transformer, token, input_pos, settings, kv_len=None, block_mask=None, block=None):
    """token: (1,) at position input_pos (1,) -> next token (1,) (settings:
    SamplingParams.on). Attention reads only the filled part of the cache:
    by kv_len (eager), the cache's causal block masks ({window: BlockMask},
    compiled whole), or the fused kernel's own read of the length."""
    if block_mask is not None:
        block_mask = {window: decode_block_mask(mask, input_pos) for window, mask in block_mask.items()}
    logits = model(token.view(1, 1), input_pos, kv_len=kv_len, block_mask=block_mask, block=block)  # (1, 1, V)
    return sample(logits[:, -1], settings)


def forward(model: Transformer, idx, input_pos, kv_len=None, last=None, depth=None, block=None):
    """The model's logits as a step function: a prefill (at index `last`), a
    verify step's rows, a draft step, scoring."""
    return model(idx, input_pos, last=last, kv_len=kv_len, depth=depth, block=block)


def rows_logits(model: Transformer, idx, input_pos, depth=None, block=None):
    """Logits (1, T, V) of the tokens idx (1, T) at the consecutive positions
    input_pos (T,), attention reading only the cache blocks they can see
    (rows_block_mask): the verify and draft steps where decoding is compiled
    whole (T = drafts + 1, padded to one shape)."""
    masks = {w: rows_block_mask(model.max_seq_length, input_pos, w) for w in model.windows}
    return model(idx, input_pos, block_mask=masks, depth=depth, block=block)


def replayed(step):
    """`step` captured in a CUDA graph, one per setting (the shapes of its
    tensor arguments and the values of the others), and replayed: one launch
    where an uncompiled step is hundreds. The tensor arguments are copied
    into the graph's own; the output is the graph's, so the caller clones it.
    The run before capture (which Triton's first compile needs) writes the
    keys and values where the replay writes them again. All graphs share one
    memory pool: they never run at once, and each keeps its output."""
    graphs = {}  # setting -> (graph, its inputs: args and kwargs, its output)
    pool = []

    def setting(a):
        return (a.shape, a.dtype) if isinstance(a, torch.Tensor) else a

    def run(*args, **kwargs):
        key = (*map(setting, args), *((k, setting(v)) for k, v in kwargs.items()))
        if key not in graphs:
            if not CAPTURING.acquire(blocking=False):  # (a compile is running: this once, uncaptured)
                return step(*args, **kwargs)
            try:
                graph, mine, mine_kw, out = capture(step, args, kwargs, pool)
            finally:
                CAPTURING.release()
            graphs[key] = graph, (mine, mine_kw), out
        graph, (mine, mine_kw), out = graphs[key]
        for static, given in zip((*mine, *mine_kw.values()), (*args, *kwargs.values())):
            if isinstance(given, torch.Tensor):
                static.copy_(given)
        graph.replay()
        return out

    run.graphs = graphs
    return run


def capture(step, args, kwargs, pool: list):
    """(graph, its inputs: args and kwargs, its output) of step captured on
    copies of args and kwargs, after a run outside the graph."""
    device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
    own = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
    mine, mine_kw = [own(a) for a in args], {k: own(v) for k, v in kwargs.items()}
    side = torch.cuda.Stream(device)  # capture wants the warm-up off the main stream
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step(*mine, **mine_kw)
        if not pool:
            pool.append(torch.cuda.graph_pool_handle())
        # (not torch.cuda.graph, which empties the allocator's cache before each capture)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool[0])
        try:
            out = step(*mine, **mine_kw)
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(side)
    return graph, mine, mine_kw, out


# A CUDA graph's capture fails if another thread allocates or synchronizes meanwhile, as a
# compile's first run does (Steps.compile_later): the compile holds this throughout, and a
# step that would be captured meanwhile runs uncaptured instead.
CAPTURING = threading.Lock()

COMPILE_THREAD = "brisklm-compile"


# The compile thread's niceness (Linux): requests beside it keep their speed, the compile takes
# the idle time (at 19, a steady stream of requests starved it for minutes on 2 cores).
COMPILE_NICENESS = 10


# While the compile thread runs beside graphed requests (CUDA), the interpreter's switch interval
# is this short. Each torch call of a request's step releases Python's lock, the compile (Python
# tracing, most of its work on a GPU) takes it, and the request gets it back only when the
# interpreter forces a switch, by default after 5 ms: several such waits a decode step.
COMPILE_SWITCH_INTERVAL_S = 1e-4


@contextlib.contextmanager
def quick_switches(on: bool):
    """sys.setswitchinterval(COMPILE_SWITCH_INTERVAL_S) inside, if on (the
    setting is the process's: restored after)."""
    before = sys.getswitchinterval()
    if on:
        sys.setswitchinterval(min(before, COMPILE_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        if on:
            sys.setswitchinterval(before)


def yield_the_cores():
    """Lower this thread's CPU priority, and so that of the C++ compiler it
    starts (Linux: niceness is a thread's, inherited by its children)."""
    if sys.platform != "linux":
        return
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, max(COMPILE_NICENESS, os.getpriority(os.PRIO_PROCESS, me)))
    except OSError:  # (a priority the process may not set: the compile runs as it is)
        pass


def random_state_left_alone():
    """Make torch's setters of the global random state no-ops on the compile
    thread. The compiler saves that state before each graph it compiles and
    sets it back after; beside a request, that rewinds the draws the request
    made meanwhile (a seeded request's tokens changed). Idempotent."""
    import torch.cuda
    for module in (torch.random, torch.cuda):
        setter = module.set_rng_state
        if getattr(setter, "left_alone", False):
            continue

        def set_rng_state(*args, setter=setter, **kwargs):
            if threading.current_thread().name != COMPILE_THREAD:
                setter(*args, **kwargs)

        set_rng_state.left_alone = True
        module.set_rng_state = set_rng_state


# Prompt lengths a graphed prefill pads to (longer prompts run in chunks of the last).
PREFILL_BUCKETS = (16, 32, 64, 128, 256)
# An MoE model's graphs hold up to this many tokens: in a graph each expert's tokens are
# gathered on the device (MoEFeedForward.by_expert_rows); a longer prompt runs eager, grouped by expert.
MOE_GRAPH_TOKENS = MoEFeedForward.DEVICE_ROWS


def prefill_shape(start: int, n: int, max_seq_length: int, kernel_tokens: int = 0,
                  largest: int = PREFILL_BUCKETS[-1]) -> tuple[int, int | None] | None:
    """(padded prompt length, keys attended) of the CUDA graph that prefills n
    tokens after `start` cached ones; None if no graph holds them (none is
    longer than `largest`). The keys round up to a power of two, so one
    graph serves many conversation lengths; None where the attention kernel
    reads the length itself (up to kernel_tokens tokens)."""
    bucket = 1 if n == 1 else next((b for b in PREFILL_BUCKETS if n <= b <= largest), None)
    if bucket is None or start + bucket > max_seq_length:
        return None
    if bucket <= kernel_tokens:
        return bucket, None
    return bucket, min(1 << (start + bucket - 1).bit_length(), max_seq_length)


def prefill_shapes(max_seq_length: int, kernel_tokens: int = 0,
                   largest: int = PREFILL_BUCKETS[-1]) -> list[tuple[int, int | None]]:
    """Every shape prefill_shape can give for this cache: the graphs to capture up front."""
    shapes = set()
    for bucket in (1, *(b for b in PREFILL_BUCKETS if b <= largest)):  # (the last key a start reaches: 2^p)
        starts = {0, *((1 << p) - bucket + 1 for p in range(max_seq_length.bit_length() + 1))}
        shapes.update(prefill_shape(s, bucket, max_seq_length, kernel_tokens, largest) for s in starts if s >= 0)
    shapes.discard(None)
    return sorted(shapes, key=lambda s: (s[0], s[1] or 0))


class Steps:
    """The ready step functions of a model with its KV cache (see the module's docstring)."""

    def __init__(self, model: Transformer, max_seq_length: int, compile: bool = False,
                 compile_prefill: bool = False, compile_options: dict | None = None):
        self.model, self.max_seq_length = model, max_seq_length
        self.device = device = model.device
        self.verify_rows = 5  # tokens a verify step holds (drafts + 1), padded to one shape
        self.kernel_tokens = model.decode_kernels.get("attention", 0)  # tokens the attention kernel takes
        graphs = device.type == "cuda" and os.environ.get("BRISKLM_CUDA_GRAPHS") != "0"
        self.graphed = graphs and bool(self.kernel_tokens)  # the decode step replays a graph of ours
        self.compiled = compile
        self.warm = False  # whether warm_up has run
        self.pending = []  # prefill shapes warm_up left to warm_pending
        self.whole = self.rows = self.block_mask = None  # (the masked steps: once adopted)
        # what compile_later compiles and adopt puts to use: one block (CUDA graphs of ours) or the whole step
        self.to_compile = self.compile_kind(wait=True)
        self.compiled_block = self.compiled_whole = None  # (compiled_functions: made where they compile)
        self.compile_options = compile_options or {}
        self.variants, self.shapes = None, {}  # what warm_up ran (settings), and warm_speculative (model, tokens, depth)
        self.compiler = None  # compile_later's thread, until adopt
        self.stages = []  # what compile_later compiles after the decode step: (shapes, buckets), then adopt
        self.inside = contextlib.nullcontext  # (compile_later's context for the compiler)
        self.compile_s, self.compile_error = None, None  # (compile_s: every stage's, summed)
        self.reserved = 0  # the cache's last positions compile_later and adopt write
        # each weight format in the layout this device (and a compiled step on a CPU) reads fastest
        model.prepare(device, compiled=self.to_compile == "whole")
        if compile and not self.kernel_tokens:
            self.block_mask = {w: causal_block_mask(max_seq_length, device, w) for w in model.windows}
        self._decode = decode_one_token
        self.graphed_rows = None
        self._use_block(None)
        self.moe = moe = model.args.num_local_experts > 0
        self.largest_graph = MOE_GRAPH_TOKENS if moe else PREFILL_BUCKETS[-1]
        self.eager_forward = planless_attention(forward) if device.type == "cuda" else forward
        self._prefill = self.eager_forward
        if compile_prefill and not moe:  # dynamic shapes, not graphed: a new length may compile again
            self._prefill = torch.compile(forward, fullgraph=True, dynamic=True, options=compile_options or {})
        self.graphed_forward = replayed(forward) if graphs else None  # (prefill and scoring share its graphs)
        self.graphed_prefill = self.graphed_forward if not compile_prefill else None
        self.sampler = replayed(sample) if graphs else sample
        self.chooser = replayed(sampled_choices) if graphs else sampled_choices  # (a sampled verify's acceptance)

    def compile_kind(self, wait: bool) -> str | None:
        """What compiles: one block inside our CUDA graphs, or on CPUs beside
        requests (seconds); else the whole step (on CPUs it decodes faster
        than the block, after minutes of compiling)."""
        if not self.compiled:
            return None
        return "block" if self.graphed or not (wait or self.device.type == "cuda") else "whole"

    def compiled_functions(self):
        """The compiled block, or the compiled whole step and its rows_logits,
        made at first use (in compile_later's thread). Inductor's options
        apply to these functions only (no global flags); on CUDA its kernels
        launch while their predecessor finishes (programmatic dependent
        launch, Hopper and later)."""
        if self.compiled_block is None and self.compiled_whole is None:
            cuda = self.device.type == "cuda"
            options = {"triton.enable_pdl": cuda, "inductor_choices_class": OnePassReductions,
                       "triton.cudagraphs": cuda and not self.graphed, **self.compile_options}
            compiled = functools.partial(torch.compile, fullgraph=True, dynamic=False, options=options)
            if self.to_compile == "block":
                self.compiled_block = LayerCalls(compiled)
            else:  # (static shapes: a model of other shapes compiles a graph of its own)
                self.compiled_whole = compiled(decode_one_token), compiled(rows_logits)
        return self.compiled_block or self.compiled_whole

    def masked_steps(self, compiled):
        """The decode and rows steps that read the cache through block masks:
        compiled whole, or each layer run by the compiled block (CPUs)."""
        if self.to_compile == "whole":
            return compiled
        return (functools.partial(decode_one_token, block=compiled),
                functools.partial(rows_logits, block=compiled))

    def _use_block(self, block, decode=True, rows=True):
        """The graphed decode step, and the graphed steps of several rows
        (verify, draft, prompts of up to kernel_tokens), each layer run by
        `block` (None: the layer itself)."""
        self.block = block
        if self.graphed and decode:
            self._decode = replayed(functools.partial(decode_one_token, block=block))
        if self.graphed and rows:
            self.graphed_rows = replayed(functools.partial(forward, block=block))

    @property
    def prefill_chunk(self) -> int:
        """The tokens a graphed chunk of a long prompt holds (fusion.fuse_for_decode may choose fewer)."""
        return self.model.decode_kernels.get("prefill_chunk") or PREFILL_BUCKETS[-1]

    @property
    def eager(self) -> bool:
        """Whether a decode step needs the filled length from the host (kv_len)."""
        return self.whole is None and not self.graphed

    def decode(self, token: torch.Tensor, pos: torch.Tensor, settings, kv_len: int) -> torch.Tensor:
        """The token after `token` (1,) at position pos (1,), a tensor of its own."""
        if self.graphed:
            return self._decode(self.model, token, pos, settings).clone()
        if self.whole is not None and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        out = self._decode(self.model, token, pos, settings, kv_len=kv_len if self.eager else None,
                           block_mask=self.block_mask if self.whole is not None else None)
        return out.clone() if self.whole is not None else out

    def _padded(self, ids, start: int, max_seq_length: int, graphed):
        """(ids as a (1, T) tensor, positions, kv_len, whether a graph holds them):
        padded to a bucket when a CUDA graph holds them. The padding's keys and
        values land past the given tokens, where each later step writes its own
        before any query reads them."""
        n = len(ids)
        shape = graphed and prefill_shape(start, n, max_seq_length, self.kernel_tokens, self.largest_graph)
        padded, kv_len = shape if shape else (n, start + n)
        if isinstance(ids, torch.Tensor):  # one token on the device: nothing to pad
            new = ids.reshape(1, 1)
        else:
            new = torch.tensor([ids + [0] * (padded - n)], dtype=torch.long, device=self.device)
        return new, torch.arange(start, start + padded, device=self.device), kv_len, bool(shape)

    def prefill(self, ids: list[int], start: int, settings) -> torch.Tensor:
        """The keys and values of ids at positions start.. into the cache -> the
        next token (1,), from CUDA graphs where they hold them (`_padded`): a
        prompt longer than the largest bucket in chunks of it (or of the
        chunk fusion.fuse_for_decode chose), so that no length runs a shape
        for the first time."""
        chunk = self.prefill_chunk
        while self.graphed_prefill is not None and len(ids) > chunk and not self.moe:  # (MoE: eager, whole)
            self.prefill(ids[:chunk], start, None)
            ids, start = ids[chunk:], start + chunk
        new, pos, kv_len, graphed = self._padded(ids, start, self.max_seq_length, self.graphed_prefill)
        last = torch.tensor([len(ids) - 1], device=self.device)
        step = self._graphs_of(kv_len, self.model, self.graphed_prefill) if graphed else self._prefill
        logits = step(self.model, new, pos, kv_len=kv_len, last=last)
        token = self.sampler(logits[:, -1], settings)
        return token.clone() if self.sampler is not sample else token

    def logits(self, ids, start: int, model: Transformer | None = None, last: int | None = None,
               depth: int | None = None) -> torch.Tensor:
        """Logits (1, len(ids), V) of ids (a list, or one token as a (1,)
        tensor) at positions start.., or (1, 1, V) at index `last` only, of
        this model or of `model` (a draft with its own cache), their keys and
        values into its cache. A verify step (up to verify_rows tokens) and a
        one-token step run compiled where decoding is, padded to one shape;
        else from a CUDA graph where one holds them (`_padded`)."""
        model = model or self.model
        n = len(ids)
        rows = 1 if n == 1 else self.verify_rows if last is None and n <= self.verify_rows else None
        compiled = self.graphed_rows or self.rows
        if compiled is not None and rows and start + rows <= model.max_seq_length:
            new = ids.reshape(1, 1) if isinstance(ids, torch.Tensor) else torch.tensor(
                [ids + [0] * (rows - n)], dtype=torch.long, device=self.device)
            if self.rows is not None and self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            out = compiled(model, new, torch.arange(start, start + rows, device=self.device), depth=depth)
            return out[:, :n].clone() if last is None else out[:, last:last + 1].clone()
        new, pos, kv_len, graphed = self._padded(ids, start, model.max_seq_length, self.graphed_forward)
        at = None if last is None else torch.tensor([last], device=self.device)
        more = {} if depth is None else {"depth": depth}  # (so that a prefill's graphs serve it: one key)
        step = self.eager_forward
        if graphed:  # (every row's logits, last None: shapes the block did not compile for)
            step = self.graphed_forward if at is None else self._graphs_of(kv_len, model, self.graphed_forward)
        out = step(model, new, pos, kv_len=kv_len, last=at, **more)
        out = out if last is not None else out[:, :len(ids)]
        return out.clone() if graphed else out

    def warm_up(self, variants, prompts=None) -> int:
        """Compile and capture the steps requests can need, for each of the
        sampling settings' variants (SamplingParams.on: None and one tensor
        cover all): the decode step, and on CUDA the prefill graphs of every
        bucket and key length, or only those of `prompts` (lengths of prompts
        from an empty cache) with the rest left in `pending` (warm_pending).
        Returns the number of graphs captured."""
        self.variants = variants
        self._warm_decode()
        if self.graphed_prefill is not None:
            shapes = prefill_shapes(self.max_seq_length, self.kernel_tokens, self.largest_graph)
            needed = shapes if prompts is None else self.shapes_of(prompts)
            self.pending = sorted((s for s in shapes if s not in needed), key=lambda s: (s[1] or s[0], s[0]))
            for shape in needed:
                self._capture_prefill(*shape)
            logits = torch.zeros(1, self.model.args.vocab_size, device=self.device)
            for settings in variants:
                self.sampler(logits, settings)
        if self.moe and self.device.type == "cuda":
            self._warm_eager_prefill()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.graph_count()

    def _warm_eager_prefill(self):
        """An MoE prompt longer than its graphs runs eager. Two such prefills
        here load the kernels that the first long prompt would otherwise wait
        for: attention's, and the experts' for each count of their rows."""
        for n in (self.largest_graph + 1, 5 * self.largest_graph):
            n = min(n, self.max_seq_length)
            ids = (torch.arange(n, device=self.device) % self.model.args.vocab_size)[None]
            self._prefill(self.model, ids, self._tail(n), kv_len=self.max_seq_length,
                          last=torch.zeros(1, dtype=torch.long, device=self.device))

    def _warm_decode(self):
        token = torch.zeros(1, dtype=torch.long, device=self.device)
        for settings in self.variants:
            for _ in range(3 if self.whole is not None else 1):  # (a cudagraph tree records at its second run)
                self.decode(token, self._tail(1), settings, kv_len=self.max_seq_length)

    def graph_count(self) -> int:
        return sum(len(getattr(f, "graphs", ())) for f in (self._decode, self.graphed_forward, self.graphed_rows,
                                                          self.sampler))

    def shapes_of(self, prompts) -> list[tuple[int, int | None]]:
        """The prefill graphs that prompts of these lengths, from an empty cache, replay."""
        shapes, chunk = [], self.prefill_chunk
        for n in prompts:
            start = 0
            while len(range(start, n)) > chunk and not self.moe:
                shapes.append(prefill_shape(start, chunk, self.max_seq_length, self.kernel_tokens, self.largest_graph))
                start += chunk
            shapes.append(prefill_shape(start, n - start, self.max_seq_length, self.kernel_tokens,
                                        self.largest_graph))
        return [s for s in dict.fromkeys(shapes) if s is not None]

    def _tail(self, n: int) -> torch.Tensor:
        return tail(self.model, n)

    def _capture_prefill(self, bucket: int, kv_len: int | None):
        ids = torch.zeros(1, bucket, dtype=torch.long, device=self.device)
        last = torch.zeros(1, dtype=torch.long, device=self.device)
        self._graphs_of(kv_len, self.model, self.graphed_prefill)(self.model, ids, self._tail(bucket), kv_len=kv_len,
                                                                  last=last)

    def _graphs_of(self, kv_len: int | None, model: Transformer, uncompiled):
        """The graphs that replay a padded prompt of this model: where the
        attention kernel needs no mask (kv_len None: up to kernel_tokens
        tokens), those of the block-compiled steps (for which the block
        compiles too: maskless_buckets); else `uncompiled`."""
        return self.graphed_rows if self.graphed and kv_len is None and model is self.model else uncompiled

    def maskless_buckets(self) -> list[int]:
        """The prompt lengths whose graphs replay the block-compiled steps (_graphs_of)."""
        if not self.graphed or self.graphed_prefill is None:
            return []
        return [1, *(b for b in PREFILL_BUCKETS if b <= min(self.kernel_tokens, self.largest_graph))]

    def warm_pending(self, stop=lambda: False, room: int | None = None) -> bool:
        """Capture the prefill graphs warm_up left pending, most used first,
        until stop() says so; True when none is left. A capture's run writes
        the cache's last positions: with `room` (the free positions after a
        cached conversation), only shapes that fit in it. None while a
        compile runs (compile_later): a capture then fails."""
        for shape in list(self.pending):
            if stop() or CAPTURING.locked():
                break
            if room is None or shape[0] <= room:
                self.pending.remove(shape)
                self._capture_prefill(*shape)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return not self.pending

    def warm_speculative(self, rows: int, prompt_ids: list[int], draft=None, depth=None):
        """Compile (and capture) the verify step of `rows` tokens and a draft's
        one-token step (draft: a model with its own cache, or depth: the first
        layers of this one), each run three times (compiled, warmed, recorded),
        and capture a sampled verify's acceptance for each number of drafts."""
        self.verify_rows = rows
        self.shapes[id(self.model), rows, None] = self.model, rows, None
        if draft is not None or depth is not None:
            self.shapes[id(draft or self.model), 1, depth] = draft or self.model, 1, depth
        for _ in range(3):
            logits = self.logits((prompt_ids * rows)[:rows], 0)[0]
            if draft is not None or depth is not None:
                self.logits(prompt_ids[:1], 0, model=draft, last=0, depth=depth)
        if self.chooser is not sampled_choices:  # its CUDA graphs, one for each number of drafts
            settings, drafter = SamplingParams(temperature=1.0).on(self.device), draft is not None or depth is not None
            for k in range(1, rows):
                q = torch.softmax(logits[:k].float(), -1) if drafter else None  # (a drafting model's proposals)
                self.chooser(logits[:k + 1], torch.zeros(k, dtype=torch.long, device=self.device), q, settings)

    def compile_later(self, wait: bool = False, inside=contextlib.nullcontext) -> bool:
        """Compile what `compile` asked for on another thread (the block, or on
        CPUs the whole step), for the decode step and each shape warm_up and
        warm_speculative ran, while requests run from the uncompiled steps
        (graphed, or eager); the next request after it is ready adopts it.
        Graphed, the decode step's shape compiles first and is adopted alone,
        then the other shapes (verify, draft, prompts) on a second thread, so
        that decoding reaches full speed after one shape's compile, not all
        of them. With `wait`, compile here and adopt it before returning
        (CUDA's whole compile always: its CUDA graph trees belong to one
        thread). The compile runs inside the context inside() makes (the
        front ends' quieting of the compiler). False if there is nothing to
        compile."""
        if self.to_compile is None or self.compiling or self.adopted:
            return False
        kind = self.compile_kind(wait)
        if kind != self.to_compile:  # (CPUs: the block, and the steps around it, read the uncompiled layouts)
            self.model.prepare(self.device, compiled=False)
        self.to_compile = kind
        shapes = list({(id(self.model), 1, None): (self.model, 1, None), **self.shapes}.values())
        buckets = self.maskless_buckets()
        self.reserved = max([n for _, n, _ in shapes] + buckets)
        wait = wait or (self.to_compile == "whole" and self.device.type == "cuda")
        # (staged only where requests replay graphs: one that ran the compiled block from Python while
        # another shape compiles would meet the compiler inside it)
        staged = self.graphed and not wait and len(shapes) + len(buckets) > 1
        self.stages = [(shapes[1:], buckets)] if staged else []
        self.inside = inside
        self._start_compile(shapes[:1] if staged else shapes, [] if staged else buckets, start=not wait)
        if wait:
            self.compiler.run()
            if self.compile_error is not None:
                self.compiler = None
                raise self.compile_error
            self.adopt(self.max_seq_length)
        return True

    def _start_compile(self, shapes, buckets, start=True):
        """compile_later's thread over these shapes (not started: compile_later runs it itself)."""
        # (not a daemon: the interpreter's exit waits for it, as a thread inside the compiler when the
        # interpreter finalizes aborts the process)
        self.compiler = threading.Thread(target=self._compile, args=(shapes, buckets, self.inside),
                                         name=COMPILE_THREAD)
        if start:
            random_state_left_alone()
            self.compiler.start()

    def _compile(self, shapes, buckets, inside=contextlib.nullcontext):
        """compile_later's work: each compiled function run once on each shape
        (model, tokens, depth) it serves, and on each of the prompt lengths
        `buckets` graphed, at the cache's last positions (which no request
        reaches meanwhile: adopt waits for this first where one could)."""
        t0 = time.perf_counter()
        if threading.current_thread().name == COMPILE_THREAD:
            yield_the_cores()
        try:
            beside = self.device.type == "cuda" and threading.current_thread().name == COMPILE_THREAD
            with CAPTURING, torch.no_grad(), inside(), quick_switches(beside):
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # (a thread's own setting)
                compiled = self.compiled_functions()
                ids = lambda n: torch.zeros(1, n, dtype=torch.long, device=self.device)  # noqa: E731
                if self.graphed:
                    runs = [functools.partial(forward, m, ids(n), tail(m, n), depth=depth, block=compiled)
                            for m, n, depth in shapes]
                    last = torch.zeros(1, dtype=torch.long, device=self.device)  # (a prompt's: an MoE layer's rows)
                    runs += [functools.partial(forward, self.model, ids(n), tail(self.model, n), last=last,
                                               block=compiled) for n in buckets]
                else:
                    whole, rows = self.masked_steps(compiled)
                    # (the block's sampling runs eager, so greedy alone: a sampled run beside requests would
                    # draw from the random numbers a request's seed set)
                    variants = self.variants or [None] if self.to_compile == "whole" else [None]
                    runs = [functools.partial(whole, self.model, ids(1)[0], tail(self.model, 1), settings,
                                              block_mask=self.block_mask) for settings in variants]
                    runs += [functools.partial(rows, m, ids(n), tail(m, n), depth=depth) for m, n, depth in shapes]
                for run in runs:
                    run()
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
        except Exception as e:  # (said by the caller; the steps stay uncompiled)
            self.compile_error = e
        self.compile_s = (self.compile_s or 0.0) + time.perf_counter() - t0

    @property
    def compiling(self) -> bool:
        return self.compiler is not None

    def decode_ready_midway(self, end: int) -> bool:
        """Whether the decode step's compile has finished and a running
        request that reaches no position from `end` on can switch to it
        between two of its steps: adopt's recapture, and the next stage's
        compile after it, write the cache's last `reserved` positions, which
        a request reaching them would wait for (a failed compile is left to
        the next request's switch, which says so)."""
        return (self.compiler is not None and not self.adopted and not self.compiler.is_alive()
                and self.compile_error is None and end <= self.max_seq_length - self.reserved)

    @property
    def adopted(self) -> bool:
        return self.block is not None or self.whole is not None

    def adopt(self, end: int) -> bool:
        """At a request's start (end: the positions it can reach): switch to
        what compile_later compiled, if it is ready; if it is not, wait for
        it only where the request could reach the positions the compile
        writes. The graphs the uncompiled block ran are captured again with
        the compiled one. Once the decode step is adopted, the other shapes
        compile on (`stages`), adopted by a later call. True if this call
        switched; after a failed compile (compile_error) the steps stay as
        they were."""
        if self.compiler is None:
            if self.to_compile and self.variants is None and not self.adopted:  # (no warm-up: the first
                # steps compile as they run)
                self._switch(recapture=False)
            return False
        switched = False
        while self.compiler is not None:
            if self.compiler.is_alive() and end <= self.max_seq_length - self.reserved:
                break
            if self.compiler.ident is not None:
                self.compiler.join()
            self.compiler = None
            if self.compile_error is not None:
                self.stages = []
                break
            self._switch(recapture=True, decode=not self.adopted, rows=not self.stages)
            switched = True
            if self.stages:
                self._start_compile(*self.stages.pop(0))
        return switched

    def _switch(self, recapture: bool, decode=True, rows=True):
        """Run the compiled functions from now on (graphed: for the decode
        step, the steps of several rows, or both); with `recapture`, warm
        them up as warm_up did the uncompiled ones (the graphs they ran,
        captured again)."""
        if not self.graphed:
            self.whole, self.rows = self.masked_steps(self.compiled_functions())
            self._decode = self.whole
            if recapture and self.device.type == "cuda":  # (its CUDA graph trees record now)
                self._warm_decode()
                for model, n, depth in self.shapes.values():
                    for _ in range(2):
                        self.logits([0] * n, model.max_seq_length - n, model=model, depth=depth)
            return
        old = self._decode, self.graphed_rows
        self._use_block(self.compiled_functions(), decode, rows)
        for before, now in zip(old, (self._decode, self.graphed_rows)) if recapture else ():
            for _, ((model, ids, pos, *rest), kwargs), _ in (before.graphs.values() if now is not before else ()):
                self.reserved = max(self.reserved, len(pos))
                now(model, ids, tail(model, len(pos)), *rest, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def tail(model: Transformer, n: int) -> torch.Tensor:
    """Positions for a warm-up run: the cache's last n, which no cached
    conversation reaches before it writes them itself."""
    return torch.arange(model.max_seq_length - n, model.max_seq_length, device=model.device)


class ConstrainedSteps:
    """The steps of decoding under a grammar, on top of a Steps: the logits of
    one token (Steps.logits: compiled, graphed or eager as decoding is), then
    sampling under the grammar's mask (sampling.sample_allowed, replayed from
    a CUDA graph on CUDA): two launches a token, so that the host can compute
    the next mask between them, while the device runs the forward."""

    def __init__(self, steps: Steps):
        from .sampling import sample_allowed
        self.steps = steps
        graphs = steps.device.type == "cuda" and os.environ.get("BRISKLM_CUDA_GRAPHS") != "0"
        self.graphed = graphs
        self.sampler = replayed(sample_allowed) if graphs else sample_allowed

    def warm_up(self, variants):
        """Capture the one-token forward and the masked sampling, for each of
        the sampling settings' variants (the prefill shares Steps' graphs)."""
        steps, vocab = self.steps, self.steps.model.args.vocab_size
        token = torch.zeros(1, dtype=torch.long, device=steps.device)
        for _ in range(3):  # (compiled, warmed, recorded)
            self.forward(token, steps.max_seq_length - 1)
        logits = torch.zeros(1, vocab, device=steps.device)
        bits = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32, device=steps.device)
        for settings in variants:
            self.sample(logits, settings, bits)

    def prefill(self, ids: list[int], start: int) -> torch.Tensor:
        """The keys and values of ids into the cache -> the logits (1, V) after the
        last. All but the last chunk go through Steps.prefill, in the graphed
        chunks an unconstrained prompt takes (an eager pass over a new length
        would wait for its attention's first plan)."""
        chunk = self.steps.prefill_chunk
        tail = len(ids) % chunk or chunk
        if len(ids) > tail:
            self.steps.prefill(ids[:-tail], start, None)
            ids, start = ids[-tail:], start + len(ids) - tail
        return self.steps.logits(ids, start, last=len(ids) - 1)[0]

    def forward(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """token (1,) on the device, at position pos -> the logits (1, V) after it."""
        return self.steps.logits(token, pos, last=0)[0]

    def sample(self, logits: torch.Tensor, settings, bits: torch.Tensor) -> torch.Tensor:
        """The next token (1,) under the bitmask bits (W,), already on the device."""
        token = self.sampler(logits, settings, bits)
        return token.clone() if self.graphed else token
