"""The decode loop: prefill, then one-token steps, stop criteria, streaming.

The shape follows gpt-fast's decode_n_tokens; how each step runs (eager,
CUDA graphs, compiled) is steps.py's business. Positions are tensors and the
KV cache is static, so a step has fixed shapes. The loop never blocks the
device on the host: the token of step i is copied to the host while step i+1
is already queued, and EOS is checked on that copy, so the GPU never waits
for Python.

`Generator` also remembers which tokens its KV cache holds: a new prompt that
extends the previous conversation only prefills the new part (multi-turn chat
reuses the cache instead of re-reading the history).
"""
from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch

from .model import Transformer, cached_prefix
from .sampling import SamplingParams, masked
from .speculative import DraftPolicy, StepCosts, accept
from .steps import Steps


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
    drafted_steps: int = 0  # ... of which checked drafts (the rest: plain steps, where drafts did not pay)
    drafts: int = 0  # draft tokens checked
    kept_drafts: int = 0  # ... of which the target kept

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


def next_or_none(run: Iterator[int], message=None) -> int | None:
    """run's next token (sending it message), or None where it has ended."""
    try:
        return run.send(message)
    except StopIteration:
        return None


class Generator:
    """Owns a model with its KV cache and its steps (steps.Steps)."""

    def __init__(self, model: Transformer, max_seq_length: int, compile: bool = False,
                 compile_prefill: bool = False, compile_options: dict | None = None, kv_int8: bool = False):
        self.model = model
        self.device = model.device
        self.max_seq_length = max_seq_length
        model.setup_caches(1, max_seq_length, kv_int8)
        self.cached: list[int] = []  # tokens whose keys/values are in the cache
        self.prompt_span = (0, 0)  # the positions the last prompt forward wrote (reuse)
        self.steps = Steps(model, max_seq_length, compile, compile_prefill, compile_options)
        self.switched_midway = None  # (the compile's seconds, where a request switched to it: said later)
        self.draft_costs = weakref.WeakKeyDictionary()  # drafter -> greedy -> seconds a step by drafts
        self.stats = GenerationStats(weight_bytes=weight_bytes_per_token(model))

    def reset(self):
        self.cached, self.prompt_span = [], (0, 0)

    def reuse(self, ids: list[int], limit: int) -> int:
        """How many leading ids to keep from the cache (at most limit). A prompt
        that repeats the last prompt forward whole runs that forward again, not
        its last token alone: one row rounds otherwise than many, and in bf16
        the same request twice would not answer the same."""
        n = cached_prefix(self.cached, ids, limit)
        start, end = self.prompt_span
        return start if start < n == end - 1 else n

    def prefilled(self, ids: list[int], start: int):
        """Record that ids were written from position start on, by one prompt forward."""
        self.cached = [*self.cached[:start], *ids]
        self.prompt_span = (start, start + len(ids))

    def adopt_compiled(self, end: int) -> bool:
        """Switch to the step compiling on another thread if it is ready
        (Steps.adopt; end: the positions a request can reach); its graphs'
        runs write the cache's last positions, which no longer hold what
        they held. True if this call switched."""
        if not self.steps.adopt(end):
            return False
        del self.cached[self.max_seq_length - self.steps.reserved:]
        return True

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

    def _speculated(self, prompt_ids, first: int, max_new_tokens, params, stop, drafter, k, t0, adapt=True,
                    constraint=None):
        """The decode loop of speculative decoding (speculative.py), after the
        first token; under a constraint, each position verified under its own
        mask (_verify), the plain steps masked (_masked_run)."""
        stats = self.stats
        history = [*prompt_ids, first]
        stats.prefill_s, stats.new_tokens = time.perf_counter() - t0, 1
        self.t_decode = time.perf_counter()
        drafter.kept(len(prompt_ids))
        yield first
        if first in stop:
            return
        # (how many drafts pay: from the step costs measured with this drafter, in this run and before;
        # apart for greedy and sampled runs, whose steps cost differently: a cost measured where drafting
        # did not pay is not measured again, so one kind's must not stop the other's drafting)
        fresh = StepCosts(paying=getattr(drafter, "hopeful", False))
        try:
            costs = self.draft_costs.setdefault(drafter, {}).setdefault(params.greedy, fresh)
        except TypeError:  # (a drafter that cannot be a weak key: measured afresh each run)
            costs = fresh
        policy = DraftPolicy(k, costs=costs, free_judging=hasattr(drafter, "judge")) if adapt else None
        shortest = {"shortest": policy.SHORTEST_CONTEXT} if policy and policy.free_judging else {}
        settings = params.on(self.device)
        while stats.new_tokens < max_new_tokens and not (constraint and constraint.done):
            here = len(history) - 1  # the position of the newest token, not yet in the cache
            room = max_new_tokens - stats.new_tokens - 1  # drafts beyond it could not be emitted
            n, t_step = policy.choose(room) if policy else min(k, room), time.perf_counter()
            drafts, q = drafter.propose(history, n, params, self.logits, **shortest) if n else ([], None)
            if drafts:
                drafts, emitted = self._verify(history, drafts, q, params, constraint, settings)
            if not drafts:  # nothing to check: plain decoding's own steps, queued ahead as its loop does
                if policy and policy.free_judging and 0 in policy.cost and constraint is None:
                    run = self._judged_run(history, room, policy, drafter, settings, stop, t_step)
                else:  # (as many as the policy will not draft for; one where a drafter found nothing)
                    steps = min(policy.plain_steps() if policy and not n else 1, room + 1)
                    run = self._plain_steps(history, steps, policy, drafter, settings, stop, constraint, t_step)
                if (yield from run):
                    return
                continue
            if policy:
                policy.update(len(drafts), len(emitted) - 1, self._agreed(time.perf_counter() - t_step))
            stats.target_steps += 1
            stats.drafted_steps += 1
            stats.drafts += len(drafts)
            stats.kept_drafts += len(emitted) - 1
            drafter.kept(here + len(emitted))  # the newest token and the kept drafts hold their keys
            self.cached = history + emitted[:-1]  # (the last emitted token is not in the cache yet)
            for value in emitted:
                if (yield from self._emit(history, value, stop)):
                    return

    def _emit(self, history: list[int], value: int, stop) -> Iterator[int]:
        """Yield a speculative loop's token; True where it ends the generation."""
        history.append(value)
        self.stats.new_tokens += 1
        self.stats.decode_s = time.perf_counter() - self.t_decode
        yield value
        if value in stop:
            self.cached = history[:-1]
            return True
        return False

    def _plain_steps(self, history, steps, policy, drafter, settings, stop, constraint, t_step):
        """`steps` plain steps, then their drafts judged where the drafter
        judges for free; True where the generation ended."""
        here = len(history) - 1
        emitted = []
        for value in self._plain_run(history[-1], here, steps, settings, constraint):
            emitted.append(value)
            if value in stop:
                break
        if policy:
            policy.update(0, 0, self._agreed(time.perf_counter() - t_step), steps=steps)
        self.stats.target_steps += len(emitted)
        drafter.kept(here + len(emitted))
        self.cached = history + emitted[:-1]
        for value in emitted:
            if (yield from self._emit(history, value, stop)):
                return True
        if policy and policy.free_judging and emitted:  # what drafting would have kept
            policy.observe(*drafter.judge(history, len(history) - len(emitted), policy.max_k,
                                          shortest=policy.SHORTEST_CONTEXT))
        return False

    def _judged_run(self, history, room, policy, drafter, settings, stop, t_step):
        """Plain steps for a drafter that judges its drafts for free (prompt
        lookup): each token judged as it comes, while the device runs the
        next step, and the run left once drafting would pay (after the step
        queued then, whose token is kept), so that text where drafts fail
        decodes as plainly as without a drafter; True where the generation
        ended. (Not under a constraint: its masked steps run as _plain_steps.)"""
        k, judged_to, made, waited, leaving = policy.max_k, len(history), 0, 0.0, False
        run = self._plain_run(history[-1], len(history) - 1, room + 1, settings, None)
        value = next(run, None)
        while value is not None:
            made += 1
            self.stats.target_steps += 1
            t_out = time.perf_counter()
            if (yield from self._emit(history, value, stop)):
                return True
            waited += time.perf_counter() - t_out  # (the consumer's time is not the step's)
            if not leaving and len(history) - k > judged_to:  # (a position is judged once k tokens follow it)
                policy.observe(*drafter.judge(history, judged_to, k, end=len(history) - k,
                                              shortest=policy.SHORTEST_CONTEXT))
                judged_to = len(history) - k
                # (only where there is a draft to check now; the step queued already is the run's last)
                leaving = (made < room - 1 and policy.pays(room - made - 1)
                           and bool(drafter.propose(history, k, None, shortest=policy.SHORTEST_CONTEXT)[0]))
            value = next_or_none(run, leaving)
        policy.update(0, 0, self._agreed(time.perf_counter() - t_step - waited), steps=made)
        drafter.kept(len(history) - 1)
        self.cached = history[:-1]  # (the newest token is not in the cache yet)
        return False

    def _verify(self, history: list[int], drafts: list[int], q, params, constraint,
                settings=None) -> tuple[list[int], list[int]]:
        """One verify forward of the newest token and drafts -> (the drafts
        checked, the tokens emitted: the kept drafts and one more). Under a
        constraint the drafts the grammar refuses are cut before the forward,
        and each row is accepted under the mask after the drafts before it,
        computed while the device runs the forward; so the tokens are those
        of masked plain decoding (greedy), or distributed as them (sampled)."""
        here = len(history) - 1
        if constraint is None:
            logits = self.logits([history[-1], *drafts], here)[0]  # (1 + drafts, V)
            # (accept reads the tokens: the step's time is known)
            return drafts, accept(logits, drafts, q, settings, self.steps.chooser)
        # (a sampled draft model's refused draft stays: its rejection draws from the residual p - q)
        refused = q is not None and not params.greedy
        drafts = drafts[:constraint.allowed_drafts(drafts) + refused]
        if not drafts:
            return [], []
        logits = self.logits([history[-1], *drafts], here)[0]
        drafts, rows, consumed = constraint.draft_masks(drafts, keep_refused=refused)
        logits = masked(logits[:len(drafts) + 1], rows.to(self.device, non_blocking=True))
        emitted = accept(logits, drafts, None if q is None else q[:len(drafts)], settings, self.steps.chooser)
        return drafts, constraint.settle(consumed, emitted)

    def _plain_run(self, token: int, pos: int, steps: int, settings, constraint) -> Iterator[int]:
        """The `steps` tokens after token (a host int at position pos, not in
        the cache) by plain decoding steps queued ahead: _run's, or under a
        constraint _masked_run's."""
        device_token = torch.tensor([token], device=self.device)
        if constraint is None:
            run = self._run(device_token, pos, steps, settings)
            next(run)  # (the token fed first: known)
            return run
        logits = self.constrained_steps.forward(device_token, pos)
        return self._masked_run(logits, pos + 1, steps, settings, constraint)

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

    def _agreed_seed(self, seed: int | None) -> int | None:
        """The seed of a request on every tensor-parallel rank: where none is
        given, the first rank's draw, shared (each rank's own random numbers
        would sample different tokens, and the ranks' steps would part)."""
        group = self.model.tensor_parallel
        if seed is not None or group is None:
            return seed
        t = torch.randint(2**62, (1,), device=self.device)
        torch.distributed.broadcast(t, src=torch.distributed.get_global_rank(group, 0), group=group)
        return t.item()

    def _run(self, token: torch.Tensor, pos: int, steps: int, settings) -> Iterator[int]:
        """Yield token (1,) (on the device, at position pos) and the `steps`
        tokens decoded after it, as host ints. Each step is queued before the
        token it follows is read, so the GPU never waits for the host between
        steps (the caller may stop early: a step already queued wrote keys past
        the tokens it keeps, which later steps write again; or send True to
        make the step queued the last)."""
        # The step's position lives on the device and is advanced there: making
        # it from a host int each step would copy from pageable memory, which
        # waits for the GPU and so starves it for the next step's launch time.
        step_pos = torch.tensor([pos], device=self.device)
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        i = 0
        while i <= steps:
            if i < steps and self.steps.decode_ready_midway(pos + steps + 1):  # (a long run gains from it now)
                self._sync()  # (the step queued last replays the graph the switch replaces)
                if self.adopt_compiled(pos + steps + 1):
                    self.switched_midway = self.steps.compile_s
            host = token.to("cpu", non_blocking=True)
            if ready is not None:
                ready.record()
            elif i == 0:  # (on a CPU the token is ready now, and the next step runs in the call below)
                self.first_token_at = time.perf_counter()
            if i < steps:  # queue the next step before looking at this token
                token = self.steps.decode(token, step_pos, settings, kv_len=pos + i + 1)
                step_pos = step_pos + 1
            if ready is not None:
                ready.synchronize()
                if i == 0:
                    self.first_token_at = time.perf_counter()
            if (yield int(host.item())):  # (sent by the caller: the step queued now is the last)
                steps = min(steps, i + 1)
            i += 1

    def _constrained(self, prompt_ids, start: int, max_new_tokens: int, settings, stop, constraint, t0):
        """The decode loop under a grammar (constrain.Constraint): _masked_run
        from the prompt's logits. Ends when the grammar is complete, without a
        step for the end token."""
        stats = self.stats
        logits = self.constrained_steps.prefill(prompt_ids[start:], start)  # (1, V)
        self.prefilled(prompt_ids[start:], start)
        t_decode = None
        for i, value in enumerate(self._masked_run(logits, len(prompt_ids), max_new_tokens, settings, constraint)):
            if i == 0:
                t_decode = self.first_token_at
                stats.prefill_s = t_decode - t0
            if i + 1 < max_new_tokens:  # (its keys are in the cache)
                self.cached.append(value)
            stats.new_tokens = i + 1
            stats.decode_s = time.perf_counter() - t_decode
            yield value
            if value in stop:
                break
        self._sync()
        if t_decode is not None and stats.new_tokens > 1:
            stats.decode_s = time.perf_counter() - t_decode

    def _masked_run(self, logits: torch.Tensor, pos: int, steps: int, settings, constraint) -> Iterator[int]:
        """Up to `steps` tokens sampled with the tokens the grammar forbids
        masked out, the first from logits (1, V), at position pos. The forward
        of token i is queued before the host reads it, so the host computes
        the mask of token i+1 (llguidance, on the CPU) while the device runs
        that forward; then the masked sampling is queued. Each token is given
        to the constraint when the caller asks for the next (a caller that
        stops at a stop token does not); ends where the grammar is complete.
        The forward of the last token is not run."""
        steps_ = self.constrained_steps
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        for i in range(steps):
            bits = constraint.mask()  # (overlaps the forward queued last)
            if bits is None:
                return
            token = steps_.sample(logits, settings, bits.to(self.device, non_blocking=True))
            host = token.to("cpu", non_blocking=True)
            if ready is not None:
                ready.record()
            elif i == 0:  # (as in _run: on a CPU the token is ready now, the forward runs below)
                self.first_token_at = time.perf_counter()
            if i + 1 < steps:  # queue the next forward before reading this token
                logits = steps_.forward(token, pos + i)
            if ready is not None:
                ready.synchronize()
                if i == 0:
                    self.first_token_at = time.perf_counter()
            value = int(host.item())
            yield value
            constraint.advance(value)

    @functools.cached_property
    def constrained_steps(self):
        """The steps of _constrained (steps.ConstrainedSteps), made at first use."""
        from .steps import ConstrainedSteps
        return ConstrainedSteps(self.steps)

    @torch.no_grad()  # (as generation runs it: a compiled step guards on grad mode)
    def logits(self, ids, start: int, model: Transformer | None = None, last: int | None = None,
               depth: int | None = None) -> torch.Tensor:
        """Logits of ids at positions start.. (Steps.logits): speculative steps, scoring."""
        return self.steps.logits(ids, start, model, last, depth)

    @torch.no_grad()
    def tokens(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
               stop_ids=(), seed: int | None = None, drafter=None, draft_tokens: int = 4,
               adapt_drafts: bool = True, constraint=None) -> Iterator[int]:
        """Yield up to max_new_tokens sampled ids; stops after yielding a stop id.
        With a drafter (speculative.py), each target forward checks up to
        draft_tokens proposed ones: as many as pay, by the run's own measure
        (speculative.DraftPolicy), or always draft_tokens (adapt_drafts=False).
        With a constraint (constrain.Constraint), every token is sampled among
        those its grammar allows (_constrained; speculated: _verify)."""
        self.check(prompt_ids, max_new_tokens)
        self.adopt_compiled(len(prompt_ids) + max_new_tokens)
        seed = self._agreed_seed(seed)
        if seed is not None:
            torch.manual_seed(seed)
        start = self.reuse(prompt_ids, len(prompt_ids) - 1)  # (one token, at least, to prefill)
        self.cached = list(prompt_ids[:start])
        stats = self.stats = GenerationStats(prompt_tokens=len(prompt_ids), reused_tokens=start,
                                             weight_bytes=self.stats.weight_bytes)
        stop = set(stop_ids)
        t0 = time.perf_counter()
        settings = params.on(self.device)
        if constraint is not None and drafter is None:  # (a loop of its own: unconstrained decoding keeps
            yield from self._constrained(prompt_ids, start, max_new_tokens, settings, stop, constraint, t0)
            return  # its fast path)
        if constraint is not None:  # (the first token under the grammar, then speculation under it)
            logits = self.constrained_steps.prefill(prompt_ids[start:], start)
            self.prefilled(prompt_ids[start:], start)
            first = list(self._masked_run(logits, len(prompt_ids), 1, settings, constraint))
            if not first:
                return
            self.steps.verify_rows = draft_tokens + 1
            yield from self._speculated(prompt_ids, first[0], max_new_tokens, params, stop, drafter,
                                        draft_tokens, t0, adapt_drafts, constraint)
            return
        token = self.steps.prefill(prompt_ids[start:], start, settings)
        self.prefilled(prompt_ids[start:], start)
        if drafter is not None:
            self.steps.verify_rows = draft_tokens + 1
            yield from self._speculated(prompt_ids, int(token), max_new_tokens, params, stop, drafter,
                                        draft_tokens, t0, adapt_drafts)
            return
        for i, value in enumerate(self._run(token, len(prompt_ids), max_new_tokens - 1, settings)):
            if i == 0:  # (the time the first token was ready: the decode steps' time follows it)
                stats.prefill_s = self.first_token_at - t0
                t_decode = self.first_token_at
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
