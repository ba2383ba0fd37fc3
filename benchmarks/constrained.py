"""Structured output's cost: decode tokens/s with and without a JSON schema,
the schemas' compile times, the host's mask time a token, and decoding
under each schema with prompt lookup's speculation (its output the same).

    PYTHONPATH=. python3 benchmarks/constrained.py [--checkpoint_path P] [--device cuda] [--dtype bfloat16]

The same prompt decodes greedily N tokens unconstrained (end tokens ignored),
then under each schema (until the schema is complete or N tokens). The mask
time is the host's llguidance call alone, timed again over the tokens each
constrained run made; in the constrained loop it overlaps the device's
forward (on a GPU), so a decode step costs max(forward, mask) + the masked
sampling, not their sum. With speculation (--draft_tokens, 0: none) each
verify checks up to that many prompt-lookup drafts the grammar allows, as
many as pay (the draft policy); JSON repeats its keys, so drafts are kept.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import brisklm
from brisklm import constrain

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"},
                                                                 "maxItems": 5}},
        "required": ["name", "age", "tags"], "additionalProperties": False},
    "tool_call": {"type": "object", "properties": {
        "name": {"enum": ["get_weather", "search", "send_email"]},
        "arguments": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                      "required": ["query"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "records": {"type": "array", "items": {"$ref": "#/$defs/record"}, "minItems": 3, "maxItems": 8,
                "$defs": {"record": {"type": "object", "properties": {
                    "id": {"type": "integer"}, "title": {"type": "string", "maxLength": 60},
                    "status": {"enum": ["open", "closed", "pending"]}, "score": {"type": "number"}},
                    "required": ["id", "title", "status"], "additionalProperties": False}}},
    "any_object": {"type": "object"},
}
PROMPT = [{"role": "user", "content": "List a few open issues of a software project as JSON records, "
                                      "with ids, titles, a status and a score each."}]


def median_rate(llm, ids, n, runs, **constraint) -> tuple[float, int, list[int]]:
    rates, made = [], []
    for _ in range(runs):
        llm.generator.reset()
        made = list(llm.stream_ids(ids, n, stop_ids=() if not constraint else None, **constraint))
        rates.append(llm.stats.decode_tokens_per_s)
    return statistics.median(rates), len(made), made


def speculative_rate(llm, ids, n, runs, grammar, draft_tokens) -> tuple[float, float, list[int]]:
    """(median decode tokens/s, tokens a verify forward, the tokens) under
    grammar with prompt lookup (Generator.tokens with an NgramDrafter)."""
    from brisklm.sampling import SamplingParams
    from brisklm.speculative import NgramDrafter
    gen, rates, made = llm.generator, [], []
    gen.steps.warm_speculative(draft_tokens + 1, ids)  # (compiled steps: the verify shape, before timing)
    for _ in range(runs):
        gen.reset()
        made = list(gen.tokens(ids, n, SamplingParams(), stop_ids=llm.tokenizer.eos_ids, drafter=NgramDrafter(),
                               draft_tokens=draft_tokens, constraint=grammar.constraint()))
        rates.append(gen.stats.decode_tokens_per_s)
    return statistics.median(rates), gen.stats.tokens_per_step, made


def mask_times_us(llm, grammar, tokens: list[int]) -> list[float]:
    """The host's mask call for each token of a run, replayed on a fresh constraint."""
    c = grammar.constraint()
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        if c.mask() is None:
            break
        times.append((time.perf_counter() - t0) * 1e6)
        if t in llm.tokenizer.eos_ids:
            break
        c.advance(t)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--preset", default=None, help="random weights in a named shape (presets.py), with --tokenizer")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json for --preset (e.g. SmolLM2's, saved by brisk)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="the figure is their median")
    p.add_argument("--draft_tokens", type=int, default=4, help="prompt lookup's drafts a verify at most (0: none)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args()
    llm = brisklm.load(args.checkpoint_path, device=args.device, dtype=args.dtype, quiet=True, preset=args.preset)
    llm.wait_compiled()  # (timed: the compiled step, not the one that serves meanwhile)
    if args.preset:  # (random weights: timing only; the schemas' outputs are whatever the grammar lets through)
        from brisklm.tokenizer import load_hf_tokenizer
        import os
        llm.tokenizer = load_hf_tokenizer(os.path.dirname(os.path.abspath(args.tokenizer)))
    ids = llm.chat_ids(PROMPT)
    vocab = llm.model.args.vocab_size
    t0 = time.perf_counter()
    constrain.compile_grammar(llm.tokenizer, vocab, json_schema={"type": "integer"})  # (reads the vocabulary once)
    vocabulary_s = time.perf_counter() - t0
    plain, n_plain, _ = median_rate(llm, ids, args.max_new_tokens, args.runs)
    out = {"device": str(llm.generator.device), "dtype": str(llm.model.dtype).replace("torch.", ""),
           "model": llm.name, "vocabulary_read_s": round(vocabulary_s, 3),
           "unconstrained_tokens_per_s": round(plain, 2), "unconstrained_tokens": n_plain, "schemas": {}}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = constrain.compile_grammar(llm.tokenizer, vocab, json_schema=schema)
        compile_ms = (time.perf_counter() - t0) * 1e3
        rate, n, made = median_rate(llm, ids, args.max_new_tokens, args.runs, grammar=grammar)
        masks = sorted(mask_times_us(llm, grammar, made))
        if args.draft_tokens:
            spec, per_step, spec_made = speculative_rate(llm, ids, args.max_new_tokens, args.runs, grammar,
                                                         args.draft_tokens)
            out["schemas"][name] = {"speculative_tokens_per_s": round(spec, 2), "tokens_per_step": round(per_step, 2),
                                    "speculative_same_tokens": spec_made == made}
        out["schemas"].setdefault(name, {}).update({
            "compile_ms": round(compile_ms, 2), "tokens": n, "tokens_per_s": round(rate, 2),
            "vs_unconstrained": round(rate / plain, 3) if plain else None,
            "mask_us_median": round(statistics.median(masks), 1) if masks else None,
            "mask_us_p99": round(masks[min(len(masks) - 1, int(0.99 * len(masks)))], 1) if masks else None})
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['model']} on {out['device']} ({out['dtype']}): unconstrained {plain:.1f} tokens/s "
          f"({n_plain} tokens); vocabulary read by llguidance in {vocabulary_s:.2f} s")
    print(f"{'schema':<12} {'compile ms':>10} {'tokens':>7} {'tokens/s':>9} {'vs plain':>9} {'mask us p50':>12} "
          f"{'p99':>7}" + (f" {'spec tok/s':>10} {'tok/step':>9} {'same':>5}" if args.draft_tokens else ""))
    for name, r in out["schemas"].items():
        spec = (f" {r['speculative_tokens_per_s']:>10.1f} {r['tokens_per_step']:>9.2f} "
                f"{str(r['speculative_same_tokens']):>5}") if args.draft_tokens else ""
        print(f"{name:<12} {r['compile_ms']:>10.2f} {r['tokens']:>7} {r['tokens_per_s']:>9.1f} "
              f"{r['vs_unconstrained']:>9.3f} {r['mask_us_median']:>12.1f} {r['mask_us_p99']:>7.1f}" + spec)


if __name__ == "__main__":
    main()
