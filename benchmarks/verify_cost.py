"""A speculative verify step against a decode step, as speculative decoding
runs them on a GPU: the target forward over K + 1 tokens (the newest token
and K drafts, padded to the verify step's rows) from the compiled step's
CUDA graph, each call synchronized, against one step of plain decoding's
own loop (its tokens/s over --tokens new tokens).

    PYTHONPATH=. python3 benchmarks/verify_cost.py [--preset llama-3.1-8b] [--quantize int8|int4|none] [--rows 5,9]

Random weights in the preset's shape (the cost does not depend on them).
The issue's goal: K + 1 <= 8 rows at <= 1.3 decode steps for bf16, int8 and int4.
"""
from __future__ import annotations

import argparse
import time

import torch


def verify_ms(llm, rows: int, position: int, reps: int = 30) -> dict[int, float]:
    """ms of one verify step of K drafts, K = 1..rows - 1, at `position` (median of reps)."""
    steps, times = llm.generator.steps, {}
    vocab = llm.model.args.vocab_size
    for k in range(1, rows):
        ids = [(7 * i + 3) % vocab for i in range(k + 1)]
        samples = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps.logits(ids, position)
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        times[k] = sorted(samples)[reps // 2] * 1e3
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--quantize", default="none")
    p.add_argument("--groupsize", type=int, default=128)
    p.add_argument("--rows", default="5,9", help="the verify step's rows (drafts + 1), one load each")
    p.add_argument("--position", type=int, default=512)
    p.add_argument("--tokens", type=int, default=256, help="new tokens of the plain run that times a decode step")
    p.add_argument("--no_words", action="store_true", help="int4 through the widened tile (matmul.WORDS off)")
    opts = p.parse_args()
    import brisklm
    from brisklm.kernels import matmul
    if opts.no_words:
        matmul.WORDS = ()
    from brisklm.bench import _prompt, _run
    for rows in (int(r) for r in opts.rows.split(",")):
        llm = brisklm.load(preset=opts.preset, device="cuda", quantize=opts.quantize, groupsize=opts.groupsize,
                           max_seq_length=2048, speculate="ngram", draft_tokens=rows - 1)
        llm.wait_compiled()
        prompt = _prompt(opts.position, llm.model.args.vocab_size)
        drafter, llm.drafter = llm.drafter, None  # (plain decoding)
        decode = 1e3 / max(_run(llm, prompt, opts.tokens).decode_tokens_per_s for _ in range(3))
        llm.drafter = drafter
        times = verify_ms(llm, rows, opts.position)
        cells = " | ".join(f"{t:.2f} ({t / decode:.2f})" for t in times.values())
        name = f"{opts.preset} {opts.quantize}{' (tile)' if opts.no_words else ''}, {rows} rows"
        print(f"| {name} | {decode:.2f} | {cells} |", flush=True)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
