"""The Triton GEMVs (brisklm/kernels/gemv.py), run by Triton's interpreter on
the CPU: the same kernel source the GPU compiles, checked against an fp64
reference at SmolLM2's shapes and at ragged ones, and inside a whole quantized
model against its dequantized weights. (benchmarks/gemv_check.py runs the same
comparison on an H200 at the Llama-3.1-8B, Mixtral and SmolLM2 shapes.)

The interpreter is chosen when triton is imported, so these run in a child
process with TRITON_INTERPRET=1."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (N, K): SmolLM2-135M's wqkv and w2 (its wo and w13 differ only in N), and
# ragged shapes (N not a multiple of the row block, K of no block; int4 pads K).
SHAPES = [(960, 576), (576, 1536), (37, 200), (5, 96)]

CHILD = r"""
import sys, torch
import torch.nn.functional as F
from brisklm.kernels import gemv
from brisklm.quantize import dequantize, quantize_fp8, quantize_int4, quantize_int8
assert gemv.available(torch.device("cpu"))
torch.manual_seed(0)
worst = 0.0
for n, k in SHAPES:
    w = torch.randn(n, k) * 0.02
    x = torch.randn(k).to(torch.bfloat16)
    cases = [("bf16", None), ("int8", quantize_int8(w)), ("fp8", quantize_fp8(w))]
    cases += [(f"int4-g{g}", quantize_int4(w, g, torch.bfloat16)) for g in (32, 64, 128, 256) if k >= g]
    if k % 32 == 0:  # int8 with an fp16 scale per 32 inputs: GGUF Q8_0
        q8 = quantize_int8(w, 32)
        cases.append(("int8-g32", {"q8": q8["int8"], "scale": q8["scale"].half()}))
    for name, parts in cases:
        if parts is not None and "q8" in parts:
            q, scale = parts["q8"], parts["scale"]
            ref = (q.double().reshape(n, -1, 32) * scale.double()[..., None]).reshape(n, k) @ x.double()
            y = gemv.int8_group_gemv(x, q, scale).sum(0).double()
        elif parts is None:
            wb = w.to(torch.bfloat16)
            ref, y = wb.double() @ x.double(), gemv.scaled_gemv(x, wb).sum(0).double()
        elif "int4" in parts:
            kp = 2 * parts["int4"].shape[1]
            ref = dequantize(parts)[:, :k].double() @ x.double()
            xp = F.pad(x, (0, kp - k))
            y = gemv.int4_gemv(xp, parts["int4"], parts["scale"].bfloat16(), parts["zero"].bfloat16())
            y = y.sum(0).double()
        else:
            q = parts.get("int8", parts.get("fp8"))
            ref = dequantize(parts).double() @ x.double()
            y = gemv.scaled_gemv(x, q).sum(0).double() * parts["scale"].double()
        err = ((y - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
        assert err < 1e-5, (n, k, name, err)
print("worst relative error", worst)
"""

MODEL_CHILD = r"""
import torch
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.quantize import dequantize, quantize_state_dict, quantized_entries
args = ModelArgs(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
state = random_state_dict(args, torch.float32, std=0.1)
for mode, group in (("int8", None), ("fp8", None), ("int4", 32)):
    qargs, qstate = quantize_state_dict(args, state, mode, group or 32)
    dense = {}
    for name, t in qstate.items():
        base, _, suffix = name.rpartition("_")
        if suffix in ("int4", "int8", "fp8"):
            dense[base] = dequantize(quantized_entries(qstate, base))
        elif suffix not in ("scale", "zero"):
            dense[name] = t
    a, b = build_model(qargs, qstate), build_model(qargs, dense)
    assert any(getattr(m, "keep_codes", False) or type(m).__name__ == "ScaledWeightOnlyLinear"
               for m in a.modules())
    for m in (a, b):
        m.setup_caches(1, 16)
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 9, 3]])
        for start in (0, 4):  # prefill (dense path), then one decode token (the GEMVs)
            pos = torch.arange(start, start + ids.shape[1])
            la, lb = a(ids, pos), b(ids, pos)
            err = ((la - lb).norm() / lb.norm()).item()
            assert err < 1e-5, (mode, start, err)
            ids = lb[:, -1:].argmax(-1)
    print(mode, "ok")
"""


def run_interpreted(code: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_gemv_kernels_match_fp64_at_smollm2_and_ragged_shapes():
    out = run_interpreted(f"SHAPES = {SHAPES!r}\n" + CHILD)
    assert "worst relative error" in out


def test_quantized_model_through_the_kernels_matches_its_dequantized_weights():
    out = run_interpreted(MODEL_CHILD)
    assert out.split() == ["int8", "ok", "fp8", "ok", "int4", "ok"]
