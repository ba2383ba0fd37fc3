"""Prefill, one-token decode step and the decode loop.

The shape follows gpt-fast: `prefill` and `decode_one_token` are small
functions compiled on their own (the decode step as one CUDA graph with
mode="reduce-overhead"), positions are tensors and the KV cache is static, so
a step has fixed shapes. The loop never blocks the device on the host: the
token of step i is copied to the host while step i+1 is already queued, and
EOS is checked on that copy, so the GPU never waits for Python.

`Generator` also remembers which tokens its KV cache holds: a new prompt that
extends the previous conversation only prefills the new part (multi-turn chat
reuses the cache instead of re-reading the history).
"""
from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch

from .model import Transformer, causal_block_mask, decode_block_mask, rows_block_mask
from .precompile import artifacts_path, precompiled
from .sampling import SamplingParams, sample
from .speculative import DraftPolicy, accept


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
    the int4 step's speed with it (benchmarks/JOURNAL.md, fifth and
    thirteenth sessions). (A class, not a function: its repr keys the on-disk
    cache.)"""

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

            def uuid(self):  # for the compiler's cache key
                return f"brisklm-one-pass-reductions-8192-short-ones-{sorted(SHORT_REDUCTION_BLOCK.items())}"

        return Choices()


SHORT_REDUCTION_BLOCK = {"XBLOCK": 8, "num_warps": 2}  # reductions a program, and its warps


def short_reductions(x, r0_) -> bool:
    """Up to 1024 reductions of 2-255 values each, of static sizes: compiled with SHORT_REDUCTION_BLOCK."""
    return x.is_number and r0_.is_number and int(x) <= 1024 and 1 < int(r0_) < 256


def prefill(model: Transformer, idx, input_pos, params: SamplingParams, kv_len=None, last=None):
    """idx: (1, T) prompt ids at positions input_pos (T,) -> the token after
    position `last` along T ((1,); None: the last one), shape (1,)."""
    if last is None:
        last = torch.tensor([idx.shape[1] - 1], device=idx.device)
    logits = model(idx, input_pos, last=last, kv_len=kv_len)  # (1, 1, V)
    return sample(logits[:, -1], params)


def decode_one_token(model: Transformer, token, input_pos, params: SamplingParams, kv_len=None,
                     block_mask=None):
    """token: (1,) at position input_pos (1,) -> next token (1,).

    Pass kv_len (eager) or the cache's causal block masks ({window: BlockMask},
    compiled) so that attention reads only the filled part of the cache."""
    if block_mask is not None:
        block_mask = {window: decode_block_mask(mask, input_pos) for window, mask in block_mask.items()}
    logits = model(token.view(1, 1), input_pos, kv_len=kv_len, block_mask=block_mask)  # (1, 1, V)
    return sample(logits[:, -1], params)


def forward(model: Transformer, idx, input_pos, kv_len=None, last=None, depth=None):
    """The model's logits as a step function (for `replayed`): a speculative
    step's verify forward over several tokens and its draft steps."""
    return model(idx, input_pos, last=last, kv_len=kv_len, depth=depth)


def rows_logits(model: Transformer, idx, input_pos, depth=None):
    """Logits (1, T, V) of the tokens idx (1, T) at the consecutive positions
    input_pos (T,), attention reading only the cache blocks they can see
    (rows_block_mask; one token's fused attention kernel reads the length
    itself): the compiled verify step of speculative decoding (T = drafts + 1,
    padded to one shape) and its one-token draft steps."""
    masks = {w: rows_block_mask(model.max_seq_length, input_pos, w) for w in model.windows}
    return model(idx, input_pos, block_mask=masks, depth=depth)


