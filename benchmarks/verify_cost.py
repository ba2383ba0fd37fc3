"""What a speculative verify step costs against one decode step (the curve that
decides whether speculation pays), on a preset with random weights.

    PYTHONPATH=. python3 benchmarks/verify_cost.py [--preset llama-3.1-8b] [--quantize int4] [--start 512]

For K = 1..8 drafts: the target forward over K + 1 tokens at position
--start as speculative decoding runs it (Generator.logits: compiled, its
rows padded to --rows (a speculative run pads to draft_tokens + 1), from a
CUDA graph; --no_compile: uncompiled, padded to a bucket and replayed from a
CUDA graph), timed over --reps runs, divided by one decode step of the same
model (compiled, from a CUDA graph), timed over 128 greedy tokens. Prints a
table last.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import brisklm
from brisklm.sampling import SamplingParams
from brisklm.kernels import gemv

gemv.traced_as_constants()  # (this script compiles our modules itself, as load() does)


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps runs, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile(fn, rows: int, steps: int = 10):
    """Where a verify step's time goes: wall time per step against the sum of
    its kernels' times (the difference is host work nothing overlaps), the
    kernels by total time, and the host ops by their own time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    print(f"profile, {rows} rows: {wall:.3f} ms a step (profiled), kernels {busy:.3f} ms a step, "
          f"{len(kernels)} kernel kinds", flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70), flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--groupsize", type=int, default=128)
    ap.add_argument("--start", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default="5,9", help="padded rows of the compiled verify steps: K < rows each")
    ap.add_argument("--no_compile", action="store_true", help="the uncompiled verify step (graphed)")
    ap.add_argument("--own_graph", action="store_true",
                    help="the compiled verify step without inductor's CUDA graphs, captured and replayed by "
                         "steps.replayed instead (no guards or graph-tree checks on the host per call)")
    ap.add_argument("--profile", action="store_true",
                    help="profile 10 verify steps of K = rows - 1 drafts: wall time against the GPU's busy time "
                         "per step, the top kernels and the top host ops")
    ap.add_argument("--sweep", default=None, help="first run few_rows.py's sweep for these formats (bf16,int8,"
                    "int4-g128) and keep its best blocks")
    opts = ap.parse_args()
    if opts.sweep:
        import few_rows
        few_rows.sweep(fmts=opts.sweep.split(","))
    llm = brisklm.load(preset=opts.preset, device="cuda", quantize=opts.quantize, groupsize=opts.groupsize,
                       quiet=False)  # (the cache brisk generate makes: its compiled step is shared)
    gen = llm.generator
    if opts.no_compile:
        gen.steps.rows = None
    if opts.own_graph:
        from brisklm.steps import OnePassReductions, replayed, rows_logits
        options = {"triton.cudagraphs": False, "triton.enable_pdl": True, "inductor_choices_class": OnePassReductions}
        gen.steps.rows = replayed(torch.compile(rows_logits, fullgraph=True, dynamic=False, options=options))
    prompt = torch.randint(0, llm.model.args.vocab_size, (opts.start,), generator=torch.Generator().manual_seed(0))
    ids = prompt.tolist()
    rates = []
    for _ in range(3):
        gen.reset()
        list(gen.tokens(ids, 128, SamplingParams()))
        rates.append(gen.stats.decode_tokens_per_s)
    step_ms = 1e3 / statistics.median(rates)
    rows = []
    for padded in [int(r) for r in opts.rows.split(",")]:
        gen.steps.verify_rows = padded
        t0 = time.perf_counter()
        gen.logits(ids[:2], opts.start)  # (the first call compiles)
        print(f"verify step of {padded} rows ready in {time.perf_counter() - t0:.1f} s", flush=True)
        for k in range(1, padded):
            tokens = ids[:k + 1]
            ms = timed(lambda: gen.logits(tokens, opts.start), opts.reps)
            rows.append((padded, k, ms, ms / step_ms))
            print(f"K={k} ({padded} rows): {ms:.2f} ms, {ms / step_ms:.2f} decode steps", flush=True)
        if opts.profile:
            profile(lambda: gen.logits(ids[:padded], opts.start), padded)
    mode = opts.quantize or "bf16"
    how = "uncompiled, graphed" if opts.no_compile else "compiled, one replayed graph" if opts.own_graph else "compiled"
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {opts.preset} {mode}, "
          f"position {opts.start}; decode step {step_ms:.2f} ms (compiled, graphed); verify {how}")
    print("| rows | drafts K | verify over K+1 tokens, ms | / decode step |\n| --- | --- | --- | --- |")
    for padded, k, ms, ratio in rows:
        print(f"| {padded if not opts.no_compile else 'bucket'} | {k} | {ms:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
