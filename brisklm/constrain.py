"""Structured output: the tokens a grammar allows, for generation to sample from.

One layer under every entry point (the Python API, `brisk generate`, the
server's response_format, grammar field and forced tool calls), built on
llguidance (guidance-ai/llguidance), an Earley parser over a lazily built
lexer that gives the allowed set of a whole vocabulary in tens of
microseconds a token:

- a JSON schema (llguidance's JSON-schema compiler; `{}`: any JSON value,
  `{"type": "object"}`: any object, OpenAI's json_object);
- a regular expression (Rust regex syntax, matched whole);
- a grammar: llguidance's Lark dialect (which also embeds `%json {...}`
  schemas), or a llama.cpp GBNF grammar, converted to Lark by llguidance's own
  converter (most of GBNF: rules, alternatives, groups, repetitions `* + ? {m,n}`,
  character classes and literals).

`compile_grammar` turns one of those into a `Grammar` (compiled once, kept
in a small cache: agents send the same schema every request, and a compile
is bounded in time); `Grammar.constraint()` starts a `Constraint`, the
per-generation state that the decode loop (Generator._constrained) asks for
each token's mask and tells which token was chosen. The mask is a bitmask
(one bit a token, int32 words, llguidance's layout) written on the host;
sampling.sample_allowed applies it on the device.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout

import torch

from .errors import BriskError

COMPILE_TIMEOUT_S = 10.0  # a schema or grammar that takes longer to compile is refused
CACHE_SIZE = 64  # compiled grammars kept per tokenizer
INSTALL = "structured output needs llguidance: pip install 'brisklm[constrain]' (or pip install llguidance)"
KINDS = ("json_schema", "regex", "grammar")


def llguidance():
    """The llguidance module, or one error line saying how to install it."""
    try:
        import llguidance as ll
    except ImportError:
        raise BriskError(INSTALL) from None
    return ll


def available() -> bool:
    try:
        llguidance()
    except BriskError:
        return False
    return True


# --- the vocabulary as llguidance reads it -------------------------------------

def token_bytes(tokenizer) -> tuple[list[bytes], list[int]]:
    """(the bytes of every token, the ids of special tokens) of a
    sentencepiece or tiktoken backend, for llguidance's TokenizerWrapper."""
    backend = tokenizer.backend
    if hasattr(backend, "sp"):  # sentencepiece: "▁" is a space, <0xNN> a byte
        sp, out = backend.sp, []
        for i in range(backend.vocab_size):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("\u2581", " ").encode())
        return out, sorted(backend.special_ids)
    if hasattr(backend, "enc"):  # tiktoken
        enc = backend.enc
        specials = set(backend.specials.values())
        out = [backend.decode([i]).encode() if i in specials else enc.decode_single_token_bytes(i)
               for i in range(backend.vocab_size)]
        return out, sorted(specials)
    raise BriskError(f"structured output: no vocabulary reader for a {type(backend).__name__} tokenizer")


class _Vocabulary:
    """A duck-typed tokenizer for llguidance.TokenizerWrapper (ids in, text out)."""

    def __init__(self, tokenizer):
        self.tokens, self.special_token_ids = token_bytes(tokenizer)
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else 0
        self.bos_token_id = tokenizer.bos_id
        self.encode = tokenizer.backend.encode_text

    def __call__(self, text):
        return self.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Tokenizer -> (LLTokenizer, cache)
_LOCK = threading.Lock()


def _compiler(tokenizer, vocab_size: int):
    """(llguidance's tokenizer, the cache of compiled grammars) for ours: made
    once (reading a vocabulary takes about a second)."""
    ll = llguidance()
    with _LOCK:
        entry = _TOKENIZERS.get(tokenizer)
        if entry is None or entry[0].vocab_size != vocab_size:
            eos = list(tokenizer.eos_ids) or None
            if hasattr(tokenizer.backend, "tok"):  # Hugging Face tokenizers: llguidance reads its JSON itself
                lt = ll.LLTokenizer(tokenizer.backend.tok.to_str(), n_vocab=vocab_size, eos_token=eos)
            else:
                lt = ll.LLTokenizer(ll.TokenizerWrapper(_Vocabulary(tokenizer)), n_vocab=vocab_size, eos_token=eos)
            entry = _TOKENIZERS[tokenizer] = (lt, OrderedDict())
        return entry


# --- grammars -------------------------------------------------------------------

