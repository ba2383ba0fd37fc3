"""xgrammar against llguidance on the CPU: per JSON schema, the cold compile
time and the host's mask time a token, for the same schemas, tokenizer and
token sequences.

    PYTHONPATH=. python3 benchmarks/grammar_engines.py [--tokenizer DIR/tokenizer.json] [--runs 5]
        [--whitespace compact|flexible] [--json FILE]

(without --tokenizer: the bundled SmolLM2-135M-Instruct's, through brisklm.load, slower.)

Each schema (constrained.py's SCHEMAS and a few more of the kinds agents
send) has one valid instance written here, encoded once (no BOS); both
engines replay those same ids: at each position the full next-token bitmask
(llguidance: LLMatcher.unsafe_compute_mask_ptr into an int32 buffer, as
brisklm.constrain.Constraint.mask does; xgrammar:
GrammarMatcher.fill_next_token_bitmask into allocate_token_bitmask's), only
that call timed, then the token consumed. Reported: the median of --runs
cold compiles (xgrammar's compiler cache off and cleared; llguidance keeps
none, but builds its lexer lazily, so part of its compile lands on the first
replay's masks: the 1st run columns), the masks' p50 / p99 / max over all
replays (a fresh matcher each), the slowest position's median over them
(what is left of max without preemption: on a small, busy machine a call
preempted by another process reads as 4 or 8 ms), whether each engine
accepted every token and allows an end token after the last (the exit
status is 1 where one did not), and the fraction of positions where the two
full masks are identical, with the differing ones sorted by kind (forced
text, special tokens, other: examples printed).
The vocabulary preprocessing (llguidance's LLTokenizer, xgrammar's
TokenizerInfo and GrammarCompiler) is timed once apart.

Whitespace: compact (default, as brisklm compiles schemas): llguidance
whitespace_flexible false, xgrammar any_whitespace=False with separators
(",", ":"), instances dumped compact; flexible: both allow any whitespace,
instances dumped with ", " and ": ". xgrammar runs with strict_mode=False,
so that an object without additionalProperties is open in both (JSON
Schema's reading, llguidance's).

Without xgrammar installed it says so in one line and measures llguidance alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from importlib.metadata import version
from importlib.util import find_spec

import torch

from constrained import SCHEMAS

MORE_SCHEMAS = {
    "order": {"type": "object", "properties": {  # nested objects
        "order_id": {"type": "string"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"},
            "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False},
        "lines": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "paid": {"type": "boolean"}},
        "required": ["order_id", "customer", "lines", "paid"], "additionalProperties": False},
    "settings": {"type": "object", "properties": {  # enums, const, booleans
        "version": {"const": 2},
        "log_level": {"enum": ["debug", "info", "warning", "error"]},
        "theme": {"enum": ["light", "dark", "system"]},
        "retries": {"enum": [0, 1, 3, 5]},
        "features": {"type": "object", "properties": {
            "beta": {"type": "boolean"}, "telemetry": {"type": "boolean"}},
            "required": ["beta", "telemetry"], "additionalProperties": False},
        "region": {"enum": ["us-east-1", "eu-west-1", "ap-south-1", None]}},
        "required": ["version", "log_level", "theme", "retries", "features", "region"],
        "additionalProperties": False},
    "bounded_arrays": {"type": "object", "properties": {  # minItems / maxItems
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 6},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 3, "maxItems": 10},
        "point": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}},
        "required": ["keywords", "scores", "point"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {  # most fields optional, some present
        "id": {"type": "integer"}, "nickname": {"type": "string"}, "bio": {"type": "string"},
        "website": {"type": "string"}, "age": {"type": "integer"}, "verified": {"type": "boolean"},
        "followers": {"type": "integer"}, "location": {"type": "string"}, "language": {"type": "string"}},
        "required": ["id"], "additionalProperties": False},
    "tree": {"$ref": "#/$defs/node", "$defs": {  # $ref / $defs, recursive
        "node": {"type": "object", "properties": {
            "name": {"type": "string"}, "size": {"$ref": "#/$defs/size"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["name", "children"], "additionalProperties": False},
        "size": {"type": "integer", "minimum": 0}}},
    "event": {"type": "object", "properties": {  # string formats
        "id": {"type": "string", "format": "uuid"}, "title": {"type": "string"},
        "start": {"type": "string", "format": "date-time"}, "end": {"type": "string", "format": "date-time"},
        "day": {"type": "string", "format": "date"}, "organizer": {"type": "string", "format": "email"}},
        "required": ["id", "title", "start", "end", "day", "organizer"], "additionalProperties": False},
    "action": {"anyOf": [  # anyOf: a tool's alternative argument shapes, and a nullable field
        {"type": "object", "properties": {"type": {"const": "click"}, "x": {"type": "integer"},
                                          "y": {"type": "integer"}},
         "required": ["type", "x", "y"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "type_text"}, "text": {"type": "string"},
                                          "submit": {"type": "boolean"},
                                          "target": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
         "required": ["type", "text", "submit", "target"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "scroll"}, "dy": {"type": "number"}},
         "required": ["type", "dy"], "additionalProperties": False}]},
}

# one valid instance a schema (in each schema's property order: both engines keep that order)
INSTANCES = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.org",
               "tags": ["mathematician", "writer", "programmer"]},
    "tool_call": {"name": "search", "arguments": {
        "query": "cheap direct flights from Lisbon to Tokyo in late May, economy, one checked bag", "limit": 5}},
    "records": [{"id": 101, "title": "Crash on startup with empty config", "status": "open", "score": 8.5},
                {"id": 102, "title": "Slow search on large repos", "status": "pending", "score": 6.25},
                {"id": 103, "title": "Typo in README", "status": "closed", "score": 1}],
    "any_object": {"query": "weather", "units": "metric", "days": 3, "hourly": False,
                   "location": {"lat": 48.8566, "lon": 2.3522}, "fields": ["temp", "wind", None]},
    "order": {"order_id": "A-20931", "customer": {"name": "Jonas Berg", "address": {
        "street": "12 Harbour Lane", "city": "Gothenburg", "zip": "41104"}},
        "lines": [{"sku": "KB-101", "qty": 2, "price": 49.9}, {"sku": "MS-7", "qty": 1, "price": 19.5}],
        "paid": True},
    "settings": {"version": 2, "log_level": "warning", "theme": "dark", "retries": 3,
                 "features": {"beta": True, "telemetry": False}, "region": "eu-west-1"},
    "bounded_arrays": {"keywords": ["inference", "latency", "json"], "scores": [88, 92, 75, 100, 61],
                       "point": [12.5, -3.25]},
    "optional_fields": {"id": 4821, "bio": "Building small models that run anywhere.", "age": 34,
                        "verified": True, "location": "Porto, Portugal", "language": "en"},
    "tree": {"name": "src", "children": [
        {"name": "main.py", "size": 2048, "children": []},
        {"name": "lib", "children": [{"name": "util.py", "size": 512, "children": []}]}]},
    "event": {"id": "3f2b8c1e-9a4d-4e7b-b6a2-0c5d1e9f7a31", "title": "Design review",
              "start": "2025-03-14T09:30:00Z", "end": "2025-03-14T10:15:00+01:00", "day": "2025-03-14",
              "organizer": "maria.k@example.com"},
    "action": {"type": "type_text", "text": "Thanks for the report! Could you share the exact steps to reproduce it?",
               "submit": True, "target": None},
}


def load_tokenizer(path):
    """brisklm's Tokenizer of a tokenizer.json (its folder), or the bundled model's."""
    if path:
        from brisklm.tokenizer import load_hf_tokenizer
        return load_hf_tokenizer(os.path.dirname(os.path.abspath(path)))
    import brisklm
    return brisklm.load(None, device="cpu", quiet=True).tokenizer


def percentile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bitmask's bools, one a token (bit t % 32 of word t // 32, both engines' layout)."""
    bits = (words.reshape(-1, 1).to(torch.int64) >> torch.arange(32)) & 1
    return bits.reshape(-1)[:vocab].bool()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab, eos, flexible):
        import llguidance as ll
        self.ll, self.vocab, self.flexible = ll, vocab, flexible
        # (as brisklm.constrain._compiler does for a Hugging Face tokenizer: llguidance reads its JSON)
        self.lt = ll.LLTokenizer(tokenizer.backend.tok.to_str(), n_vocab=vocab, eos_token=eos)
        self.bits = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def compile(self, schema):
        text = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": self.flexible})
        m = self.ll.LLMatcher(self.lt, text, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()  # (brisklm's Grammar.constraint)

    def mask(self, m):
        m.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        return self.bits

    def advance(self, m, token):
        return m.consume_token(token)

    def complete(self, m):
        return m.is_accepting()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab, eos, flexible):
        import xgrammar as xg
        self.xg, self.vocab, self.flexible = xg, vocab, flexible
        try:
            from transformers import PreTrainedTokenizerFast
            hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend.tok)
            info = xg.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        except ImportError:  # (SmolLM2's is a byte-level BPE: its vocabulary as the tokenizer spells it)
            tok = tokenizer.backend.tok
            words = [tok.id_to_token(i) or "" for i in range(vocab)]
            info = xg.TokenizerInfo(words, xg.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xg.GrammarCompiler(info, cache_enabled=False)
        self.bits = xg.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        self.compiler.clear_cache()  # (a cold compile each time)
        ws = {"any_whitespace": True} if self.flexible else {"any_whitespace": False, "separators": (",", ":")}
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=False, **ws)

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def mask(self, m):
        m.fill_next_token_bitmask(self.bits)
        return self.bits

    def advance(self, m, token):
        return m.accept_token(token)

    def complete(self, m):
        return m.is_completed()


