"""kernels/matmul.py on a GPU: a few tokens times quantized weights, checked
against fp64 and timed against the path it replaces (widen the weight to bf16,
then one dense matmul), at the Llama-3.1-8B shapes.

    PYTHONPATH=. python3 benchmarks/few_rows.py [--tokens 2,5,9,17,35,64]

    PYTHONPATH=. python3 benchmarks/few_rows.py --sweep_words   # blocks for matmul.WORDS

Each weight is one of several copies used in turn, so that no timed read
hits in L2. Prints, per format and token count, the microseconds for one
layer's four matrices and the output layer, and the bytes of codes read per
second as a fraction of the read ceiling measured in the same run. int4 in
groups of 64 or more goes through its codes read as words (matmul.WORDS),
in groups of 32 through the widened tile; the row int4-g128-tile is the
same codes as int4-g128 through the widened tile.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from brisklm.bench import read_ceiling_gb_s
from brisklm.kernels import matmul
from brisklm.kernels.matmul import few_rows_matmul
from brisklm.quantize import dequantize, quantize_fp8, quantize_int4, quantize_int8

SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336),
          "output": (128256, 4096)}

# int4 g128 through the widened tile (matmul.WORDS off) instead of its words
OTHER = {"int4-g128-tile": ()}


def formats(w):
    q8 = quantize_int8(w, 32)
    int4 = quantize_int4(w, 128, torch.bfloat16)
    int4_g32 = quantize_int4(w, 32, torch.bfloat16)
    return {"int8": quantize_int8(w), "int4-g128": int4, "int4-g128-tile": int4, "int4-g32": int4_g32,
            "q8_0": {"int8": q8["int8"], "scale": q8["scale"].half()}, "fp8": quantize_fp8(w)}


def with_words(call, words):
    """call, run with matmul.WORDS = words (() : int4 through the widened tile)."""
    def run(x):
        saved = matmul.WORDS
        matmul.WORDS = words
        try:
            return call(x)
        finally:
            matmul.WORDS = saved
    return run


def kernel_and_widened(name, parts):
    """(few-rows call, widen-then-matmul call) for x (M, K) bf16."""
    if name in OTHER:
        few, widened = kernel_and_widened(name.rsplit("-", 1)[0], parts)
        return with_words(few, OTHER[name]), widened
    if name.startswith("int4"):
        p, s, z = parts["int4"], parts["scale"].bfloat16(), parts["zero"].bfloat16()
        g = 2 * p.shape[1] // s.shape[1]

        def widened(x):
            codes = torch.stack([p >> 4, p & 15], -1).reshape(p.shape[0], -1, g)
            return F.linear(x, ((codes.to(x.dtype) - 8) * s[..., None] + z[..., None]).flatten(1))
        return (lambda x: few_rows_matmul(x, p, s, z)), widened
    if name == "q8_0":
        q, s = parts["int8"], parts["scale"]
        return (lambda x: few_rows_matmul(x, q, s)), \
            (lambda x: F.linear(x, (q.unflatten(1, (s.shape[1], -1)).to(x.dtype) * s[..., None].to(x.dtype)).flatten(1)))
    q, s = parts.get("int8", parts.get("fp8")), parts["scale"].bfloat16()
    return (lambda x: few_rows_matmul(x, q) * s), (lambda x: F.linear(x, q.to(x.dtype)) * s)


def graphed_us(calls, x, reps=24):
    """Microseconds a call, calls[i % len(calls)](x) for i < reps captured in one
    CUDA graph and replayed: the kernels' own time, not Python's launches."""
    for call in calls[:2]:
        call(x)  # (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)](x)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (3 * reps)


def words_grid():
    """(BLOCK_N, groups a step, warps, stages, SWAP, programs) candidates for matmul.WORDS."""
    for swap in (True, False):
        for block_n in (32, 64, 128):
            for groups in (1, 2):
                for warps in (4, 8):
                    for stages in (3, 4):
                        yield block_n, groups, warps, stages, swap, 528


def sweep_grid():
    """(BLOCK_N, BLOCK_K, warps, stages, SWAP, programs) candidates for matmul.CONFIG."""
    for swap in (False, True):
        for block_n, block_k in ((32, 256), (64, 128), (64, 256), (128, 64)):
            for warps in (4, 8):
                for stages in (3,):
                    for programs in (264, 528):
                        yield block_n, block_k, warps, stages, swap, programs


def gemv_call(fmt, parts):
    """One token through the decode GEMV (fusion.FusedLinear.one_token's route), for x (K,)."""
    from brisklm.kernels import gemv
    if fmt == "bf16":
        return lambda x: gemv.scaled_gemv(x, parts).sum(0)
    if fmt.startswith("int4"):
        return lambda x: gemv.int4_gemv(x, parts["int4"], parts["scale"].bfloat16(), parts["zero"].bfloat16()).sum(0)
    return lambda x: gemv.scaled_gemv(x, parts["int8"]).sum(0) * parts["scale"]


def use_config(kind):
    def use(c):
        matmul.CONFIG[kind] = c
    return use


def use_words(c):
    matmul.WORDS = c


def sweep(m=5, fmts=("bf16", "int8", "int4-g128-tile"), words=False):
    """One 8B layer's matrices and the output layer, M = m rows, per weight kind:
    every candidate of its grid (sweep_grid for matmul.CONFIG, the widened
    tile's kernel; words_grid for matmul.WORDS) (the best few printed, and
    the best per matrix), against cuBLAS (bf16) and one token through the decode GEMV."""
    device = torch.device("cuda")
    kinds = {f: k for f, k in {"bf16": matmul.DENSE, "int8": matmul.ROW_SCALED, "int4-g128-tile": matmul.INT4,
                               "int4-g128": "words"}.items() if f in fmts}
    grid = list(words_grid() if words else sweep_grid())
    best = {}
    for fmt, kind in kinds.items():
        totals = {c: 0.0 for c in grid}
        per_shape = {}
        refs = {"cublas": 0.0, "gemv (1 token)": 0.0}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device=device) * 0.02
            copies = max(2, int(6e8 // (n * k * (2 if fmt == "bf16" else 1))))
            parts = [(w.roll(i, 0).bfloat16() if fmt == "bf16" else formats(w.roll(i, 0))[fmt])
                     for i in range(copies)]
            del w
            if fmt == "bf16":
                calls = [lambda x, p=p: few_rows_matmul(x, p) for p in parts]
            else:
                calls = [kernel_and_widened(fmt, p)[0] for p in parts]
            x = torch.randn(m, k, device=device).bfloat16()
            x1 = x[0].contiguous()
            if fmt == "bf16":
                refs["cublas"] += graphed_us([lambda x, p=p: F.linear(x, p) for p in parts], x)
            refs["gemv (1 token)"] += graphed_us([gemv_call(fmt, p) for p in parts], x1)
            for c in grid:
                (use_words if kind == "words" else use_config(kind))(c)
                try:
                    t = graphed_us(calls, x)
                except Exception as e:  # (a block that does not fit the chip's resources)
                    print(f"{fmt} {name} {c}: {type(e).__name__}", flush=True)
                    t = float("inf")
                totals[c] += t
                per_shape[name, c] = t
            del parts, calls
            torch.cuda.empty_cache()
        ranked = sorted(grid, key=totals.get)
        best[fmt] = ranked[0]
        print(f"\n{fmt}, {m} rows, us for the 5 matrices: " + ", ".join(f"{k} {v:.0f}" for k, v in refs.items()))
        for c in ranked[:6]:
            print(f"  {c}: {totals[c]:.0f} us")
        for name in SHAPES:
            c = min(grid, key=lambda c: per_shape[name, c])
            print(f"  best for {name}: {c} {per_shape[name, c]:.1f} us (chosen: {per_shape[name, ranked[0]]:.1f})")
        (use_words if kind == "words" else use_config(kind))(ranked[0])
    print("CONFIG = " + repr({kinds[f]: c for f, c in best.items()}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="2,5,9,17,35,64")
    parser.add_argument("--sweep", action="store_true", help="time other blocks (matmul.CONFIG) first")
    parser.add_argument("--sweep_only", action="store_true")
    parser.add_argument("--sweep_words", action="store_true", help="time blocks for matmul.WORDS first")
    parser.add_argument("--rows", type=int, default=5, help="the sweeps' tokens")
    opts = parser.parse_args()
    if opts.sweep_words:
        sweep(opts.rows, ("int4-g128",), words=True)
    if opts.sweep or opts.sweep_only:
        sweep(opts.rows)
        if opts.sweep_only:
            return
    device = torch.device("cuda")
    torch.manual_seed(0)
    ceiling = read_ceiling_gb_s(device)
    tokens = [int(t) for t in opts.tokens.split(",")]
    worst = {}
    rows = []
    for fmt in ("int8", "int4-g128", "int4-g128-tile", "int4-g32", "q8_0", "fp8"):
        total = {m: [0.0, 0.0] for m in tokens}
        code_bytes = 0
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device=device) * 0.02
            copies = max(1, int(3e8 // (n * k)))  # > 300 MB of codes in turn: none stays in L2
            parts = [formats(w if i == 0 else w.roll(i, 0))[fmt] for i in range(copies)]
            code_bytes += sum(t.numel() * t.element_size() for t in parts[0].values())
            calls = [kernel_and_widened(fmt, p) for p in parts]
            ref_w = dequantize(parts[0]).double()
            for m in tokens:
                x = torch.randn(m, k, device=device).bfloat16()
                y = calls[0][0](x).double()
                ref = x.double() @ ref_w.t()
                err = ((y - ref).norm() / ref.norm()).item()
                worst[fmt] = max(worst.get(fmt, 0), err)
                total[m][0] += graphed_us([c[0] for c in calls], x)
                total[m][1] += graphed_us([c[1] for c in calls], x)
            del parts, calls, w
        for m in tokens:
            few, wide = total[m]
            rows.append((fmt, m, few, wide, code_bytes / few / 1e3 / ceiling))
    print(f"read ceiling {ceiling:.0f} GB/s; worst relative error against fp64: "
          + ", ".join(f"{f} {e:.1e}" for f, e in worst.items()))
    print("| format | tokens | few-rows kernel us (a layer + output) | widened + matmul us | speed-up "
          "| codes read / ceiling |")
    print("| --- | --- | --- | --- | --- | --- |")
    for fmt, m, few, wide, frac in rows:
        print(f"| {fmt} | {m} | {few:.0f} | {wide:.0f} | {wide / few:.1f}x | {frac:.2f} |")
    assert all(e < 1e-2 for e in worst.values()), worst  # bf16 weights in the dot: ~3e-3; int8 x: ~6e-3


if __name__ == "__main__":
    main()