def replayed(step):
    """`step` captured in a CUDA graph, one per setting (the shapes of its
    tensor arguments and the values of the others: sampling parameters, key
    lengths), and replayed. Uncompiled, a decode step is ~1,300 small
    launches whose Python costs far more than their kernels; replayed, it is
    one launch. The tensor arguments are copied into the graph's own; the
    output is the graph's, so the caller clones it. The run before capture (which Triton's first
    compile needs) writes the keys and values where the replay writes them
    again. All graphs share one memory pool: they never run at once, and
    each keeps its output."""
    graphs = {}
    pool = []

    def setting(a):
        return (a.shape, a.dtype) if isinstance(a, torch.Tensor) else a

    def own(a):
        return a.clone() if isinstance(a, torch.Tensor) else a

    def run(*args, **kwargs):
        key = (*map(setting, args), *((k, setting(v)) for k, v in kwargs.items()))
        if key not in graphs:
            device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            mine, mine_kw = [own(a) for a in args], {k: own(v) for k, v in kwargs.items()}
            side = torch.cuda.Stream(device)  # capture wants the warm-up off the main stream
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step(*mine, **mine_kw)
            torch.cuda.current_stream(device).wait_stream(side)
            if not pool:
                pool.append(torch.cuda.graph_pool_handle())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool[0]):
                out = step(*mine, **mine_kw)
            graphs[key] = graph, [*mine, *mine_kw.values()], out
        graph, inputs, out = graphs[key]
        for static, given in zip(inputs, (*args, *kwargs.values())):
            if isinstance(given, torch.Tensor):
                static.copy_(given)
        graph.replay()
        return out

    return run


# Prompt lengths a graphed prefill pads to (longer prompts run as they are).
PREFILL_BUCKETS = (16, 32, 64, 128, 256)