def timed_compile(engine, schema, runs):
    times, compiled = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        compiled = engine.compile(schema)
        times.append((time.perf_counter() - t0) * 1e3)
    return compiled, times


def replay(engine, compiled, ids, eos, keep_masks=False):
    """(mask µs a position, the tokens accepted, complete at the end, EOS allowed
    at the end, the masks as bools where keep_masks)."""
    m, times, masks = engine.matcher(compiled), [], []
    for i, t in enumerate(ids):
        t0 = time.perf_counter()
        words = engine.mask(m)
        times.append((time.perf_counter() - t0) * 1e6)
        allowed = (int(words.reshape(-1)[t // 32]) >> (t % 32)) & 1
        if keep_masks:
            masks.append(unpack(words, engine.vocab))
        if not allowed or not engine.advance(m, t):
            return times, i, False, False, masks
    eos_ok = any(unpack(engine.mask(m), engine.vocab)[e] for e in eos)
    return times, len(ids), engine.complete(m), bool(eos_ok), masks


def measure(engine, schema, ids, eos, runs):
    compiled, compile_ms = timed_compile(engine, schema, runs)
    first, accepted, complete, eos_ok, masks = replay(engine, compiled, ids, eos, keep_masks=True)
    replays = [first] + [replay(engine, compiled, ids, eos)[0] for _ in range(runs - 1)]
    times = [t for r in replays for t in r]
    worst = max((t, run, pos) for run, r in enumerate(replays) for pos, t in enumerate(r))
    # (a position's median over the replays: a slow position, not a preempted call, nor the cold first run)
    steady = max(statistics.median(r[i] for r in replays) for i in range(min(map(len, replays))))
    return {"compile_ms": statistics.median(compile_ms), "compile_ms_runs": compile_ms,
            # (llguidance's lexer is built lazily: its first replay also pays part of the compile)
            "first_replay_ms": sum(first) / 1e3, "first_replay_us_p50": statistics.median(first),
            "mask_us_p50": statistics.median(times), "mask_us_p99": percentile(times, 0.99), "mask_us_max": worst[0],
            "max_at": worst[1:], "max_position_median_us": steady, "tokens": len(ids), "accepted": accepted,
            "complete": complete, "eos_allowed_at_end": eos_ok}, masks


def compare(a, b, tokenizer, ids, special):
    """(fraction of positions with identical masks, the differing positions by kind, the first of the
    other kind with a few of their ordinary tokens). Kinds, special tokens left out: forced (llguidance
    allows one token, the canonical tokenization's next of text the grammar forces; xgrammar also any
    shorter prefix of it), other; and apart, special (where one engine allows special tokens the other
    does not)."""
    n, ordinary = min(len(a), len(b)), torch.ones(len(a[0]), dtype=torch.bool)
    ordinary[special] = False
    kinds, others = {"forced": 0, "other": 0, "special": 0}, []
    for i in range(n):
        if torch.equal(a[i], b[i]):
            continue
        only_a, only_b = a[i] & ~b[i], b[i] & ~a[i]
        kinds["special"] += bool(((only_a | only_b) & ~ordinary).any())
        if not ((only_a | only_b) & ordinary).any():
            continue
        if int(a[i].sum()) == 1 and not only_a.any():
            kinds["forced"] += 1
            continue
        kinds["other"] += 1
        words = [[tokenizer.decode([t]) for t in torch.nonzero(m & ordinary).flatten().tolist()[:6]]
                 for m in (only_a, only_b)]
        others.append({"position": i, "after": tokenizer.decode(ids[:i])[-24:],
                       "only_llguidance": int((only_a & ordinary).sum()),
                       "only_xgrammar": int((only_b & ordinary).sum()),
                       "examples_llguidance": words[0], "examples_xgrammar": words[1]})
    differ = sum(not torch.equal(a[i], b[i]) for i in range(n))
    return (n - differ) / n, kinds, others


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: the bundled model's, slower)")
    p.add_argument("--runs", type=int, default=5, help="cold compiles (their median) and mask replays a schema")
    p.add_argument("--whitespace", choices=("compact", "flexible"), default="compact")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures there")
    args = p.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    vocab, eos = tokenizer.backend.vocab_size, list(tokenizer.eos_ids)
    special = [i for i, t in tokenizer.backend.tok.get_added_tokens_decoder().items() if t.special and i < vocab]
    flexible = args.whitespace == "flexible"
    separators = (", ", ": ") if flexible else (",", ":")
    schemas = {**SCHEMAS, **MORE_SCHEMAS}
    ids = {name: tokenizer.backend.encode_text(json.dumps(INSTANCES[name], separators=separators))
           for name in schemas}
    kinds = [LLGuidance, XGrammar] if find_spec("xgrammar") else [LLGuidance]
    if len(kinds) == 1:
        print("xgrammar is not installed (pip install xgrammar): measuring llguidance alone")
    out = {"torch": torch.__version__, "llguidance": version("llguidance"), "whitespace": args.whitespace,
           "cpus": os.cpu_count(), "vocab": vocab, "xgrammar": version("xgrammar") if len(kinds) > 1 else None,
           "preprocess_s": {}, "schemas": {}}
    engines = []
    for kind in kinds:
        t0 = time.perf_counter()
        engines.append(kind(tokenizer, vocab, eos, flexible))
        out["preprocess_s"][kind.name] = round(time.perf_counter() - t0, 3)
        engines[-1].compile({"type": "integer"})  # (a first compile's one-time costs, outside the figures)
    for name, schema in schemas.items():
        row, masks = {}, {}
        for e in engines:
            try:
                row[e.name], masks[e.name] = measure(e, schema, ids[name], eos, args.runs)
            except Exception as err:  # (a schema an engine refuses: reported, the others still run)
                row[e.name] = {"error": " ".join(str(err).split())[:200], "tokens": len(ids[name])}
        if len(masks) == 2:
            row["masks_identical"], row["mask_diff_kinds"], row["mask_diffs_other"] = compare(
                masks["llguidance"], masks["xgrammar"], tokenizer, ids[name], special)
        out["schemas"][name] = row
    report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    failed = [f"{name} ({engine})" for name, row in out["schemas"].items() for engine, r in row.items()
              if engine in ("llguidance", "xgrammar") and not (r.get("complete") and r.get("eos_allowed_at_end"))]
    if failed:
        raise SystemExit(f"not accepted whole: {', '.join(failed)}")


def report(out):
    print(f"torch {out['torch']}, llguidance {out['llguidance']}, xgrammar {out['xgrammar']}; "
          f"{out['cpus']} CPUs; whitespace {out['whitespace']}; vocabulary {out['vocab']}; preprocessing "
          + ", ".join(f"{k} {v:.2f} s" for k, v in out["preprocess_s"].items()))
    print(f"{'schema':<16} {'engine':<11} {'compile ms':>10} {'1st run ms':>10} {'1st p50':>7} {'mask us p50':>11} "
          f"{'p99':>7} {'max':>7} {'@run:pos':>8} {'max pos':>7} {'tokens':>8} {'end':>3} {'same mask':>9}")
    for name, row in out["schemas"].items():
        same = "" if row.get("masks_identical") is None else f"{row['masks_identical']:.2f}"
        for engine in ("llguidance", "xgrammar"):
            r = row.get(engine)
            if r is None:
                continue
            if "error" in r:
                print(f"{name:<16} {engine:<11} error: {r['error']}")
                continue
            at = "{}:{}".format(*r["max_at"])
            ok = "ok" if r["complete"] and r["eos_allowed_at_end"] else "NO"
            print(f"{name:<16} {engine:<11} {r['compile_ms']:>10.2f} {r['first_replay_ms']:>10.2f} "
                  f"{r['first_replay_us_p50']:>7.1f} {r['mask_us_p50']:>11.1f} {r['mask_us_p99']:>7.1f} "
                  f"{r['mask_us_max']:>7.1f} {at:>8} "
                  f"{r['max_position_median_us']:>7.1f} {r['accepted']:>3}/{r['tokens']:<4} {ok:>3} {same:>9}")
    print("1st run: the first replay's masks, together (ms) and their median (us); mask p50, p99, max: all replays;\n"
          "max pos: the slowest position's median over the replays; tokens: accepted/replayed;\n"
          "end: complete, an end token allowed; same mask: positions whose two full masks are identical")
    for name, row in out["schemas"].items():
        if "mask_diff_kinds" in row:
            k = row["mask_diff_kinds"]
            print(f"  {name}: ordinary tokens differ at {k['forced']} forced, {k['other']} other positions; "
                  f"special tokens at {k['special']}")
            seen = set()
            for d in row["mask_diffs_other"]:
                key = (str(d["examples_llguidance"]), str(d["examples_xgrammar"]))
                if key not in seen and len(seen) < 3:
                    seen.add(key)
                    print(f"    @{d['position']} after {d['after']!r}: only llguidance {d['only_llguidance']} "
                          f"{d['examples_llguidance']}, only xgrammar {d['only_xgrammar']} {d['examples_xgrammar']}")


if __name__ == "__main__":
    main()
