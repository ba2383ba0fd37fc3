"""The Triton GEMVs on the GPU: correctness at every preset shape, then block
sizes chosen by measurement.

    PYTHONPATH=. python3 benchmarks/gemv_sweep.py [--write] [--retime] [--kinds bf16,int8,int4] [--check KINDS]
        [--presets llama-3.1-8b,qwen3-8b,gemma-3-12b,phi-4]

1. Correctness: each kind (bf16, int8, fp8, int4 g32/g64/g128/g256) at every
   weight shape of the Llama-3.1-8B, Mixtral-8x7B and SmolLM2-135M presets,
   random weights and a random bf16 token, against fp64 of the same
   (dequantized) weights. Bound: 1e-4 relative (fp32 accumulation over K up
   to 14336; bf16 itself resolves 3.9e-3).
2. Speed: for each shape of the --presets (default Llama-3.1-8B's) and
   weight width, candidate block sizes,
   each replayed in a CUDA graph over rotating weight copies (L2 never holds
   the weight) and timed with CUDA events; bytes counted are the codes plus
   scales and zeros. cuBLAS (bf16) and tinygemm (int4) run alongside.
3. --write: the best configs into brisklm/kernels/gemv_tuned.json under this
   device's name (the dense bf16 GEMV is used only where it beat cuBLAS).

The table printed last is the summary.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from brisklm.kernels import gemv
from brisklm.presets import preset
from brisklm.quantize import dequantize, quantize_fp8, quantize_int4, quantize_int8


def model_shapes(args) -> dict[str, tuple[int, int]]:
    qkv = (args.num_attention_heads + 2 * args.num_key_value_heads) * args.head_dim
    return {"wqkv": (qkv, args.hidden_size), "wo": (args.hidden_size, args.num_attention_heads * args.head_dim),
            "w13": (2 * args.intermediate_size, args.hidden_size), "w2": (args.hidden_size, args.intermediate_size),
            "output": (args.vocab_size, args.hidden_size)}


def all_shapes():
    llama, smol = preset("llama-3.1-8b"), preset("smollm2-135m")
    # Mixtral-8x7B: Llama's attention, experts of Llama-3.1-8B's FFN shape, a 32000 vocabulary.
    mixtral = dict(model_shapes(llama), output=(32000, 4096))
    shapes = {}
    for model, table in (("llama-3.1-8b", model_shapes(llama)), ("mixtral-8x7b", mixtral),
                         ("smollm2-135m", model_shapes(smol))):
        for name, shape in table.items():
            shapes.setdefault(shape, f"{model} {name}")
    return shapes


def make(kind: str, w: torch.Tensor):
    """(x -> fp32 output, x -> the kernel's partial sums alone, fp64 reference
    weight, bytes read)."""
    if kind == "bf16":
        wb = w.to(torch.bfloat16)
        raw = lambda x: gemv.scaled_gemv(x, wb)  # noqa: E731
        return (lambda x: raw(x).sum(0)), raw, wb.double(), wb.numel() * 2
    if kind in ("int8", "fp8"):
        parts = (quantize_int8 if kind == "int8" else quantize_fp8)(w)
        q, s = parts[kind], parts["scale"]
        raw = lambda x: gemv.scaled_gemv(x, q)  # noqa: E731
        return (lambda x: raw(x).sum(0) * s), raw, dequantize(parts).double(), q.numel() + s.numel() * 2
    group = int(kind.split("g")[1])
    if kind.startswith("int8"):  # a fp16 scale per group: GGUF Q8_0
        parts = quantize_int8(w, group)
        q, s = parts["int8"], parts["scale"].half()
        ref = dequantize({"int8": q, "scale": s})
        raw = lambda x: gemv.int8_group_gemv(x, q, s)  # noqa: E731
        return (lambda x: raw(x).sum(0)), raw, ref.double(), q.numel() + 2 * s.numel()
    parts = quantize_int4(w, group, torch.bfloat16)
    p, s, z = parts["int4"], parts["scale"].bfloat16(), parts["zero"].bfloat16()
    ref = dequantize({"int4": p, "scale": s.float(), "zero": z.float()})
    raw = lambda x: gemv.int4_gemv(x, p, s, z)  # noqa: E731
    return (lambda x: raw(x).sum(0)), raw, ref.double(), p.numel() + 4 * s.numel()


def width_key(kind: str):
    """The key gemv.config files a kind under: bits per weight, "8g" for grouped
    int8, "8d", "8gd" and "4d" for int8, Q8_0 and int4 (bf16 activations: the dp4a kernels),
    "8f" for fp8 (the fp16x2 kernel)."""
    return {"bf16": 16, "int8": "8d", "fp8": "8f", "int8-g32": "8gd"}.get(kind, "4d")


# fp8 sums runs of 16 products in fp16 (gemv.FP8_HALF), each rounded to 2**-11
# of the run's size: about 1e-3 of the output's norm at K = 4096, under the
# 3.9e-3 that bf16 itself resolves and far under fp8's own rounding (2**-4).
BOUND = {"fp8": 2e-3}


def check_correctness(kinds) -> list[str]:
    rows, worst = [], {}
    torch.manual_seed(0)
    for (n, k), where in all_shapes().items():
        w = torch.randn(n, k, device="cuda") * 0.02
        x = torch.randn(k, device="cuda").to(torch.bfloat16)
        for kind in kinds:
            if "-g" in kind and k % int(kind.split("g")[1]):
                continue
            fn, _, ref_w, _ = make(kind, w)
            ref = ref_w @ x.double()
            err = ((fn(x).double() - ref).norm() / ref.norm()).item()
            worst[kind] = max(worst.get(kind, 0.0), err)
            ok = err < BOUND.get(kind, 1e-4)
            if not ok:
                rows.append(f"FAIL {where} {n}x{k} {kind}: relative error {err:.2e}")
    rows += [f"correctness {kind}: worst relative error {e:.2e} over all shapes (bound {BOUND.get(kind, 1e-4):g})"
             for kind, e in worst.items()]
    return rows


def time_us(calls, reps=24) -> float:
    """Microseconds a call, best of 3: `reps` calls over rotating weight copies in one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (4 * reps))
    return best