def _source(kind: str, value) -> str:
    """llguidance's grammar text for one kind of constraint; a BriskError
    naming what is wrong with it."""
    ll = llguidance()
    if kind == "json_schema":
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise BriskError(f"json_schema: not valid JSON ({e})") from None
        if isinstance(value, bool):  # (JSON Schema's true: anything)
            value = {} if value else {"not": {}}
        if not isinstance(value, dict):
            raise BriskError(f"json_schema: a schema is a JSON object, not {type(value).__name__}")
        try:
            return ll.LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise BriskError(f"json_schema: {_first_line(e)}") from None
    if not isinstance(value, str) or not value.strip():
        raise BriskError(f"{kind}: give a non-empty string")
    if kind == "regex":
        return ll.LLMatcher.grammar_from_regex(value)
    try:  # a Lark grammar as it is, a GBNF one converted (llguidance tells them apart)
        return ll.grammar_from("grammar", value)
    except ValueError as e:
        raise BriskError(f"grammar: {_first_line(e)}") from None


def _first_line(e) -> str:
    text = " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
    return (text or "invalid")[:300]


_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="brisk-grammar")


class Grammar:
    """A compiled constraint: a matcher in its start state, copied for each generation."""

    def __init__(self, kind: str, matcher, vocab_size: int, eos_ids, compile_s: float):
        self.kind, self.vocab_size, self.eos_ids, self.compile_s = kind, vocab_size, list(eos_ids), compile_s
        self._matcher = matcher

    def constraint(self) -> "Constraint":
        return Constraint(self._matcher.deep_copy(), self.vocab_size, self.eos_ids)


def compile_grammar(tokenizer, vocab_size: int, json_schema=None, regex=None, grammar=None,
                    timeout_s: float = COMPILE_TIMEOUT_S) -> Grammar | None:
    """The Grammar of the one constraint given (None when none is), compiled
    for this tokenizer and a model of vocab_size logits. A bad schema, regex
    or grammar, or one whose compile takes over timeout_s, is a BriskError
    that names it; grammar may also be a Grammar already compiled."""
    given = {k: v for k, v in zip(KINDS, (json_schema, regex, grammar)) if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise BriskError(f"give one constraint, not {' and '.join(given)}")
    (kind, value), = given.items()
    if isinstance(value, Grammar):
        return value
    if tokenizer is None:
        raise BriskError("structured output needs the model's tokenizer (a preset with random weights has none)")
    import time
    lt, cache = _compiler(tokenizer, vocab_size)
    key = (kind, json.dumps(value, sort_keys=True) if kind == "json_schema" and not isinstance(value, str)
           else value)
    with _LOCK:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    text = _source(kind, value)
    ll = llguidance()
    t0 = time.perf_counter()
    # (the matcher's construction lets go of the GIL; llguidance's own limits bound its work,
    # the timeout bounds the wait for it)
    job = _POOL.submit(lambda: ll.LLMatcher(lt, text, log_level=0))
    try:
        matcher = job.result(timeout_s)
    except FutureTimeout:
        raise BriskError(f"{kind}: compiling it took over {timeout_s:.0f} s (simplify it)") from None
    if matcher.is_error():
        raise BriskError(f"{kind}: {_first_line(matcher.get_error())}")
    compiled = Grammar(kind, matcher, vocab_size, tokenizer.eos_ids, time.perf_counter() - t0)
    with _LOCK:
        cache[key] = compiled
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)
    return compiled


def prepare(tokenizer, vocab_size: int):
    """Start compiling OpenAI's json_object grammar on a worker thread, and
    with it llguidance's tokenizer (the vocabulary's read, about a second
    that the first constrained request waited for), where llguidance is
    installed (imported there too: nothing of it on the caller's thread).
    A server's start calls it (LLM.warm_up without prompts)."""
    if tokenizer is not None:
        _POOL.submit(lambda: available() and compile_grammar(tokenizer, vocab_size, json_schema={"type": "object"}))


