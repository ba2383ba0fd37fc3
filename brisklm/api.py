"""The Python API: `brisklm.load(...) -> LLM`, then generate / stream / chat.

    import brisklm
    llm = brisklm.load()                      # the bundled SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", max_new_tokens=20))
    for piece in llm.stream("Once upon a time"):
        print(piece, end="", flush=True)
    llm.chat([{"role": "user", "content": "Hi!"}])
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from . import chat as chat_templates
from .console import log, quiet_compiler, step
from .constrain import prepare as prepare_constraints
from .errors import BriskError, as_user_error
from .generate import Generator
from .memory import cache_length, supported_context
from .model import Transformer, cached_prefix
from .sampling import SamplingParams
from .tokenizer import Tokenizer


SPECULATE = ("ngram", "self", "draft")


def default_draft_tokens(speculate: str | None) -> int:
    """Drafts a verify step checks at most, where the user names none: 8 for
    prompt lookup (its drafts cost nothing to make, and on a GPU a verify of
    9 rows cost about what one of 5 did: RESULTS.md), 4 for a drafting model
    (each draft is a step of it)."""
    return 8 if speculate == "ngram" else 4


def drafter(model: Transformer, speculate: str | None, draft_tokens: int | None, draft_layers: int | None):
    """The drafter for speculate ("ngram": prompt lookup; "self": the model's
    first draft_layers layers, by default a quarter of them), or None."""
    from .speculative import ModelDrafter, NgramDrafter
    if speculate is None:
        return None
    if speculate not in SPECULATE:
        raise BriskError(f"unknown speculate {speculate!r} (choose from {', '.join(SPECULATE)})")
    if draft_tokens is not None and not 1 <= draft_tokens <= 16:
        raise BriskError(f"draft_tokens must be 1..16, got {draft_tokens}")
    layers = model.args.num_hidden_layers
    if speculate == "ngram":
        return NgramDrafter()
    if speculate == "draft":  # (load() makes the draft model and sets the drafter)
        return None
    depth = max(1, layers // 4) if draft_layers is None else draft_layers
    if not 1 <= depth < layers:
        raise BriskError(f"draft_layers must be 1..{layers - 1} (the model has {layers}), got {depth}")
    return ModelDrafter(model, depth=depth)


def compiling():
    """The context our modules compile in (Steps.compile_later, on its own
    thread): the GEMV blocks traced as constants (kernels.gemv), the
    compiler's output kept from the user."""
    from .kernels import gemv
    gemv.traced_as_constants()
    return quiet_compiler(warnings_too=False)


def what_compiles(steps, wait: bool) -> tuple[str, str]:
    """What LLM.warm_up says it does first, and what compiles on another thread meanwhile."""
    cpu = steps.device.type == "cpu"
    block = steps.compile_kind(wait) == "block"
    what = "one layer's step" if block else "the decode step"
    if block:
        takes = "about a minute on 2 CPU cores" if cpu else "~10-60 s"
    else:
        takes = "about 1.5 minutes on 2 CPU cores" if cpu else "minutes"
    takes += " the first time, then seconds from the compiler's cache"
    if steps.compiled and wait:
        return f"Compiling {what} ({takes})" + ("" if cpu else "; then capturing CUDA graphs"), ""
    start = "Capturing the steps' CUDA graphs" if steps.graphed or steps.graphed_prefill else "Warming up the steps"
    return start, f"{what} compiles on another thread meanwhile ({takes}); requests switch to it once it is ready"