def read_ceiling_gbs() -> float:
    a, b = (torch.empty(2 * 1024**3, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(2))
    calls = [lambda t=t: t.sum(dtype=torch.float32) for t in (a, b)]
    us = time_us(calls, reps=8)
    del a, b
    return 4 * 1024**3 / us / 1e3


CANDIDATES = {  # (BLOCK_N, BLOCK_K, num_warps); BLOCK_K in codes
    "8g": [(16, 512, 4), (32, 512, 4), (32, 512, 8), (16, 1024, 4), (8, 1024, 4), (64, 256, 8)],
    16: [(4, 512, 4), (8, 512, 4), (16, 512, 4), (8, 1024, 4), (16, 1024, 8), (2, 2048, 4), (32, 256, 4)],
    8: [(8, 1024, 4), (16, 1024, 4), (16, 512, 4), (32, 512, 8), (8, 2048, 4), (4, 2048, 4), (16, 2048, 8),
        (4, 4096, 4)],
    # dp4a: each program also packs its slice of x, work that more rows amortize
    # (sm_90 SASS: 2.95 instructions a code at (16, 1024, 4), 2.59 for int4 at (32, 1024, 4))
    "8d": [(16, 1024, 4), (8, 1024, 4), (32, 1024, 8), (16, 2048, 8), (8, 2048, 4), (32, 512, 4), (64, 512, 8),
           (4, 4096, 4), (8, 512, 4), (16, 512, 4), (64, 256, 8), (32, 256, 4)],
    # fp8 in fp16x2: more rows amortize x's conversion (SASS: 2.27 instructions a code at
    # (16, 1024, 4), 1.70 at (64, 512, 4))
    "8f": [(64, 512, 4), (32, 512, 4), (64, 1024, 8), (32, 1024, 4), (16, 1024, 4), (128, 256, 8), (64, 256, 4),
           (16, 512, 4), (128, 512, 8), (32, 2048, 8)],
    "8gd": [(16, 1024, 4), (8, 1024, 4), (32, 1024, 8), (16, 2048, 8), (32, 512, 4), (64, 512, 8), (16, 512, 4)],
    "4d": [(32, 1024, 4), (16, 1024, 4), (64, 1024, 8), (32, 2048, 8), (16, 2048, 4), (64, 512, 4), (128, 512, 8),
           (8, 4096, 4), (64, 512, 8), (128, 256, 8), (64, 256, 4), (32, 512, 4)],
}


def sweep(kind: str, n: int, k: int, candidates=None, copies_bytes=6e8):
    bits = width_key(kind)
    w = torch.randn(n, k, device="cuda") * 0.02
    _, fn, _, nbytes = make(kind, w)
    del w
    copies = max(2, int(copies_bytes // nbytes))
    fns = [fn] + [make(kind, torch.randn(n, k, device="cuda") * 0.02)[1] for _ in range(copies - 1)]
    x = torch.randn(k, device="cuda").to(torch.bfloat16)
    results = []
    if candidates is None:
        splits = (1, 2, 4) if n <= 8192 else (1,)
        candidates = [(bn, bk, sp, wp) for bn, bk, wp in CANDIDATES[bits] for sp in splits]
    for cfg in candidates:
        with gemv.tuned_table({f"{bits}:{n}:{k}": {"config": cfg}}):
            if gemv.config(bits, n, k, {"4d": 128, "8g": 32, "8gd": 32, "8d": gemv.dp4a_block(k)}.get(bits)) != cfg:
                continue  # adjusted to fit K: measured under its own entry
            try:
                us = time_us([lambda f=f: f(x) for f in fns])
            except Exception as e:  # a config the compiler rejects (registers, shared memory)
                print(f"  {kind} {n}x{k} {cfg}: {type(e).__name__}", flush=True)
                continue
        results.append((us, cfg))
    baseline = None
    if bits == 16:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        xb = x.reshape(1, k)
        baseline = time_us([lambda w=w: F.linear(xb, w) for w in ws])
        del ws
    elif kind == "int4-g128":
        packs = []
        for _ in range(copies):
            parts = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128, torch.bfloat16)
            sz = torch.stack([parts["scale"], parts["zero"]], -1).transpose(0, 1).contiguous().bfloat16()
            packs.append((torch.ops.aten._convert_weight_to_int4pack(parts["int4"], 8), sz))
        xb = x.reshape(1, k)
        baseline = time_us([lambda p=p: torch.ops.aten._weight_int4pack_mm(xb, p[0], 128, p[1]) for p in packs])
        del packs
    del fns
    torch.cuda.empty_cache()
    us, cfg = min(results)
    return {"config": list(cfg), "us": us, "gbs": nbytes / us / 1e3, "bytes": nbytes,
            "baseline_us": baseline}


def write_table(table):
    name = torch.cuda.get_device_name()
    try:
        with open(gemv.TUNED_FILE) as f:
            data = json.load(f)
    except FileNotFoundError:
        data = {}
    data.setdefault(name, {}).update(table)  # a sweep of some kinds keeps the others
    data[name]["_gpu"] = gemv.gpu_kind()  # (a GPU of the same SMs takes what its own table lacks from here)
    with open(gemv.TUNED_FILE, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    print(f"wrote {len(table)} entries for {name} to {gemv.TUNED_FILE}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--kinds", default="bf16,int8,fp8,int8-g32,int4-g128,int4-g64",
                    help="kinds to time ('' for none)")
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    ap.add_argument("--retime", action="store_true", help="time only the configs already in the table")
    ap.add_argument("--presets", default="llama-3.1-8b",
                    help="comma-separated presets whose matrix shapes are timed (a shape already met is skipped)")
    ap.add_argument("--check", default="bf16,int8,fp8,int8-g32,int4-g32,int4-g64,int4-g128,int4-g256",
                    help="kinds whose correctness is checked first ('' for none)")
    opts = ap.parse_args()
    t0 = time.time()
    lines = check_correctness([k for k in opts.check.split(",") if k])
    print("\n".join(lines), flush=True)
    print(f"correctness checked in {time.time() - t0:.0f} s", flush=True)
    ceiling = read_ceiling_gbs()
    shapes = {}
    for name in opts.presets.split(","):
        for matrix, shape in model_shapes(preset(name)).items():
            if shape not in shapes.values():
                shapes[f"{name} {matrix}"] = shape
    table, rows = {}, []
    for kind in [k for k in opts.kinds.split(",") if k]:
        bits = width_key(kind)
        for name, (n, k) in shapes.items():
            # int4 g64 runs at g128's blocks: the table is keyed by width and shape
            key = f"{bits}:{n}:{k}"
            fixed = [tuple(table[key]["config"])] if kind == "int4-g64" and key in table else None
            if opts.retime and key in gemv.tuned():  # time the stored config only
                fixed = [tuple(gemv.tuned()[key]["config"])]
            r = sweep(kind, n, k, fixed)
            print(f"{kind} {name} {n}x{k}: {r}", flush=True)
            rows.append((kind, name, n, k, r))
            if fixed:
                continue
            entry = {"config": r["config"], "us": round(r["us"], 2)}
            if bits == 16:
                entry["cublas_us"] = round(r["baseline_us"], 2)
            table[key] = entry
        if opts.write:  # after each kind, so a run cut short keeps what it measured
            write_table(table)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"ceiling_gbs": ceiling, "rows": rows}, f, indent=1)
    print(f"\nread ceiling {ceiling:.0f} GB/s; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| kind | matrix | N x K | best config (BLOCK_N, BLOCK_K, SPLIT_K, warps) | us | GB/s | of ceiling "
          "| cuBLAS bf16 / tinygemm int4 us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind, name, n, k, r in rows:
        base = f"{r['baseline_us']:.1f}" if r["baseline_us"] else ""
        print(f"| {kind} | {name} | {n}x{k} | {tuple(r['config'])} | {r['us']:.1f} | {r['gbs']:.0f} "
              f"| {r['gbs'] / ceiling:.2f} | {base} |")
    print("\n".join(lines))
    if any(line.startswith("FAIL") for line in lines):
        raise SystemExit("a GEMV is outside its error bound")


if __name__ == "__main__":
    main()