def prefill_shape(start: int, n: int, max_seq_length: int) -> tuple[int, int] | None:
    """(padded prompt length, keys attended) of the CUDA graph that prefills n
    tokens after `start` cached ones; None if no graph holds them. The keys
    round up to a power of two, so one graph serves many conversation lengths."""
    bucket = 1 if n == 1 else next((b for b in PREFILL_BUCKETS if b >= n), None)
    if bucket is None or start + bucket > max_seq_length:
        return None
    return bucket, min(1 << (start + bucket - 1).bit_length(), max_seq_length)


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every matrix once, one embedding
    row. A tensor the embedding shares with the output layer (tied weights, or
    a GGUF's tied Q8_0 codes) is read whole, by the output layer."""
    read = {}  # quantized weights live in buffers, dense ones in parameters
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if "kv_cache" in name or name.startswith("rope_"):
            continue
        rows = t[0] if name.startswith("tok_embeddings.") else t
        share = 1.0  # (an MoE layer reads its chosen experts only)
        if ".experts." in name:
            share = model.args.num_experts_per_tok / model.args.num_local_experts
        read[id(t)] = max(read.get(id(t), 0), int(rows.numel() * t.element_size() * share))
    return sum(read.values())


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0  # time to first token
    decode_s: float = 0.0
    reused_tokens: int = 0  # prompt tokens whose KV came from the cache
    weight_bytes: int = 0
    target_steps: int = 0  # speculative decoding: verify forwards after the first token

    @property
    def tokens_per_step(self) -> float:
        """Speculative decoding's acceptance: tokens emitted per verify forward."""
        return (self.new_tokens - 1) / self.target_steps if self.target_steps else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from prefill; decode made the rest.
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    @property
    def bandwidth_gb_s(self) -> float:
        return self.weight_bytes * self.decode_tokens_per_s / 1e9


class Generator:
    """Owns a model with its KV cache, and the compiled (or eager) step functions."""

    def __init__(self, model: Transformer, max_seq_length: int, compile: bool = False,
                 compile_prefill: bool = False, compile_options: dict | None = None, kv_int8: bool = False):
        self.model = model
        self.device = model.device
        self.max_seq_length = max_seq_length
        model.setup_caches(1, max_seq_length, kv_int8)
        self.cached: list[int] = []  # tokens whose keys/values are in the cache
        self.compiled = compile
        self.compile_path = None
        self._decode = decode_one_token
        self._prefill = prefill
        self.block_mask = None
        self._rows = None  # the compiled verify and draft steps (rows_logits), where decoding is compiled
        self.verify_rows = 5  # tokens a compiled verify step holds (drafts + 1; set by tokens())
        self.draft_costs = weakref.WeakKeyDictionary()  # drafter -> seconds a step by drafts (DraftPolicy)
        # Uncompiled on CUDA, the step is replayed from a CUDA graph where its
        # attention reads the filled length on the device (the Triton kernel
        # fusion.fuse_for_decode swapped in); BRISKLM_CUDA_GRAPHS=0 runs it op
        # by op (for debugging and profiles).
        length_on_device = model.decode_kernels.get("attention", False)
        self.graphed = (not compile and self.device.type == "cuda" and os.environ.get("BRISKLM_CUDA_GRAPHS") != "0"
                        and length_on_device)
        if self.graphed:
            self._decode = replayed(decode_one_token)
        # each weight format in the layout this device (and a compiled step on a CPU) reads fastest
        model.prepare(self.device, compiled=compile)
        if compile:
            if not length_on_device:
                self.block_mask = {w: causal_block_mask(max_seq_length, self.device, w) for w in model.windows}
            # Inductor options apply to this function only (no global flags). On
            # CUDA the step becomes one CUDA graph, and inductor's kernels launch
            # while their predecessor finishes (programmatic dependent launch,
            # Hopper and later).
            cuda = self.device.type == "cuda"
            options = {"triton.cudagraphs": cuda, "triton.enable_pdl": cuda,
                       "inductor_choices_class": OnePassReductions, **(compile_options or {})}
            self.compile_path = artifacts_path(model, options)  # (precompile.compiled_before tells)
            # (flex attention's guards do not load back, nor do a tensor-parallel
            # step's collectives, whose ranks would also write one file: no precompile)
            # (static shapes: a second model of other shapes compiles a graph of its own, where
            # Dynamo would otherwise make the sizes symbolic, which the kernels' launch settings cannot be)
            if self.block_mask is None and model.tensor_parallel is None:
                self._decode = precompiled(decode_one_token, options, self.compile_path, dynamic=False)
            else:
                self._decode = torch.compile(decode_one_token, fullgraph=True, dynamic=False, options=options)
            # one static shape a step kind: a verify step pads its rows, a draft step has one
            self._rows = torch.compile(rows_logits, fullgraph=True, dynamic=False, options=options)
        moe = model.args.num_local_experts > 0
        if compile_prefill and not moe:  # dynamic lengths: a new prompt length does not compile again
            # (an MoE prefill groups tokens by expert on the host: it runs uncompiled)
            options = compile_options or {}
            self._prefill = precompiled(prefill, options, artifacts_path(model, options, "prefill"), dynamic=True)
        # On CUDA a prompt of up to PREFILL_BUCKETS[-1] new tokens is padded to
        # a bucket and its prefill replayed from a CUDA graph: launched kernel
        # by kernel, a short prefill costs its launches, not its reads.
        # So are a speculative step's verify forward and draft steps (`logits`).
        self.graphed_prefill = self.graphed_forward = None
        if self.device.type == "cuda" and os.environ.get("BRISKLM_CUDA_GRAPHS") != "0":
            self.graphed_prefill, self.graphed_forward = None if moe else replayed(self._prefill), replayed(forward)
        self.stats = GenerationStats(weight_bytes=weight_bytes_per_token(model))

    def reset(self):
        self.cached = []

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check(self, prompt_ids: list[int], max_new_tokens: int):
        """Raise ValueError for a request this generator cannot serve."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > self.max_seq_length:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_new_tokens="
                             f"{max_new_tokens} exceeds the KV cache of {self.max_seq_length} tokens")
        vocab = self.model.args.vocab_size
        bad = next((i for i in prompt_ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")

    def _speculated(self, prompt_ids, first: int, max_new_tokens, params, stop, drafter, k, t0, adapt=True):
        """The decode loop of speculative decoding (speculative.py), after the first token."""
        stats = self.stats
        history = [*prompt_ids, first]
        stats.prefill_s, stats.new_tokens = time.perf_counter() - t0, 1
        t_decode = time.perf_counter()
        drafter.kept(len(prompt_ids))
        yield first
        if first in stop:
            return
        # (how many drafts pay: from the step costs measured with this drafter, in this run and before)
        try:
            costs = self.draft_costs.setdefault(drafter, {})
        except TypeError:  # (a drafter that cannot be a weak key: measured afresh each run)
            costs = {}
        policy = DraftPolicy(k, costs=costs) if adapt else None
        while stats.new_tokens < max_new_tokens:
            here = len(history) - 1  # the position of the newest token, not yet in the cache
            room = max_new_tokens - stats.new_tokens - 1  # drafts beyond it could not be emitted
            n, t_step = policy.choose(room) if policy else min(k, room), time.perf_counter()
            drafts, q = drafter.propose(history, n, params, self.logits) if n else ([], None)
            if drafts:
                logits = self.logits([history[-1], *drafts], here)[0]  # (1 + drafts, V)
                emitted = accept(logits, drafts, q, params)  # (reads the tokens: the step's time is known)
                steps = 1
            else:  # nothing to check: plain decoding's own steps, queued ahead as its loop does,
                # as many as the policy will not draft for (one where a drafter found nothing)
                steps = min(policy.plain_steps() if policy and not n else 1, room + 1)
                run = self._run(torch.tensor([history[-1]], device=self.device), here, steps, params)
                next(run)  # (the token fed first: known)
                emitted = []
                for value in run:
                    emitted.append(value)
                    if value in stop:
                        break
            if policy:
                seconds = self._agreed(time.perf_counter() - t_step)
                policy.update(len(drafts), len(emitted) - 1 if drafts else 0, seconds, steps=steps)
            stats.target_steps += steps
            drafter.kept(here + len(emitted))  # the newest token and the kept drafts hold their keys
            self.cached = history + emitted[:-1]  # (the last emitted token is not in the cache yet)
            for value in emitted:
                history.append(value)
                stats.new_tokens += 1
                stats.decode_s = time.perf_counter() - t_decode
                yield value
                if value in stop:
                    self.cached = history[:-1]
                    return

    def _agreed(self, seconds: float) -> float:
        """A step's time as every tensor-parallel rank takes it (the slowest
        rank's): the draft policy must choose the same drafts on every rank,
        whose steps meet in the same collectives."""
        group = self.model.tensor_parallel
        if group is None:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, torch.distributed.ReduceOp.MAX, group=group)
        return t.item()

    def _run(self, token: torch.Tensor, pos: int, steps: int, params: SamplingParams) -> Iterator[int]:
        """Yield token (1,) (on the device, at position pos) and the `steps`
        tokens decoded after it, as host ints. Each step is queued before the
        token it follows is read, so the GPU never waits for the host between
        steps (the caller may stop early: a step already queued wrote keys past
        the tokens it keeps, which later steps write again)."""
        eager = not self.compiled and not self.graphed  # (eager steps slice the cache on the host)
        # The step's position lives on the device and is advanced there: making
        # it from a host int each step would copy from pageable memory, which
        # waits for the GPU and so starves it for the next step's launch time.
        step_pos = torch.tensor([pos], device=self.device)
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        for i in range(steps + 1):
            host = token.to("cpu", non_blocking=True)
            if ready is not None:
                ready.record()
            if i < steps:  # queue the next step before looking at this token
                if self.compiled and self.device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                nxt = self._decode(self.model, token, step_pos, params, kv_len=pos + i + 1 if eager else None,
                                   block_mask=self.block_mask)
                token = nxt.clone()  # CUDA graph outputs are overwritten by the next replay
                step_pos = step_pos + 1
            if ready is not None:
                ready.synchronize()
            yield int(host.item())

    def _padded(self, ids: list[int], start: int, max_seq_length: int, graphed):
        """(ids as a (1, T) tensor, positions, kv_len, whether a graph holds them):
        padded to a bucket when a CUDA graph holds them. The padding's keys and
        values land past the given tokens, where each later step writes its own
        before any query reads them."""
        n = len(ids)
        shape = graphed and prefill_shape(start, n, max_seq_length)
        padded, kv_len = shape if shape else (n, start + n)
        if isinstance(ids, torch.Tensor):  # one token on the device: nothing to pad
            new = ids.reshape(1, 1)
        else:
            new = torch.tensor([ids + [0] * (padded - n)], dtype=torch.long, device=self.device)
        return new, torch.arange(start, start + padded, device=self.device), kv_len, bool(shape)

    def prefill(self, ids: list[int], start: int, params: SamplingParams) -> torch.Tensor:
        """The keys and values of ids at positions start.. into the cache -> the
        next token (1,), from a CUDA graph where one holds them (`_padded`)."""
        new, pos, kv_len, graphed = self._padded(ids, start, self.max_seq_length, self.graphed_prefill)
        last = torch.tensor([len(ids) - 1], device=self.device)
        run = self.graphed_prefill if graphed else self._prefill
        token = run(self.model, new, pos, params, kv_len=kv_len, last=last)
        return token.clone() if graphed else token

    @torch.no_grad()  # (as generation runs it: a compiled step guards on grad mode)
    def logits(self, ids: list[int], start: int, model: Transformer | None = None, last: int | None = None,
               depth: int | None = None) -> torch.Tensor:
        """Logits (1, len(ids), V) of ids (a list, or one token as a (1,)
        tensor) at positions start.., or (1, 1, V) at index `last` only, of
        this generator's model or of `model` (a draft with its own cache),
        their keys and values into its cache; compiled (rows_logits) where
        decoding is, else from a CUDA graph where one holds them (`_padded`)."""
        model = model or self.model
        n = len(ids)
        rows = 1 if n == 1 else self.verify_rows if last is None and n <= self.verify_rows else None
        if self._rows is not None and rows and start + rows <= model.max_seq_length:
            new = ids.reshape(1, 1) if isinstance(ids, torch.Tensor) else torch.tensor(
                [ids + [0] * (rows - n)], dtype=torch.long, device=self.device)
            if self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            out = self._rows(model, new, torch.arange(start, start + rows, device=self.device), depth=depth)
            return out[:, :n].clone() if last is None else out[:, last:last + 1].clone()
        new, pos, kv_len, graphed = self._padded(ids, start, model.max_seq_length, self.graphed_forward)
        at = None if last is None else torch.tensor([last], device=self.device)
        out = (self.graphed_forward if graphed else forward)(model, new, pos, kv_len=kv_len, last=at, depth=depth)
        out = out if last is not None else out[:, :len(ids)]
        return out.clone() if graphed else out

    @torch.no_grad()
    def tokens(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
               stop_ids=(), seed: int | None = None, drafter=None, draft_tokens: int = 4,
               adapt_drafts: bool = True) -> Iterator[int]:
        """Yield up to max_new_tokens sampled ids; stops after yielding a stop id.
        With a drafter (speculative.py), each target forward checks up to
        draft_tokens proposed ones: as many as pay, by the run's own measure
        (speculative.DraftPolicy), or always draft_tokens (adapt_drafts=False)."""
        self.check(prompt_ids, max_new_tokens)
        if seed is not None:
            torch.manual_seed(seed)
        # Reuse the cached prefix; keep at least one prompt token to prefill.
        start = 0
        limit = min(len(self.cached), len(prompt_ids) - 1)
        while start < limit and self.cached[start] == prompt_ids[start]:
            start += 1
        self.cached = list(prompt_ids[:start])
        stats = self.stats = GenerationStats(prompt_tokens=len(prompt_ids), reused_tokens=start,
                                             weight_bytes=self.stats.weight_bytes)
        stop = set(stop_ids)
        t0 = time.perf_counter()
        token = self.prefill(prompt_ids[start:], start, params)
        self.cached.extend(prompt_ids[start:])
        if drafter is not None:
            self.verify_rows = draft_tokens + 1
            yield from self._speculated(prompt_ids, int(token), max_new_tokens, params, stop, drafter,
                                        draft_tokens, t0, adapt_drafts)
            return
        for i, value in enumerate(self._run(token, len(prompt_ids), max_new_tokens - 1, params)):
            if i == 0:
                stats.prefill_s = time.perf_counter() - t0
                t_decode = time.perf_counter()
            stats.new_tokens = i + 1
            stats.decode_s = time.perf_counter() - t_decode
            if i + 1 < max_new_tokens:  # (its step is queued: its keys are in the cache)
                self.cached.append(value)
            yield value
            if value in stop:
                break
        self._sync()
        if stats.new_tokens > 1:
            stats.decode_s = time.perf_counter() - t_decode