class LLM:
    """A loaded model with its tokenizer and generator."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, *, max_seq_length=None,
                 compile=False, compile_prefill=False, compile_options=None, name="model", kv_int8=False,
                 allow_long_context=False, quiet=True, speculate=None, draft_tokens=None, draft_layers=None):
        self.model = model
        self.quiet = quiet
        self.drafter = drafter(model, speculate, draft_tokens, draft_layers)
        self.draft_tokens = draft_tokens or default_draft_tokens(speculate)
        self.tokenizer = tokenizer
        self.name = name
        self.context = supported_context(model.args)
        device, dtype = model.device, model.dtype
        length = cache_length(model.args, device, dtype, kv_int8, max_seq_length, allow_long_context, quiet)
        try:
            self.generator = Generator(model, length, compile=compile, compile_prefill=compile_prefill,
                                       compile_options=compile_options, kv_int8=kv_int8)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            raise BriskError(f"max_seq_length {length}: the KV cache does not fit in memory "
                             f"({str(e).splitlines()[0][:160]})") from None

    @property
    def stats(self):
        return self.generator.stats

    def require_tokenizer(self) -> Tokenizer:
        """The tokenizer; a BriskError if the model has none (a preset with random weights)."""
        if self.tokenizer is None:
            raise BriskError(f"{self.name}: no tokenizer (give a checkpoint with tokenizer files)")
        return self.tokenizer

    def stream_ids(self, prompt_ids: list[int], max_new_tokens: int = 256,
                   temperature: float = 0.0, top_k=None, top_p=None, min_p=None,
                   seed=None, stop_ids=None, json_schema=None, regex=None, grammar=None) -> Iterator[int]:
        """Yield sampled token ids. Bad arguments raise here, before anything is generated.
        json_schema (a dict or its JSON text), regex or grammar (Lark or GBNF
        text, or a constrain.Grammar): the output matches it (constrain.py)."""
        from .constrain import compile_grammar
        constraint = compile_grammar(self.tokenizer, self.model.args.vocab_size, json_schema, regex, grammar)
        if stop_ids is None:
            stop_ids = self.tokenizer.eos_ids if self.tokenizer else ()
        with as_user_error():
            params = SamplingParams(temperature, top_k, top_p, min_p)
        self.check(prompt_ids, max_new_tokens)
        self.switch_compiled(len(prompt_ids) + max_new_tokens)
        return self.generator.tokens(prompt_ids, max_new_tokens, params, stop_ids, seed, self.drafter,
                                     self.draft_tokens, constraint=constraint and constraint.constraint())

    def remember_requests(self):
        """Prompt lookup (speculate="ngram") drafts from earlier requests'
        prompts and outputs too, a bounded memory of them (brisk serve, brisk
        chat: agentic and repeated-edit work reuses its own earlier text)."""
        from .speculative import NgramDrafter
        if isinstance(self.drafter, NgramDrafter):
            self.drafter.remember = True

    def check(self, prompt_ids: list[int], max_new_tokens: int):
        """A BriskError for a request this model cannot serve; one too long
        for the KV cache says what would make it fit."""
        if prompt_ids and max_new_tokens >= 1 and not self.fits(prompt_ids, max_new_tokens):
            raise BriskError(f"prompt of {len(prompt_ids)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                             f"KV cache of {self.generator.max_seq_length} tokens; {self.cache_advice()}")
        with as_user_error():
            self.generator.check(prompt_ids, max_new_tokens)

    def cache_advice(self) -> str:
        """What lets a longer request fit: a longer cache, up to the model's context."""
        if self.generator.max_seq_length < self.context:
            return (f"--max_seq_length (max_seq_length= in load()) raises it, "
                    f"up to the model's context of {self.context} tokens")
        return "it holds the model's whole context: shorten the prompt or max_new_tokens"

    def fits(self, prompt_ids: list[int], max_new_tokens: int) -> bool:
        """Whether the prompt and max_new_tokens fit the KV cache."""
        return len(prompt_ids) + max_new_tokens <= self.generator.max_seq_length

    def warm_up(self, prompt_ids: list[int] | None = None, quiet: bool = True, prompts: list[int] | None = None,
                constrained: bool | None = None, wait: bool | None = None, sampled: bool | None = None) -> float:
        """Capture (and compile) the steps requests can need (steps.Steps.warm_up:
        greedy and sampled decoding, every prefill bucket; with speculation, its
        verify and draft steps on prompt_ids; constrained decoding's), saying
        what it costs first, so that no request waits for the compiler. With
        `prompts` (prompt lengths), only their prefill graphs, and constrained
        decoding's steps only if asked: the rest waits for warm_pending.
        What compiles (CUDA's default: one block) compiles on another thread
        while requests run uncompiled (Steps.compile_later), unless `wait`:
        by default on CPUs, where the uncompiled step is far slower and a
        compile is asked for (brisk chat and serve, which live long enough
        to gain, pass False); always under torchrun, whose ranks switch together.
        `sampled`: the requests' kind where all are one (True: sampled, False:
        greedy), else both are prepared. Without `prompts` and `constrained`
        (a server's start), OpenAI's json_object grammar compiles on a worker
        thread too (constrain.prepare). Returns the seconds taken (0 when there
        is nothing to prepare)."""
        import torch.distributed as dist
        gen = self.generator
        steps = gen.steps
        if constrained is None and prompts is None:  # (a server's start: its first json_object request)
            prepare_constraints(self.tokenizer, self.model.args.vocab_size)
        if steps.warm or not (steps.compiled or steps.graphed or steps.graphed_prefill):
            return 0.0
        cpu = gen.device.type == "cpu"
        wait = (cpu if wait is None else wait) or dist.is_initialized() or (steps.to_compile == "whole"
                                                                            and not cpu)
        start, later = what_compiles(steps, wait)
        speculative = self.drafter is not None and (steps.graphed or steps.compiled)
        if speculative:
            start += "; then speculative decoding's verify and draft steps"
        t0 = time.perf_counter()
        variants = [None, SamplingParams(temperature=1.0).on(gen.device)]
        variants = variants if sampled is None else variants[1:] if sampled else variants[:1]
        self.quiet = quiet
        with step(start, "Ready", quiet), quiet_compiler(), torch.no_grad():
            steps.warm_up(variants, prompts)
            if constrained or (constrained is None and prompts is None):
                gen.constrained_steps.warm_up(variants)
            if speculative:
                self.warm_speculative(prompt_ids or [0])
            if steps.compile_later(wait, inside=compiling) and wait:
                log(f"  (compiled in {steps.compile_s:.1f} s)", quiet)
        gen.reset()
        steps.warm = True
        graphs = steps.graph_count()
        log(f"  ({graphs} CUDA graphs captured)", quiet or not graphs)
        log(f"  ({later})", quiet or not steps.compiling)
        return time.perf_counter() - t0

    def wait_compiled(self) -> float | None:
        """Wait for the step compiling on another thread (warm_up) and switch to
        it; the seconds it took to compile, or None if nothing compiled. A
        failed compile raises (a RuntimeError naming the compiler's error)."""
        steps = self.generator.steps
        compiling = steps.compiling
        with torch.no_grad():
            self.generator.adopt_compiled(steps.max_seq_length)  # (which also cuts the cache the switch writes)
        if compiling and steps.compile_error is not None:
            raise RuntimeError(f"compiling the decode step failed: {steps.compile_error}") from steps.compile_error
        return steps.compile_s if compiling else None

    def switch_compiled(self, end: int = 0, announce: bool = True) -> bool:
        """Switch to the step compiling on another thread (warm_up) if it is
        ready (Generator.adopt_compiled; a request calls this at its start,
        `end` the positions it can reach), said on one line (announce); a
        failed compile is said once, and decoding goes on uncompiled. True
        if this call switched."""
        steps = self.generator.steps
        self.say_switched_midway(announce)
        if steps.compiler is None:
            return False
        adopted_before = steps.adopted  # (the decode step's stage, where the compile has two)
        with torch.no_grad():
            switched = self.generator.adopt_compiled(end)
        quiet = self.quiet or not announce
        if switched and adopted_before:
            log(f"[the compiled steps for prompts are ready too ({steps.compile_s:.1f} s in all)]", quiet)
        elif switched:  # (staged: the decode step's, while the other shapes compile on)
            what = "decode step" if steps.compiler is not None else "step"
            log(f"[the compiled {what} is ready ({steps.compile_s:.1f} s on another thread): full speed from here on]",
                quiet)
        elif steps.compiler is None:
            error = str(steps.compile_error).strip().splitlines() or [type(steps.compile_error).__name__]
            what = "the prompts' steps go on" if steps.adopted else "decoding goes on"
            log(f"[compiling the step failed, {what} uncompiled: {error[0][:200]}]", self.quiet)
        return switched

    def say_switched_midway(self, announce: bool = True):
        """Say, once, that a request switched to the compiled decode step
        between two of its steps (not said in the middle of its text)."""
        midway, self.generator.switched_midway = self.generator.switched_midway, None
        if midway is not None:
            log(f"[the compiled decode step is ready ({midway:.1f} s on another thread): the last request "
                f"switched to it]", self.quiet or not announce)

    def warm_pending(self, stop=lambda: False) -> bool:
        """Until stop() says so: wait for the step compiling on another
        thread and switch to it, then capture the prefill graphs that
        warm_up(prompts=...) left (another thread may call this while the
        process waits for input, never while it generates). True when none
        is left."""
        gen, steps = self.generator, self.generator.steps
        if gen.device.type == "cuda":
            torch.cuda.set_device(gen.device)  # (a thread's own setting)
        while steps.compiler is not None and not stop():  # (each stage: Steps.adopt)
            while steps.compiler.is_alive() and not stop():
                steps.compiler.join(0.05)
            if not stop():  # (the compiled step, ready, switched to quietly: the user may be typing)
                self.switch_compiled(announce=False)
        with torch.no_grad():
            return steps.warm_pending(stop, room=gen.max_seq_length - len(gen.cached))

    def warm_speculative(self, prompt_ids: list[int], drafter=None, draft_tokens: int | None = None):
        """Compile speculative decoding's steps for `drafter` (default: this
        LLM's) and record their CUDA graphs (steps.Steps.warm_speculative), so
        that no step of a timed or served run pays for that."""
        gen, drafter = self.generator, drafter or self.drafter
        if drafter is None or not (gen.steps.graphed or gen.steps.compiled):
            return
        depth = getattr(drafter, "depth", None)
        draft = getattr(drafter, "model", None) if depth is None else None
        with torch.no_grad():
            gen.steps.warm_speculative((draft_tokens or self.draft_tokens) + 1, prompt_ids, draft, depth)

    def score(self, ids: list[int], top: int = 0, start: int = 1) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """log p(ids[i] | ids[:i]) for i = start.., and at each of those
        positions the `top` most likely tokens with their log-probabilities
        (an evaluation's log-likelihoods; the server's logprobs).

        The last token is only predicted, never run, so ids may be one longer
        than the KV cache (as an evaluation's window of max_length inputs is).
        Keys and values of a prefix shared with what the cache holds are
        reused (the choices of one question share its context), so only the
        tokens after it run through the model."""
        gen = self.generator
        if not 1 <= len(ids) <= gen.max_seq_length + 1:
            raise BriskError(f"{len(ids)} tokens to score; 1..{gen.max_seq_length + 1} fit "
                             f"(a KV cache of {gen.max_seq_length}, and the last token predicted)")
        start = max(1, start)
        if start >= len(ids):
            return [], []
        inputs = ids[:-1]
        # (the logits at start - 1 must be computed; a question's choices share its context: not
        # gen.reuse, which would run a one-token choice's whole context again)
        reuse = cached_prefix(gen.cached, inputs, start - 1)
        gen.cached = list(inputs[:reuse])
        self.switch_compiled(len(inputs))
        with torch.no_grad():
            logits = gen.logits(inputs[reuse:], reuse)[0, start - 1 - reuse:]
        gen.prefilled(inputs[reuse:], reuse)
        logp = logits.float().log_softmax(-1)
        targets = torch.tensor(ids[start:], device=logp.device)
        chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
        if not top:
            return chosen, [[] for _ in chosen]
        values, indices = logp.topk(top, dim=-1)
        return chosen, [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]

    def stream(self, prompt: str, max_new_tokens: int = 256, stop: list[str] | str | None = None,
               **sampling) -> Iterator[str]:
        """Yield the continuation's text as it is produced (never broken UTF-8).

        Stops at the tokenizer's end tokens and before any of the stop strings;
        the end token and the stop string are not part of the text. sampling:
        temperature, top_k, top_p, min_p, seed, stop_ids (as stream_ids)."""
        check_keywords("stream", sampling, "stop")
        ids = self.require_tokenizer().encode(prompt)
        return self.stream_ids_as_text(ids, max_new_tokens, stop, **sampling)

    def stream_ids_as_text(self, ids, max_new_tokens, stop=None, **sampling) -> Iterator[str]:
        tokens = self.stream_ids(ids, max_new_tokens, **sampling)
        return text_pieces(self.require_tokenizer(), tokens, stop)

    def generate(self, prompt: str, max_new_tokens: int = 256, **kwargs) -> str:
        """The continuation of prompt (not including the prompt)."""
        check_keywords("generate", kwargs, "stop")
        return "".join(self.stream(prompt, max_new_tokens, **kwargs))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt=True) -> str:
        tok = self.require_tokenizer()
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_ids[0]) if tok.eos_ids else ""
        with as_user_error():
            return chat_templates.render(tok.chat_template, messages, add_generation_prompt,
                                         bos_token=bos, eos_token=eos)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The prompt ids of a conversation, rendered by the chat template; a
        special token's text inside a message is text (no role spoofing)."""
        tok = self.require_tokenizer()
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_ids[0]) if tok.eos_ids else ""
        with as_user_error():  # (the template already writes any BOS it wants)
            text, contents = chat_templates.render_marked(tok.chat_template, messages, bos_token=bos, eos_token=eos)
        return tok.encode_literal(text, contents)

    def chat_stream(self, messages: list[dict], max_new_tokens: int = 256, **kwargs) -> Iterator[str]:
        check_keywords("chat_stream", kwargs, "stop")
        return self.stream_ids_as_text(self.chat_ids(messages), max_new_tokens, kwargs.pop("stop", None), **kwargs)

    def chat(self, messages: list[dict], max_new_tokens: int = 256, **kwargs) -> str:
        """The assistant's reply to a conversation [{"role": ..., "content": ...}, ...]."""
        check_keywords("chat", kwargs, "stop")
        return "".join(self.chat_stream(messages, max_new_tokens, **kwargs))


