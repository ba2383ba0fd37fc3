"""Quantized models on the GPU compute what their weights say, eager and compiled.

    PYTHONPATH=. python3 benchmarks/gpu_quant_check.py [--layers 4]

For each mode (int8, q8_0, fp8, int4 g128, int4 g32), a model with the Llama-3.1-8B
matrix shapes (fewer layers, random weights) is quantized and run three ways
over a 5-token prompt (the few-rows kernels) and one decode token:
  - dense: the dequantized weights as plain bf16 matrices (cuBLAS, and
    the RMSNorms applied as modules, not folded into the GEMVs);
  - eager: the quantized model, decode through our Triton GEMVs;
  - compiled: the same under torch.compile (inductor inlines the kernels).
It prints the relative L2 difference of the logits, dense vs eager and
eager vs compiled; the bf16 model itself, through our GEMVs against
cuBLAS, too. Bound: 5e-2. bf16 activations round at 3.9e-3 per
operation and the differences compound over the layers (the dense bf16 model
against itself under torch.compile is printed for scale); a wrong kernel
gives differences of order 1.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from brisklm.fusion import fuse_for_decode
from brisklm.kernels import gemv
from brisklm.model import build_model, canonical_names, random_state_dict
from brisklm.presets import preset
from brisklm.quantize import FORMATS, dequantize, quantize_state_dict, quantized_entries

gemv.traced_as_constants()  # (this script compiles our modules itself, as load() does)


def dense_copy(args, state):
    shapes, dense = canonical_names(args), {}
    for name, t in state.items():
        base, _, suffix = name.rpartition("_")
        if suffix in ("int4", "int8", "fp8"):
            w = dequantize(quantized_entries(state, base))
            dense[base] = w[:, :shapes[base][1]].to(torch.bfloat16)  # int4 pads K to whole groups
        elif suffix not in ("scale", "zero"):
            dense[name] = t
    return dense


def decode_logits(model, fn, prompt):
    """The prompt's logits (its 5 rows: the few-rows kernels, as a verify step
    runs them) and the next token's (the GEMVs), one after the other."""
    model.setup_caches(1, 64)
    n, device = prompt.shape[1], prompt.device
    with torch.no_grad():
        logits = fn(prompt, torch.arange(n, device=device), kv_len=n)
        nxt = logits[:, -1:].argmax(-1)
        decoded = fn(nxt, torch.tensor([n], device=device), kv_len=n + 1)
        return torch.cat([logits[0], decoded[0, -1:]]).float()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    opts = ap.parse_args()
    args = replace(preset(opts.preset), num_hidden_layers=opts.layers)
    state = random_state_dict(args, torch.bfloat16, device=opts.device)
    prompt = torch.tensor([[1, 5, 9, 3, 7]], device=opts.device)
    rows = []
    base, plain = fuse_for_decode(build_model(args, state, FORMATS)), build_model(args, state, FORMATS)
    eager = decode_logits(base, base, prompt)
    dense = decode_logits(plain, plain, prompt)  # no kernels of ours: cuBLAS
    compiled = decode_logits(base, torch.compile(base), prompt)
    rows.append(("bf16 (our GEMVs per the table, against cuBLAS)", rel(eager, dense), rel(compiled, eager)))
    for mode, group in (("int8", None), ("q8_0", None), ("fp8", None), ("int4", 128), ("int4", 32)):
        qargs, qstate = quantize_state_dict(args, state, mode, group or 128)
        qmodel = fuse_for_decode(build_model(qargs, qstate, FORMATS))
        dmodel = build_model(qargs, dense_copy(qargs, qstate), FORMATS)
        d = decode_logits(dmodel, dmodel, prompt)
        e = decode_logits(qmodel, qmodel, prompt)
        torch._dynamo.reset()
        c = decode_logits(qmodel, torch.compile(qmodel), prompt)
        rows.append((mode + (f" g{group}" if group else ""), rel(e, d), rel(c, e)))
        print(rows[-1], flush=True)
    where = torch.cuda.get_device_name() if opts.device == "cuda" else opts.device
    print(f"\n{where}, torch {torch.__version__}, {opts.preset} shapes, "
          f"{opts.layers} layers; relative L2 difference of the prompt's and decode logits (bound 5e-2)")
    print("| mode | dequantized dense vs eager | eager vs compiled |\n| --- | --- | --- |")
    ok = True
    for mode, de, ec in rows:
        ok &= (de == "" or de < 5e-2) and ec < 5e-2
        print(f"| {mode} | {de if de == '' else f'{de:.2e}'} | {ec:.2e} |")
    print("all within bound" if ok else "FAILED")
    if not ok:
        raise SystemExit("a quantized mode is outside the bound")


if __name__ == "__main__":
    main()