class Constraint:
    """One generation's state under a Grammar: the allowed set of the next
    token (as a bitmask in a host buffer), advanced by each token chosen."""

    def __init__(self, matcher, vocab_size: int, eos_ids=()):
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, set(eos_ids)
        self.pin = torch.cuda.is_available()  # (pinned: the copy to the GPU is asynchronous)
        self.bits = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32, pin_memory=self.pin)
        self.rows = self.bits[None]  # a verify step's masks, one row a position (draft_masks)

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and nothing more may follow it."""
        return self.matcher.is_stopped()

    def mask(self) -> torch.Tensor | None:
        """The bitmask of the tokens allowed next (bit t % 32 of word t // 32),
        or None when the grammar is done. The buffer is reused: the caller has
        consumed the previous one (copied it to the device, and that copy is done)."""
        if self.done:
            return None
        self.matcher.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        self._check()
        return self.bits

    def advance(self, token: int):
        """The token chosen (one the mask allowed)."""
        if not self.matcher.consume_token(token):
            self._check()
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")

    # --- speculation: drafts checked against the grammar, rolled back by what the verify rejects

    def allowed_drafts(self, drafts: list[int]) -> int:
        """How many of drafts, from the start, the grammar allows in turn (its state unchanged)."""
        return self.matcher.validate_tokens(drafts) if drafts else 0

    def draft_masks(self, drafts: list[int], keep_refused: bool = False) -> tuple[list[int], torch.Tensor, int]:
        """(the drafts to verify, their rows' bitmasks (drafts + 1, W): row i the
        mask after drafts[:i], how many drafts the matcher has consumed). The
        drafts end at the first the grammar refuses (kept, where keep_refused,
        as a last draft that the verify rejects for sure: a sampled draft
        model's rejection draws from its residual), at an end token (kept, not
        consumed) and where the grammar is complete. A row with no mask (after
        an unconsumed draft, or past the grammar's end) allows every token:
        nothing sampled there is emitted (settle). The buffer is reused as
        mask()'s is."""
        if self.rows.shape[0] < len(drafts) + 1:
            self.rows = torch.zeros(len(drafts) + 1, self.bits.numel(), dtype=torch.int32, pin_memory=self.pin)
        rows, size = self.rows, self.bits.numel() * 4
        for i, d in enumerate(drafts):
            if self.done:  # (complete: nothing may follow drafts[:i])
                rows[i] = -1
                return drafts[:i], rows[:i + 1], i
            self.matcher.unsafe_compute_mask_ptr(rows[i].data_ptr(), size)
            self._check()
            allowed = (int(rows[i, d // 32]) >> (d % 32)) & 1
            if d in self.eos_ids or not allowed:
                rows[i + 1] = -1
                kept = drafts[:i + 1] if allowed or keep_refused else drafts[:i]
                return kept, rows[:len(kept) + 1], i
            self.advance(d)
        n = len(drafts)
        if self.done:
            rows[n] = -1
        else:
            self.matcher.unsafe_compute_mask_ptr(rows[n].data_ptr(), size)
            self._check()
        return drafts, rows[:n + 1], n

    def settle(self, consumed: int, emitted: list[int]) -> list[int]:
        """After a verify of drafts of which draft_masks consumed `consumed`, and
        which emitted the kept drafts and one token more: the matcher rolled
        back to the kept drafts and advanced by the tokens after them, as plain
        decoding would; the emitted tokens less any past the grammar's end."""
        kept = min(consumed, len(emitted) - 1)
        if consumed > kept and not self.matcher.rollback(consumed - kept):
            self._check()
        out = emitted[:kept]
        for token in emitted[kept:]:
            if self.done:
                break
            self.advance(token)
            out.append(token)
        return out

    def _check(self):
        if self.matcher.is_error():
            raise BriskError(f"structured output: {_first_line(self.matcher.get_error())}")

    def allowed(self) -> list[int]:
        """The ids the current mask allows (for tests and debugging)."""
        bits = self.bits.tolist()
        return [t for t in range(self.vocab_size) if (bits[t // 32] >> (t % 32)) & 1]


def from_files(json_schema: str | None = None, grammar: str | None = None, regex: str | None = None,
               json_object: bool = False) -> dict:
    """The keywords of LLM.stream_ids for `brisk generate`'s flags: a schema
    file (JSON), a grammar file (Lark or GBNF), a regex, or any JSON object;
    read now, so that a missing file or llguidance fails before the model loads."""
    given = [flag for flag, value in (("--json_schema", json_schema), ("--grammar", grammar), ("--regex", regex),
                                      ("--json_object", json_object)) if value]
    if not given:
        return {}
    if len(given) > 1:
        raise BriskError(f"give one of {' and '.join(given)}")
    llguidance()
    if json_object:
        return {"json_schema": {"type": "object"}}
    if regex is not None:
        return checked({"regex": regex})
    path = json_schema or grammar
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise BriskError(f"{given[0]} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if grammar is not None:
        return checked({"grammar": text})
    try:
        return checked({"json_schema": json.loads(text)})
    except ValueError as e:
        raise BriskError(f"--json_schema {path}: not valid JSON ({e})") from None


def checked(given: dict) -> dict:
    """given ({kind: value}), once llguidance has found nothing wrong in it
    without a vocabulary (a BriskError naming what is wrong)."""
    (kind, value), = given.items()
    error = llguidance().LLMatcher.validate_grammar(_source(kind, value))
    if error and not error.startswith("WARNING"):
        raise BriskError(f"{kind}: {_first_line(error)}")
    return given


def closed(schema):
    """schema with every object that lists its properties closed to others
    (additionalProperties: false where it says nothing), as OpenAI's strict
    mode reads a schema: a small model given an open object tends to add
    keys until it runs out of tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in SUBSCHEMAS else v for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(s) for name, s in out[k].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties", "if", "then", "else")