SAMPLING_KEYWORDS = ("temperature", "top_k", "top_p", "min_p", "seed", "stop_ids", "json_schema", "regex", "grammar")


def check_keywords(method: str, given: dict, *more: str):
    """A TypeError that names the public method and the keyword meant, not
    the internal one a mistyped keyword would reach."""
    import difflib
    known = (*more, *SAMPLING_KEYWORDS)
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, ("max_new_tokens", *known), 1)
            raise TypeError(f"LLM.{method}() got an unexpected keyword argument {name!r}"
                            + (f"; did you mean {close[0]!r}?" if close else f" (it takes max_new_tokens, "
                                                                              f"{', '.join(known)})"))


def _first_stop(text: str, stops: list[str]) -> int:
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def text_pieces(tok: Tokenizer, tokens: Iterator[int], stop, ends=None) -> Iterator[str]:
    """Token ids -> text pieces, ending at an end token (ends: the tokenizer's
    by default) or before a stop string."""
    stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
    # Text that could still become a stop string is held back until decided.
    hold = max((len(s) for s in stops), default=1) - 1
    decoder, pending = tok.stream(), ""
    ends = set(tok.eos_ids if ends is None else ends)
    for token in tokens:
        if token in ends:
            break
        pending += decoder.push(token)
        cut = _first_stop(pending, stops)
        if cut >= 0:
            if cut:
                yield pending[:cut]
            return
        if len(pending) > hold:
            yield pending[:len(pending) - hold]
            pending = pending[len(pending) - hold:]
    pending += decoder.flush()
    cut = _first_stop(pending, stops)
    pending = pending[:cut] if cut >= 0 else pending
    if pending:
        yield pending
