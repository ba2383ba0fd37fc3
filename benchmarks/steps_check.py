"""The ways a step runs give the same greedy tokens (fp32, random weights in
a preset's shape): block-compiled in a CUDA graph (the default), the
uncompiled step in a CUDA graph, and op by op (BRISKLM_CUDA_GRAPHS=0), for
prompt lengths inside and past the prefill buckets and a conversation's
second turn (a prefill after cached tokens); and a request that switches to
the compiled decode step between two of its steps (the first request pauses
until the compile beside it is done).

    PYTHONPATH=. python3 benchmarks/steps_check.py [--preset smollm2-135m] [--tokens 48]
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=48)
    opts = p.parse_args()
    import brisklm
    from brisklm.bench import _prompt
    from brisklm.repl import while_waiting
    ways = {"block-compiled, graphed": dict(compile=True), "uncompiled, graphed": dict(compile=False),
            "block-compiled, prefill graphs captured between turns (brisk chat)": dict(compile=True, chat=True),
            "block-compiled, switched to within the first request": dict(compile=True, midway=True),
            "op by op": dict(compile=False, graphs="0")}
    outputs = {}
    for way, kw in ways.items():
        os.environ["BRISKLM_CUDA_GRAPHS"] = kw.pop("graphs", "1")
        chat, midway = kw.pop("chat", False), kw.pop("midway", False)
        llm = brisklm.load(preset=opts.preset, device="cuda", dtype="float32", max_seq_length=2048,
                           allow_long_context=True, warm_up=not chat, **kw)  # (a tiny preset's context is shorter)
        if chat:
            llm.warm_up(prompts=[])
        if not midway:
            llm.wait_compiled()  # (checked: the compiled step, not the one that serves meanwhile)
        between = (lambda llm=llm: while_waiting(llm, lambda: time.sleep(0.2))) if chat else (lambda: None)
        vocab, out = llm.model.args.vocab_size, []
        for n in (1, 5, 16, 17, 100, 300):
            ids = _prompt(n, vocab, seed=n)
            llm.generator.reset()
            run, steps = llm.stream_ids(ids, opts.tokens, stop_ids=()), llm.generator.steps
            first = [next(run) for _ in range(3)]
            if midway is True and steps.compiling and not steps.adopted:
                steps.compiler.join()  # (the request pauses between two of its steps until the compile is done)
                first += list(run)
                midway = "switched" if steps.adopted else "not switched"
            first += list(run)
            between()
            second = list(llm.stream_ids(ids + first + _prompt(7, vocab, seed=99), opts.tokens, stop_ids=()))
            out.append((first, second, llm.stats.reused_tokens))
        outputs[way] = out
        if way.endswith("within the first request") and midway != "switched":
            print(f"{way}: the first request did not switch ({midway})")
            outputs[way] = []
        del llm
    want = outputs["op by op"]
    ok = True
    print("| way | same greedy tokens as op by op |")
    print("| --- | --- |")
    for way, out in outputs.items():
        same = sum(a == b for a, b in zip(out, want))
        ok &= same == len(want)
        print(f"| {way} | {same}/{len(want)} |")
    print("all the same" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
