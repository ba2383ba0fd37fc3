"""Where a decode step's time goes on the GPU (Llama-3.1-8B preset, batch 1).

    PYTHONPATH=. python3 benchmarks/profile_decode.py [--quantize none int8 int4] [--skip_gemv] [--no_pdl]
        [--compile_options '{"triton.multi_kernel": 2}']

1. Per-GEMV bandwidth: F.linear of one token against each weight shape of the
   model, replayed in a CUDA graph over rotating weight copies (so L2 never
   holds the weight), timed with CUDA events: bytes of the weight / time.
2. The compiled decode step (one CUDA graph) under torch.profiler, once per
   --quantize mode: the kernels of one step in order with their times and the
   idle gaps between them, then the time per kernel family.
"""
from __future__ import annotations

import json
import os
import re

import torch
import torch.nn.functional as F

from brisklm.presets import preset
from brisklm.sampling import SamplingParams
from gemv_sweep import time_us  # a CUDA graph of the calls, best of 3


def gemv_bandwidth(out_features, in_features, copies_bytes=1.2e9, reps=20):
    w_bytes = out_features * in_features * 2
    n = max(2, int(copies_bytes // w_bytes))
    ws = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(n)]
    x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
    seconds = time_us([lambda w=w: F.linear(x, w) for w in ws], reps) / 1e6
    del ws
    return w_bytes / seconds / 1e9, seconds * 1e6


def step_trace(quantize, kv_int8=False, steps=20, pdl=True, compile_options=None):
    """The compiled decode step (CUDA graphs on) under torch.profiler: each
    kernel of one step in launch order, with its time and the idle gap before it.
    With early launch (pdl) a kernel's time includes its wait for the one before."""
    from brisklm.api import load
    llm = load(preset="llama-3.1-8b", device="cuda", compile=True, max_seq_length=1024,
               quantize=quantize, kv_int8=kv_int8,
               compile_options={**(compile_options or {}), **({} if pdl else {"triton.enable_pdl": False})})
    llm.wait_compiled()  # (timed: the compiled step, not the one that serves meanwhile)
    gen = llm.generator
    list(gen.tokens([1, 2, 3, 4, 5], 50, SamplingParams()))  # compile and warm up
    list(gen.tokens([1, 2, 3, 4, 5], 100, SamplingParams()))
    rate = gen.stats.decode_tokens_per_s
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        list(gen.tokens([1, 2, 3, 4, 5], steps + 1, SamplingParams()))
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    return rate, kernels


def print_trace(rate, kernels, layers_shown=2):
    print(f"\ndecode tokens/s (CUDA graphs): {rate:.1f}; step {1e6 / rate:.0f} us")
    # One step is the run of kernels between two argmax-free markers; take the
    # longest repeating window instead: the middle step, found by the output GEMV.
    big = [i for i, e in enumerate(kernels) if e.time_range.end - e.time_range.start > 100]
    if len(big) < 3:
        print("no step boundaries found (kernels not traced inside the graph?)")
        return
    lo, hi = big[-3] + 1, big[-2] + 1  # after one output GEMV, through the next
    step = kernels[lo:hi]
    busy = sum(e.time_range.end - e.time_range.start for e in step)
    wall = step[-1].time_range.end - step[0].time_range.start
    print(f"one step: {len(step)} kernels, {busy:.0f} us busy, {wall:.0f} us wall, "
          f"{wall - busy:.0f} us idle")
    per_layer = (len(step) - 4) // 32 if len(step) > 40 else len(step)
    print("\n| # | kernel | us | gap before us |\n| --- | --- | --- | --- |")
    for i, e in enumerate(step[:4 + per_layer * layers_shown]):
        gap = e.time_range.start - step[i - 1].time_range.end if i else 0.0
        print(f"| {i} | {e.name[:80]} | {e.time_range.end - e.time_range.start:.1f} | {gap:.1f} |")
    totals = {}
    for e in step:
        key = re.sub(r"_\d+$", "", e.name[:60])
        totals[key] = totals.get(key, 0.0) + e.time_range.end - e.time_range.start
    print("\n| kernel family | us per step | share of busy |\n| --- | --- | --- |")
    for key, us in sorted(totals.items(), key=lambda kv: -kv[1])[:15]:
        print(f"| {key} | {us:.0f} | {us / busy:.2f} |")


def main():
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantize", nargs="*", default=["none"])
    parser.add_argument("--kv_int8", action="store_true")
    parser.add_argument("--skip_gemv", action="store_true")
    parser.add_argument("--compile_options", type=json.loads, default=None,
                        help="inductor options for the decode step, as JSON (e.g. to try other reductions)")
    parser.add_argument("--no_pdl", action="store_true",
                        help="no early launch (ours or inductor's): each kernel's own time, no overlap")
    opts = parser.parse_args()
    if opts.no_pdl:
        os.environ["BRISKLM_PDL"] = "0"
    args = preset("llama-3.1-8b")
    a = args
    shapes = {"wqkv": ((a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim, a.hidden_size),
              "wo": (a.hidden_size, a.hidden_size), "w13": (2 * a.intermediate_size, a.hidden_size),
              "w2": (a.hidden_size, a.intermediate_size), "output": (a.vocab_size, a.hidden_size)}
    print("| GEMV (one token) | weight MB | time us | GB/s |\n| --- | --- | --- | --- |")
    for name, (n, k) in ({} if opts.skip_gemv else shapes).items():
        gbs, us = gemv_bandwidth(n, k)
        print(f"| {name} {n}x{k} | {n * k * 2 / 1e6:.0f} | {us:.1f} | {gbs:.0f} |", flush=True)
    for quantize in opts.quantize:
        print(f"\n## {quantize}")
        print_trace(*step_trace(quantize, opts.kv_int8, pdl=not opts.no_pdl, compile_options=opts.compile_options))


if __name__ == "__main__":
    main()
