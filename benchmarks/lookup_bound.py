"""The most prompt lookup could draft on speculate.py's prompts: for each
greedy reply, an oracle that at every step picks, among the places where the
last 3 (else 2, else 1) tokens occur earlier in the prompt and reply, the one
whose continuation agrees longest with what the model really says next (up
to --drafts tokens), and keeps that many. Its tokens a target step bound what
any n-gram drafter over the same text can keep; a real drafter must choose
before it knows the reply.

    PYTHONPATH=. python3 benchmarks/lookup_bound.py [--checkpoint_path GGUF] [--tokens 256] [--drafts 8]
"""
from __future__ import annotations

import argparse
import os
import sys


def best_run(history: list[int], reply: list[int], drafts: int) -> int:
    """The longest agreement with reply's start that a lookup of history's last 3, 2 or 1 tokens finds."""
    for n in (3, 2, 1):
        if len(history) <= n:
            continue
        key, best = history[-n:], 0
        for p in range(len(history) - n):
            if history[p:p + n] == key:
                k = 0
                while k < drafts and p + n + k < len(history) and k < len(reply) and history[p + n + k] == reply[k]:
                    k += 1
                best = max(best, k)
        if best:
            return best
    return 0


def tokens_a_step(prompt: list[int], reply: list[int], drafts: int) -> float:
    history, i, steps = list(prompt), 0, 0
    while i < len(reply):
        take = best_run(history, reply[i:], drafts) + 1  # (the kept drafts, and the target's own token)
        history += reply[i:i + take]
        i, steps = i + take, steps + 1
    return len(reply) / max(steps, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_path", default=None)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--drafts", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    opts = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import brisklm
    from speculate import PROMPTS
    llm = brisklm.load(opts.checkpoint_path, dtype=opts.dtype, quiet=True)
    print("| kind | prompt | reply tokens | oracle tokens a step |\n| --- | --- | --- | --- |")
    for kind, name, message in PROMPTS:
        ids = llm.chat_ids([{"role": "user", "content": message}])
        reply = list(llm.stream_ids(ids, opts.tokens, temperature=0))
        print(f"| {kind} | {name} | {len(reply)} | {tokens_a_step(ids, reply, opts.drafts):.2f} |", flush=True)


if __name__ == "__main__":
    main()
