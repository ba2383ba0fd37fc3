"""Where a decode step's time goes on the GPU (Llama-3.1-8B preset, bf16, batch 1).

    PYTHONPATH=. python3 benchmarks/profile_decode.py

1. Per-GEMV bandwidth: F.linear of one token against each weight shape of the
   model, replayed in a CUDA graph over rotating weight copies (so L2 never
   holds the weight), timed with CUDA events: bytes of the weight / time.
2. The compiled decode step under torch.profiler, without CUDA graphs so each
   kernel is visible: GPU kernel time per step against the CUDA-graph step's
   wall time, and the kernels that take the most time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brisklm.generate import Generator
from brisklm.model import build_model, random_state_dict
from brisklm.presets import preset
from brisklm.sampling import SamplingParams


def gemv_bandwidth(out_features, in_features, copies_bytes=1.2e9, reps=20):
    w_bytes = out_features * in_features * 2
    n = max(2, int(copies_bytes // w_bytes))
    ws = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(n)]
    x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
    for w in ws:
        F.linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            F.linear(x, ws[i % n])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / (5 * reps)
    del ws
    return w_bytes / seconds / 1e9, seconds * 1e6


def step_profile(args):
    model = build_model(args, random_state_dict(args, torch.bfloat16, device="cuda"))
    rows = {}
    for graphs in (True, False):
        gen = Generator(model, 1024, compile=True, compile_options={"triton.cudagraphs": graphs})
        list(gen.tokens([1, 2, 3, 4, 5], 50, SamplingParams()))  # compile and warm up
        list(gen.tokens([1, 2, 3, 4, 5], 100, SamplingParams()))
        rows[graphs] = gen.stats.decode_tokens_per_s
        if graphs:
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            list(gen.tokens([1, 2, 3, 4, 5], 21, SamplingParams()))
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total_us = sum(e.self_device_time_total for e in events) / 20  # per decode step (+ prefill)
        top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:10]
    return rows, total_us, top


def main():
    args = preset("llama-3.1-8b")
    a = args
    shapes = {"wqkv": ((a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim, a.hidden_size),
              "wo": (a.hidden_size, a.hidden_size), "w13": (2 * a.intermediate_size, a.hidden_size),
              "w2": (a.hidden_size, a.intermediate_size), "output": (a.vocab_size, a.hidden_size)}
    print("| GEMV (one token) | weight MB | time us | GB/s |\n| --- | --- | --- | --- |")
    for name, (n, k) in shapes.items():
        gbs, us = gemv_bandwidth(n, k)
        print(f"| {name} {n}x{k} | {n * k * 2 / 1e6:.0f} | {us:.1f} | {gbs:.0f} |", flush=True)
    rates, kernel_us, top = step_profile(args)
    print(f"\ndecode tokens/s: {rates[True]:.1f} with CUDA graphs, {rates[False]:.1f} without")
    print(f"GPU kernel time per step (no graphs): {kernel_us:.0f} us; graph step wall time "
          f"{1e6 / rates[True]:.0f} us")
    print("\n| kernel | calls | total us (20 steps) | share |\n| --- | --- | --- | --- |")
    for e in top:
        print(f"| {e.key[:90]} | {e.count} | {e.self_device_time_total:.0f} | "
              f"{e.self_device_time_total / (kernel_us * 20):.2f} |")


if __name__ == "__main__":
    main()
