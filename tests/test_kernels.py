"""The Triton GEMVs (brisklm/kernels/gemv.py), run by Triton's interpreter on
the CPU: the same kernel source the GPU compiles, checked against an fp64
reference at SmolLM2's shapes and at ragged ones, and inside a whole quantized
model against its dequantized weights. (benchmarks/gemv_sweep.py --check runs the same
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
        # int8 (Q8_0 too) and int4 with a bf16 x go through dp4a, x as int8 planes
        # within 1.6e-5 of each block's largest |x| (gemv._x_planes); the rest sums in fp32
        # (fp8 here too: the fp16 sums of its PTX are checked by test_fp8_half_ptx_...)
        assert err < (1e-4 if name.startswith(("int8", "int4")) else 1e-5), (n, k, name, err)
print("worst relative error", worst)
"""

MODEL_CHILD = r"""
import torch
from brisklm.fusion import FusedLinear, FusedMoE, fuse_for_decode
from brisklm.kernels import gemv, matmul
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.quantize import dequantize, quantize_state_dict, quantized_entries
args = ModelArgs(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
calls = []
few_rows = matmul.few_rows_matmul
matmul.few_rows_matmul = lambda *a: calls.append(1) or few_rows(*a)
# fp32: prefill multiplies the widened weights; bf16: a few tokens go through kernels/matmul.py
for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    state = random_state_dict(args, dtype, std=0.1)
    for mode, group in (("int8", None), ("fp8", None), ("int4", 32)):
        qargs, qstate = quantize_state_dict(args, state, mode, group or 32)
        dense = {}
        for name, t in qstate.items():
            base, _, suffix = name.rpartition("_")
            if suffix in ("int4", "int8", "fp8"):
                dense[base] = dequantize(quantized_entries(qstate, base)).to(dtype)
            elif suffix not in ("scale", "zero"):
                dense[name] = t
        a, b = fuse_for_decode(build_model(qargs, qstate)), build_model(qargs, dense)
        assert isinstance(a.layers[0].attention.wqkv, FusedLinear) and a.decode_kernels
        for m in (a, b):
            m.setup_caches(1, 16)
            m.prepare()
        calls.clear()
        with torch.no_grad():
            ids = torch.tensor([[1, 5, 9, 3]])
            for start in (0, 4):  # prefill (4 tokens), then one decode token (the GEMVs)
                pos = torch.arange(start, start + ids.shape[1])
                la, lb = a(ids, pos).float(), b(ids, pos).float()
                err = ((la - lb).norm() / lb.norm()).item()
                assert err < tolerance, (dtype, mode, start, err)
                ids = lb[:, -1:].argmax(-1)
        assert bool(calls) == (dtype == torch.bfloat16), (dtype, mode, len(calls))
        print(mode, "ok")
# An MoE model: each expert's Linears through the kernels, tokens grouped by
# expert (eager) and each token's experts indexed on the device (by_slot).
moe = ModelArgs(**{**args.to_dict(), "num_local_experts": 4, "num_experts_per_tok": 2, "attention_bias": False})
for mode, group in (("int8", None), ("int4", 32)):
    qargs, qstate = quantize_state_dict(moe, random_state_dict(moe, torch.float32, std=0.1), mode, group or 32)
    dense = {}
    for name, t in qstate.items():
        base, _, suffix = name.rpartition("_")
        if suffix in ("int4", "int8"):
            dense[base] = dequantize(quantized_entries(qstate, base))
        elif suffix not in ("scale", "zero"):
            dense[name] = t
    a, b = fuse_for_decode(build_model(qargs, qstate)), build_model(qargs, dense)
    assert isinstance(a.layers[0].feed_forward.experts[3].w2, FusedLinear)
    for m in (a, b):
        m.setup_caches(1, 16)
        m.prepare()
    with torch.no_grad():
        la, lb = a(torch.tensor([[1, 5, 9, 3]]), torch.arange(4)), b(torch.tensor([[1, 5, 9, 3]]), torch.arange(4))
        ta, tb = (m(lb[:, -1:].argmax(-1), torch.tensor([4])) for m in (a, b))
        assert ((ta - tb).norm() / tb.norm()).item() < 1e-5, mode
        ffn, x = a.layers[1].feed_forward, torch.randn(1, 64)
        weights, chosen = ffn.route(x)
        assert torch.allclose(ffn.by_slot(x, weights, chosen), ffn.by_expert(x, weights, chosen), atol=1e-5)
    print("moe", mode, "ok")
# bf16: one token's chosen experts read in place from the stacked weights (FusedMoE, gemv.expert_gemv),
# against the experts' own modules (by_expert)
in_place = []
expert_gemv = gemv.expert_gemv
gemv.expert_gemv = lambda *a: in_place.append(1) or expert_gemv(*a)
for mode in ("int8", "int4", "bf16"):
    state = random_state_dict(moe, torch.bfloat16, std=0.1)
    qargs, qstate = (moe, state) if mode == "bf16" else quantize_state_dict(moe, state, mode, 32)
    a = fuse_for_decode(build_model(qargs, qstate))
    a.setup_caches(1, 16)
    a.prepare()
    ffn = a.layers[1].feed_forward
    assert isinstance(ffn, FusedMoE)
    in_place.clear()
    with torch.no_grad():
        x = torch.randn(2, 64).bfloat16()  # (two rows: a verify step's)
        weights, chosen = ffn.route(x)
        got, want = ffn.by_slot(x, weights, chosen), ffn.by_expert(x, weights, chosen)
    assert len(in_place) == 8, (mode, in_place)  # two rows, two experts each, two matrices each
    err = ((got - want).norm() / want.norm()).item()
    assert err < 2e-2, (mode, err)
    print("in place", mode, "ok")
"""


FEW_ROWS_CHILD = r"""
import torch
import torch.nn.functional as F
from brisklm.kernels import matmul
from brisklm.kernels.matmul import FEW_ROWS, few_rows_matmul, supported
from brisklm.quantize import dequantize, quantize_fp8, quantize_int4, quantize_int8
torch.manual_seed(0)
SWAP = SWAP_SETTING  # the weight tile as the dot's first operand, or second
matmul.CONFIG = {kind: (32, 64, 4, 2, SWAP, 64) for kind in matmul.CONFIG}
assert supported(torch.zeros(2, 8, dtype=torch.bfloat16)) and not supported(torch.zeros(1, 8, dtype=torch.bfloat16))
assert not supported(torch.zeros(FEW_ROWS + 1, 8, dtype=torch.bfloat16))
worst = 0.0
# (N, K, tokens): SmolLM2's wqkv, a ragged N and K (no block divides K), one block of rows and more
for n, k, m in ((960, 576, 5), (37, 200, 17), (100, 96, FEW_ROWS)):
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k).to(torch.bfloat16)
    cases = [("int8", quantize_int8(w)), ("fp8", quantize_fp8(w)), ("dense", {"weight": w.to(x.dtype)})]
    cases += [(f"int4-g{g}", quantize_int4(w, g, torch.bfloat16)) for g in (32, 128) if k >= g]
    if k % 32 == 0:  # GGUF Q8_0: an fp16 scale per 32 inputs
        q8 = quantize_int8(w, 32)
        cases.append(("q8_0", {"int8": q8["int8"], "scale": q8["scale"].half()}))
    for name, parts in cases:
        ref = x.double() @ (parts["weight"] if name == "dense" else dequantize(parts))[:, :k].double().t()
        if name == "dense":
            y = few_rows_matmul(x, parts["weight"])
        elif "int4" in parts:
            xp = F.pad(x, (0, 2 * parts["int4"].shape[1] - k))
            y = few_rows_matmul(xp, parts["int4"], parts["scale"].bfloat16(), parts["zero"].bfloat16())
        elif name == "q8_0":
            y = few_rows_matmul(x, parts["int8"], parts["scale"])
        else:
            y = few_rows_matmul(x, parts.get("int8", parts.get("fp8"))) * parts["scale"]
        assert y.shape == (m, n) and y.dtype == torch.float32
        err = ((y.double() - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
        assert err < 1e-6, (n, k, m, name, err)  # (the interpreter multiplies in fp32)
print("worst relative error", worst)
"""


INT4_INT8_CHILD = r"""
import torch
from brisklm.kernels.matmul import int4_int8_matmul, int8_rows
from brisklm.quantize import dequantize, quantize_int4
torch.manual_seed(0)
# (N, K, tokens, group): a ragged N, groups of 64 and 128, one block of rows and more
for n, k, m, g in ((96, 256, 5, 128), (37, 512, 17, 64), (200, 384, 3, 128)):
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k).to(torch.bfloat16)
    q = quantize_int4(w, g, torch.bfloat16)
    s, z = q["scale"].bfloat16(), q["zero"].bfloat16()
    y = int4_int8_matmul(x, q["int4"], s, z, block_n=32, programs=8)
    even, odd, scale, sums = int8_rows(x, g)
    codes = torch.stack([even, odd], -1).reshape(m, k)
    assert torch.equal(sums, codes.view(m, -1, g).double().sum(-1).float())
    wd = dequantize({"int4": q["int4"], "scale": s, "zero": z})[:, :k].double()
    exact = (codes.double() * scale.double().repeat_interleave(g, 1)) @ wd.t()  # x as the kernel reads it
    err = ((y.double() - exact).norm() / exact.norm()).item()
    assert err < 1e-6, (n, k, m, g, err)
    ref = x.double() @ wd.t()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2  # (x's int8 rounding: ~6e-3)
print("int4 int8 ok")
"""


@pytest.mark.slow
def test_int4_codes_times_int8_rows_match_fp64():
    assert "int4 int8 ok" in run_interpreted(INT4_INT8_CHILD)


def run_interpreted(code: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_gemv_kernels_match_fp64_at_smollm2_and_ragged_shapes():
    out = run_interpreted(f"SHAPES = {SHAPES!r}\n" + CHILD)
    assert "worst relative error" in out


@pytest.mark.slow
@pytest.mark.parametrize("swap", [False, True])
def test_few_rows_matmul_matches_fp64_for_every_format(swap):
    assert "worst relative error" in run_interpreted(FEW_ROWS_CHILD.replace("SWAP_SETTING", str(swap)))


@pytest.mark.slow
def test_quantized_model_through_the_kernels_matches_its_dequantized_weights():
    out = run_interpreted(MODEL_CHILD)
    assert out.split() == (["int8", "ok", "fp8", "ok", "int4", "ok"] * 2 + ["moe", "int8", "ok", "moe", "int4", "ok"]
                           + ["in", "place", "int8", "ok", "in", "place", "int4", "ok", "in", "place", "bf16", "ok"])


ATTENTION_CHILD = r"""
import copy, math, torch
from brisklm.kernels.attention import decode_attention, num_splits
from brisklm.model import KVCache, apply_rope
torch.manual_seed(0)
# (query heads, KV heads, head dim, cache length, dtype, int8 cache): groups of
# 1, 3 (SmolLM2) and 4 (Llama-3); one slice and several (num_splits).
CASES = [(8, 2, 64, 200, torch.float32, False), (9, 3, 64, 300, torch.bfloat16, False),
         (8, 2, 128, 3000, torch.bfloat16, False), (8, 2, 128, 700, torch.bfloat16, True),
         (4, 4, 32, 100, torch.float32, True)]
assert {num_splits(c[3]) for c in CASES} == {1, 2, 4, 16}
WINDOWS = [(8, 2, 128, 3000, torch.bfloat16, False, 100), (4, 4, 32, 300, torch.float32, True, 1),
           (9, 3, 64, 300, torch.float32, False, 70)]  # sliding windows
CASES = [c + (None,) for c in CASES] + WINDOWS
for h, hkv, d, S, dtype, int8, window in CASES:
    cache = KVCache(1, hkv, S, d, dtype, "cpu", int8)
    cache.write(torch.arange(S), torch.randn(1, hkv, S, d).to(dtype), torch.randn(1, hkv, S, d).to(dtype))
    for pos in (0, 1, 63, 64, S // 2 + 3, S - 1):
        qkv = torch.randn((h + 2 * hkv) * d).to(dtype)
        angles = pos * torch.rand(d // 2)
        cos, sin = angles.cos(), angles.sin()
        # the reference: the model's own RoPE and cache write, then attention in fp64
        ref = copy.deepcopy(cache)
        q, k, v = (t.view(1, 1, -1, d).transpose(1, 2) for t in qkv.split([h * d, hkv * d, hkv * d]))
        q, k = apply_rope(q, cos[None], sin[None]), apply_rope(k, cos[None], sin[None])
        ref.write(torch.tensor([pos]), k, v)
        ip = torch.tensor([pos])
        scales = (cache.k_scale, cache.v_scale) if int8 else ()
        y = decode_attention(qkv, cos, sin, cache.k, cache.v, ip, *scales, window=window)
        assert y.shape == (1, 1, h * d) and y.dtype == dtype
        for name in ("k", "v") + (("k_scale", "v_scale") if int8 else ()):  # the new token, stored
            codes = getattr(cache, name).dtype == torch.int8
            a, b = getattr(cache, name).double(), getattr(ref, name).double()
            if dtype == torch.float32:
                assert torch.equal(a, b), (name, pos)
            elif codes:  # codes of keys that may differ by one bf16 rounding
                assert (a - b).abs().max() <= 1, (name, pos)
            else:  # the interpreter rounds fp32 to bf16 toward zero: the scales of
                # truncated keys, truncated again, are up to two bf16 steps apart
                assert ((a - b).abs() <= b.abs() * 2 ** -6).all(), (name, pos)
        # attention over what the kernel stored (checked against the model's write above)
        lo = max(0, pos + 1 - window) if window else 0
        ks, vs = ((getattr(cache, n)[:, :, lo:pos + 1].double()
                   * (getattr(cache, n + "_scale")[:, :, lo:pos + 1].double() if int8 else 1)) for n in ("k", "v"))
        kk, vv = (t[0].repeat_interleave(h // hkv, 0) for t in (ks, vs))
        expect = torch.softmax(q.double()[0] @ kk.transpose(1, 2) / math.sqrt(d), -1) @ vv  # (H, 1, D)
        err = ((y.double().view(h, 1, d) - expect).norm() / expect.norm()).item()
        # fp32 to rounding. bf16: the interpreter truncates to bf16 (the GPU rounds
        # to nearest: 2.3e-3 there, benchmarks/attention_check.py), so the roped
        # query and the output are each up to 2^-7 off.
        assert err < (1e-6 if dtype == torch.float32 else 8e-3), (h, hkv, d, S, int8, pos, err)
print("attention ok")
"""

ROWS_CHILD = r"""
import copy, math, torch
from brisklm.kernels.attention import decode_attention, num_splits
from brisklm.model import KVCache, apply_rope
torch.manual_seed(0)
# A few new tokens at once (a speculative verify step): (query heads, KV heads,
# head dim, cache length, dtype, int8 cache, window, tokens). Groups of 1, 3, 4
# and 8 (two chunks of query rows at 9 tokens), one slice and several, windows
# shorter than the tokens (a row sees fewer keys than the one before it).
CASES = [(8, 2, 64, 200, torch.float32, False, None, 5), (9, 3, 64, 300, torch.float32, False, None, 16),
         (16, 2, 32, 700, torch.float32, False, None, 9), (8, 2, 128, 3000, torch.bfloat16, False, None, 5),
         (8, 2, 64, 700, torch.float32, True, None, 4), (4, 4, 32, 300, torch.float32, True, 3, 6),
         (8, 2, 64, 3000, torch.float32, False, 100, 9), (4, 1, 32, 100, torch.float32, False, 2, 2)]
assert {num_splits(c[3]) for c in CASES} == {1, 2, 4, 16}
for h, hkv, d, S, dtype, int8, window, T in CASES:
    cache = KVCache(1, hkv, S, d, dtype, "cpu", int8)
    cache.write(torch.arange(S), torch.randn(1, hkv, S, d).to(dtype), torch.randn(1, hkv, S, d).to(dtype))
    for pos in (0, 1, 60, S // 2 + 3, S - T):
        qkv = torch.randn(T, (h + 2 * hkv) * d).to(dtype)
        angles = (pos + torch.arange(T))[:, None] * torch.rand(d // 2)
        cos, sin = angles.cos(), angles.sin()
        ref = copy.deepcopy(cache)
        q, k, v = (t.view(1, T, -1, d).transpose(1, 2) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ref.write(torch.arange(pos, pos + T), k, v)
        scales = (cache.k_scale, cache.v_scale) if int8 else ()
        y = decode_attention(qkv, cos, sin, cache.k, cache.v, torch.tensor([pos]), *scales, window=window)
        assert y.shape == (1, T, h * d) and y.dtype == dtype
        for name in ("k", "v") + (("k_scale", "v_scale") if int8 else ()):  # the new tokens, stored
            a, b = getattr(cache, name).double(), getattr(ref, name).double()
            if dtype == torch.float32:
                assert torch.equal(a, b), (name, pos)
            else:  # (the interpreter truncates to bf16: see ATTENTION_CHILD)
                assert ((a - b).abs() <= b.abs() * 2 ** -6).all(), (name, pos)
        # each token over what the kernel stored, up to its own position, in fp64
        ks, vs = ((getattr(cache, n)[0].double() * (getattr(cache, n + "_scale")[0].double() if int8 else 1))
                  for n in ("k", "v"))
        kk, vv = (t.repeat_interleave(h // hkv, 0) for t in (ks, vs))  # (H, S, D)
        keys, at = torch.arange(S), pos + torch.arange(T)
        seen = (keys[None, :] <= at[:, None]) & (keys[None, :] > at[:, None] - (window or S + 1))  # (T, S)
        scores = (q.double()[0] @ kk.transpose(1, 2) / math.sqrt(d)).masked_fill(~seen, float("-inf"))
        expect = torch.softmax(scores, -1) @ vv  # (H, T, D)
        got = y.double().view(T, h, d).transpose(0, 1)
        err = ((got - expect).norm() / expect.norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 8e-3), (h, hkv, d, S, int8, window, T, pos, err)
print("rows ok")
"""


@pytest.mark.slow
def test_attention_kernel_over_a_few_new_tokens_matches_fp64():
    assert "rows ok" in run_interpreted(ROWS_CHILD)


MODEL_ATTENTION_CHILD = r"""
import torch
from brisklm.fusion import FusedAttention, fuse_for_decode
from brisklm.model import ModelArgs, build_model, random_state_dict
# SmolLM3: a layer without RoPE takes the identity rotation. Gemma 3's shape:
# a sliding layer (own RoPE base) and a global one, norms as (1 + w) folded
# into the Linear after them, GeGLU, scaled embeddings, q/k norms before the
# kernel and its own query scale. Qwen3: q/k norms. Partial rotary: RoPE's
# tables padded with the identity.
torch.manual_seed(0)
GEMMA = dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=1e4,
             rope_theta=1e6, hidden_act="gelu_pytorch_tanh", embed_scale=11.3, norm_offset=1.0, sandwich_norms=True,
             qk_norm=True, query_pre_attn_scalar=24)
for no_rope, extra in ((None, {}), ([1, 0], {}), (None, GEMMA), (None, dict(qk_norm=True)),
                       (None, dict(partial_rotary_factor=0.5))):  # (Phi-4-mini: RoPE on part of a head)
    args = ModelArgs(vocab_size=61, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, no_rope_layers=no_rope, **extra)  # head_dim 32
    state = random_state_dict(args, torch.float32, std=0.1)
    for name in state:  # (norm weights away from 1 - offset, so a misplaced offset shows)
        if name.endswith("norm.weight"):
            state[name] = state[name] + torch.rand(state[name].shape) * 0.5
    fused, plain = fuse_for_decode(build_model(args, state)), build_model(args, state)
    assert isinstance(fused.layers[1].attention, FusedAttention) and not plain.decode_kernels
    for kv_int8 in (False, True):
        outputs = []
        for model in (fused, plain):
            model.setup_caches(1, 300, kv_int8)  # two slices
            with torch.no_grad():
                logits = [model(torch.tensor([[1, 5, 9, 3, 7]]), torch.arange(5))]  # (a few tokens at once)
                for pos, token in zip(range(5, 9), (2, 8, 4, 6)):  # decode: one token at a time
                    logits.append(model(torch.tensor([[token]]), torch.tensor([pos]), kv_len=pos + 1))
            outputs.append(torch.cat(logits, 1))
        err = ((outputs[0] - outputs[1]).norm() / outputs[1].norm()).item()
        assert err < 1e-5, (no_rope, kv_int8, err)
print("model ok")
"""


@pytest.mark.slow
def test_decode_attention_kernel_matches_fp64():
    assert "attention ok" in run_interpreted(ATTENTION_CHILD)


@pytest.mark.slow
def test_model_decodes_the_same_through_the_attention_kernel():
    assert "model ok" in run_interpreted(MODEL_ATTENTION_CHILD)


OPS_CHILD = r"""
import torch
from brisklm.kernels import attention, gemv
from brisklm.model import KVCache
from brisklm.quantize import quantize_fp8, quantize_int4, quantize_int8
# The custom ops that compiled CUDA steps call: schema, fake (shape-only)
# implementation against the real one, and tracing by AOT autograd.
torch.manual_seed(0)
w = torch.randn(40, 64) * 0.02
x = torch.randn(64).to(torch.bfloat16)
q4 = quantize_int4(w, 32, torch.bfloat16)
w16, w8 = w.to(torch.bfloat16), quantize_int8(w)["int8"]
scale, zero = q4["scale"].bfloat16(), q4["zero"].bfloat16()
squares = x.float().square().reshape(4, 16).sum(1)  # an RMSNorm folded in (gemv.norm_parts)
cases = [(gemv._scaled_gemv_op, (x, w16, None, 0.0, list(gemv.scaled_config(w16)))),
         (gemv._scaled_gemv_op, (x, w16, squares, 1e-5, list(gemv.scaled_config(w16)))),
         (gemv._scaled_gemv_op, (x, w8, None, 0.0, list(gemv.scaled_config(w8)))),
         (gemv._grouped_gemv_op, (x, q4["int4"], scale, zero, list(gemv.grouped_config(q4["int4"], scale))))]
cases.append((gemv._int8_dp4a_op, (x, w8, list(gemv.int8_dp4a_config(w8)))))
cases.append((gemv._int4_dp4a_op, (x, q4["int4"], scale, zero, list(gemv.int4_dp4a_config(q4["int4"], scale)))))
packed = gemv.pack_x(x, 32, torch.rand(64) + 0.5)  # an RMSNorm's input and weight
cases.append((gemv._int4_packed_op, (*packed, 1e-5, q4["int4"], scale, zero,
                                     list(gemv.int4_dp4a_config(q4["int4"], scale)))))
q8 = quantize_int8(w, 32)  # GGUF Q8_0: a scale per 32 inputs
cases.append((gemv._int8_group_dp4a_op, (x, q8["int8"], q8["scale"].half(), list(gemv.config("8gd", 40, 64, 32)))))
wf8 = quantize_fp8(w)["fp8"]
assert gemv.uses_fp8_half(x, wf8)
for int8, tokens in ((False, 1), (True, 1), (False, 3), (True, 3)):  # (one new token, and a few)
    cache = KVCache(1, 2, 48, 32, torch.bfloat16, "cpu", int8)
    qkv = torch.randn(tokens, (4 + 2 * 2) * 32).to(torch.bfloat16)
    cos, sin = torch.rand(tokens, 16), torch.rand(tokens, 16)
    pos = torch.tensor([7])
    norm = (torch.rand(32).bfloat16(), torch.rand(32).bfloat16(), 1e-6, 1.0) if tokens == 3 else (None, None, 0.0, 0.0)
    if int8:
        cases.append((attention._decode_attention_int8_op,
                      (qkv, cos, sin, cache.k, cache.v, cache.k_scale, cache.v_scale, pos, 0, 0.0, *norm)))
    else:
        cases.append((attention._decode_attention_op, (qkv, cos, sin, cache.k, cache.v, pos, 0, 0.125, *norm)))
for op, args in cases:
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
# (opcheck's schema test multiplies the inputs, which CPUs cannot do in fp8)
torch.library.opcheck(gemv._fp8_half_op, (x, wf8, list(gemv.config("8f", 40, 64))),
                      test_utils=("test_faketensor", "test_aot_dispatch_static"))
print("ops ok", len(cases) + 1)
"""


@pytest.mark.slow
def test_custom_ops_fake_implementations_and_schemas():
    assert "ops ok 13" in run_interpreted(OPS_CHILD)


QK_NORM_CHILD = r"""
import torch
from brisklm.kernels import attention
from brisklm.model import KVCache, RMSNorm
# The per-head q/k norms inside the attention kernel against model.RMSNorm
# applied to qkv first: the output and the keys it stores, one token and a
# few, the cache in the model's dtype and in int8, norms as w and as Gemma's
# 1 + w. fp32 to 1e-5; bf16 within its rounding (the interpreter truncates
# where a GPU rounds to nearest, so not bit for bit here).
torch.manual_seed(0)
H, HKV, D = 4, 2, 32
for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):
    for offset in (0.0, 1.0):
        q_norm, k_norm = RMSNorm(D, 1e-6, offset).to(dtype), RMSNorm(D, 1e-6, offset).to(dtype)
        with torch.no_grad():
            q_norm.weight.copy_(torch.rand(D) + 0.5 - offset)
            k_norm.weight.copy_(torch.rand(D) + 0.5 - offset)
        for int8 in (False, True):
            for tokens in (1, 3):
                qkv = (torch.randn(tokens, (H + 2 * HKV) * D) * 3).to(dtype)
                cos, sin = torch.rand(tokens, D // 2), torch.rand(tokens, D // 2)
                q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
                with torch.no_grad():
                    normed = torch.cat([q_norm(q.reshape(tokens, H, D)).reshape(tokens, -1),
                                        k_norm(k.reshape(tokens, HKV, D)).reshape(tokens, -1), v], dim=-1)
                outs = []
                for x, norm in ((qkv, (q_norm.weight, k_norm.weight, 1e-6, offset)), (normed, attention.NO_NORM)):
                    cache = KVCache(1, HKV, 48, D, dtype, "cpu", int8)
                    scales = (cache.k_scale, cache.v_scale) if int8 else (None, None)
                    one = (lambda t: t[0]) if tokens == 1 else (lambda t: t)
                    y = attention.decode_attention(one(x), one(cos), one(sin), cache.k, cache.v, torch.tensor([5]),
                                                   *scales, qk_norm=norm)
                    keys = cache.k.float() * (cache.k_scale.float() if int8 else 1)
                    outs.append((y.float(), keys[:, :, 5:5 + tokens]))
                (y, keys), (y_ref, keys_ref) = outs
                where = (dtype, offset, int8, tokens)
                # (bf16: three truncations where the reference rounds, each up to one unit in the last place)
                assert (keys - keys_ref).abs().max() <= (4 if int8 else 2) * bound * keys_ref.abs().max(), where
                assert (y - y_ref).norm() / y_ref.norm() < 2 * bound, where
print("qk norms ok")
"""


@pytest.mark.slow
def test_attention_kernel_applies_the_q_k_norms_as_the_model_does():
    assert "qk norms ok" in run_interpreted(QK_NORM_CHILD)


def test_a_tuned_table_given_for_a_block_is_used_there_and_restored_after():
    from brisklm.kernels import gemv
    before = gemv.config(8, 4096, 4096)
    with gemv.tuned_table({"8:4096:4096": {"config": (8, 256, 2, 2)}}):
        assert gemv.config(8, 4096, 4096) == (8, 256, 2, 2)
        assert gemv.config(16, 1024, 4096) == gemv.DEFAULT_CONFIG[16]  # no width-16 entry: the default
    assert gemv.config(8, 4096, 4096) == before


def test_a_shape_not_measured_takes_the_nearest_measured_shapes_blocks_split_to_divide_k():
    from brisklm.kernels import gemv
    table = {"4d:4096:14336": {"config": (32, 512, 4, 4), "us": 12.4},
             "4d:28672:4096": {"config": (16, 1024, 1, 4), "us": 19.0},
             "16:4096:4096": {"config": (4, 512, 4, 4), "us": 9.5, "cublas_us": 12.2},
             "16:28672:4096": {"config": (2, 2048, 1, 4), "us": 55.0, "cublas_us": 54.8}}
    with gemv.tuned_table(table):
        assert gemv.config("4d", 4096, 12288, 128) == (32, 512, 4, 4)  # Qwen3-8B's w2
        assert gemv.config("4d", 5120, 17920, 128) == (32, 512, 5, 4)  # Phi-4's: 35 blocks, split 5
        assert gemv.config("4d", 24576, 4096, 128) == (16, 1024, 1, 4)  # Qwen3-8B's w13
        assert gemv.config("4d", 4096, 4100) == (32, 512, 1, 4)  # a ragged K: wide blocks, not split
        assert gemv.beats_dense(3840, 3840) and not gemv.beats_dense(24576, 4096)


@pytest.mark.compile
def test_gemv_blocks_are_a_constant_of_the_traced_graph():
    """The GEMV ops take their block sizes as an argument, looked up while
    tracing without a graph break: a cached graph records them, so a retuned
    table cannot meet a stale graph (whose split-K output shape differs)."""
    import torch

    from brisklm.kernels import gemv
    gemv._tuned = None  # the first lookup reads the table under the tracer
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm

    @torch.compile(backend=backend, fullgraph=True)
    def blocks(x, w):
        return x + gemv.scaled_config(w)[2]

    w = torch.zeros(4096, 14336, dtype=torch.bfloat16)
    assert blocks(torch.zeros(2), w).tolist() == [gemv.scaled_config(w)[2]] * 2
    assert len(graphs) == 1


def _f16(bits: int) -> float:
    import numpy as np
    return float(np.array(bits & 0xFFFF, dtype=np.uint16).view(np.float16))


def _f16_bits(v: float) -> int:
    import numpy as np
    return int(np.array(v, dtype=np.float16).view(np.uint16))  # rounded to nearest, ties to even


def _run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """A tiny interpreter of the PTX in the dp4a and fp8 kernels (and, shr,
    dp4a, mad; mov into halves, e4m3 and f16 conversions, f16x2 mul and fma,
    f32 add) on 32-bit register values, so the inline assembly that Triton's
    interpreter cannot run is checked here. f16x2 results are each half's
    exact value rounded once (exact in float64 at these magnitudes)."""
    import numpy as np
    import torch

    def value(a):
        return regs[a] if a in regs else int(a, 0)

    def halves(v):
        return _f16(v), _f16(v >> 16)

    def pack(lo, hi):
        return _f16_bits(lo) | _f16_bits(hi) << 16

    def e4m3(byte):
        return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())

    def lanes(v, signed):
        return [((v >> 8 * i & 255) ^ 128) - 128 if signed else v >> 8 * i & 255 for i in range(4)]

    def s32(v):
        return (v + 2**31) % 2**32 - 2**31

    for line in asm.splitlines():
        op, _, rest = line.strip().rstrip(";").partition(" ")
        args = [a.strip() for a in rest.split(",")]
        if op == "and.b32":
            regs[args[0]] = value(args[1]) & value(args[2])
        elif op == "shr.u32":
            regs[args[0]] = value(args[1]) % 2**32 >> value(args[2])
        elif op.startswith("dp4a."):
            a_type, b_type = op.split(".")[1:]
            dot = sum(p * q for p, q in zip(lanes(value(args[1]) % 2**32, a_type == "s32"),
                                            lanes(value(args[2]) % 2**32, b_type == "s32")))
            regs[args[0]] = s32(dot + value(args[3]))
        elif op == "mad.lo.s32":
            regs[args[0]] = s32(value(args[1]) * value(args[2]) + value(args[3]))
        elif op == "mov.b32" and args[0].startswith("{"):
            v = value(args[2]) % 2**32
            regs[args[0][1:]], regs[args[1][:-1]] = v & 0xFFFF, v >> 16
        elif op == "cvt.rn.f16x2.e4m3x2":  # the low byte into the low half
            v = value(args[1])
            regs[args[0]] = pack(e4m3(v & 255), e4m3(v >> 8 & 255))
        elif op in ("mul.rn.f16x2", "fma.rn.f16x2"):
            a, b = halves(value(args[1])), halves(value(args[2]))
            c = halves(value(args[3])) if op.startswith("fma") else (0.0, 0.0)
            regs[args[0]] = pack(*(p * q + r for p, q, r in zip(a, b, c)))
        elif op == "cvt.f32.f16":
            regs[args[0]] = _f16(value(args[1]))  # floats held as Python floats from here
        elif op == "add.f32":
            regs[args[0]] = float(np.float32(np.float32(regs[args[1]]) + np.float32(regs[args[2]])))
        else:
            assert op in ("{", "}", ".reg"), op
    return regs


def test_dp4a_ptx_matches_the_interpreted_integer_path():
    """The dp4a kernels' inline PTX against the integer ops that the
    interpreter runs instead (the codes' nibble order, signedness, and the
    merge of the hi and lo planes), on random words."""
    import torch

    from brisklm.kernels import gemv
    rng = torch.Generator().manual_seed(0)

    def words(n):
        return [int(v) for v in torch.randint(-2**31, 2**31, (n,), generator=rng, dtype=torch.int64)]

    def signed_bytes(v):
        return [((v >> 8 * i & 255) ^ 128) - 128 for i in range(4)]

    for _ in range(200):
        w, xe_hi, xo_hi, xe_lo, xo_lo = words(5)
        codes = [(w >> 8 * (k // 2) + 4 * (1 - k % 2)) & 15 for k in range(8)]  # byte j: k = 2j high, 2j + 1 low
        x_hi = [v for pair in zip(signed_bytes(xe_hi), signed_bytes(xo_hi)) for v in pair]  # k = 0..7
        x_lo = [v for pair in zip(signed_bytes(xe_lo), signed_bytes(xo_lo)) for v in pair]
        want = sum(map(int.__mul__, codes, x_hi)) * gemv.X_LO + sum(map(int.__mul__, codes, x_lo))
        regs = _run_ptx(gemv.DP4A_INT4.value, {"$1": w, "$2": xe_hi, "$3": xo_hi, "$4": xe_lo, "$5": xo_lo})
        assert regs["$0"] == want
        want = sum(map(int.__mul__, signed_bytes(w), signed_bytes(xe_hi))) * gemv.X_LO \
            + sum(map(int.__mul__, signed_bytes(w), signed_bytes(xe_lo)))
        assert _run_ptx(gemv.DP4A_INT8.value, {"$1": w, "$2": xe_hi, "$3": xe_lo})["$0"] == want


def test_fp8_half_ptx_matches_fp16_arithmetic():
    """The fp8 kernel's PTX (gemv.FP8_HALF): 16 e4m3 codes (four words, the
    low byte first) times x as eight f16x2 pairs (input 2m in the low half):
    against the same sums done lane by lane in numpy's fp16 (inputs 2m in
    one lane, 2m + 1 in the other, each product added and rounded in turn),
    and within fp16's rounding of the exact dot product."""
    import numpy as np
    import torch

    from brisklm.kernels import gemv
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        codes = torch.randint(0, 256, (16,), generator=rng, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes (quantize_fp8 writes none)
        w = codes.view(torch.float8_e4m3fn).double().tolist()
        x = (torch.rand(16, generator=rng, dtype=torch.float64) * 16 - 8).half().double().tolist()
        words = [int(v) for v in codes.view(torch.int32)]
        pairs = [_f16_bits(x[2 * m]) | _f16_bits(x[2 * m + 1]) << 16 for m in range(8)]
        regs = {f"${1 + j}": words[j] for j in range(4)} | {f"${5 + m}": pairs[m] for m in range(8)}
        got = _run_ptx(gemv.FP8_HALF.value, regs)["$0"]
        lanes = [np.float16(0), np.float16(0)]
        for k in range(16):
            lanes[k % 2] = np.float16(float(lanes[k % 2]) + w[k] * x[k])
        assert got == float(np.float32(np.float32(lanes[0]) + np.float32(lanes[1])))
        exact = sum(a * b for a, b in zip(w, x))
        assert abs(got - exact) <= 16 * 2.0**-11 * sum(abs(a * b) for a, b in zip(w, x)) + 1e-6


REPRESENTATION_CHILD = r"""
import torch
from brisklm.kernels import gemv
from brisklm.quantize import pack_int4
# Weights that pick one input per row (the identity): each output is x as the
# dp4a kernels represent it, step (hi + lo / X_LO), which must be within
# step / (2 X_LO) of x (step: the block's largest |x| / 127).
torch.manual_seed(0)
k = 512
eye = torch.eye(k)
int8 = (eye * 127).to(torch.int8), torch.full((k,), 1 / 127)
for scale in (1e-6, 1.0, 3e4):
    x = (torch.randn(k) * torch.where(torch.rand(k) < 0.03, 50.0, 1.0) * scale).to(torch.bfloat16)
    xf = x.double()
    block = gemv.dp4a_block(k)
    step = xf.reshape(-1, block).abs().amax(1).repeat_interleave(block) / 127
    y = gemv.scaled_gemv(x, int8[0]).sum(0).double() * int8[1].double()
    err = ((y - xf).abs() / step).max().item()
    assert err <= 1 / (2 * gemv.X_LO) + 1e-5, ("int8", scale, err)
    for group in (32, 128):
        codes = pack_int4((4 * eye).to(torch.uint8))  # (q - 8) s + z with z = 8 s: 1 and 0 exactly
        s = torch.full((k, k // group), 0.25, dtype=torch.bfloat16)
        y = gemv.int4_gemv(x, codes, s, s * 8).sum(0).double()
        step = (xf.reshape(-1, group).abs().amax(1) / 127).repeat_interleave(group)
        err = ((y - xf).abs() / step).max().item()
        assert err <= 1 / (2 * gemv.X_LO) + 1e-5, ("int4", group, scale, err)
print("represented ok")
"""


NORM_CHILD = r"""
import torch
from brisklm.fusion import fuse_for_decode
from brisklm.kernels import gemv
from brisklm.model import ModelArgs, RMSNorm, build_model, random_state_dict
from brisklm.quantize import dequantize, quantize_int4, quantize_state_dict, quantized_entries
# The int4 GEMV given the RMSNorm before it (gemv.pack_x): W norm(x) against
# fp64, at SmolLM2's wqkv and w2 input sizes (576 inputs: 18 groups of 32, a
# partial block of sums of squares) and a Llama-3.1-8B-like 4096, a few
# outputs each (the norm is over the inputs); against the same GEMV of
# norm(x) rounded to bf16, the path it replaces. At 1536, Gemma's norm, (1 + w).
torch.manual_seed(0)
worst = worst_bf16 = 0.0
for n, k, offset in ((96, 576, 0.0), (64, 1536, 1.0), (64, 4096, 0.0)):
    w = torch.randn(n, k) * 0.02
    norm = RMSNorm(k, 1e-5, offset).to(torch.bfloat16)  # as in a bf16 model
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k) + 0.5 - offset)
    for scale in (1e-3, 1.0, 40.0):
        x = (torch.randn(k) * scale).to(torch.bfloat16)
        xd = x.double()
        normed = xd * torch.rsqrt(xd.square().mean() + norm.eps) * (offset + norm.weight.double())
        for group in (32, 64, 128):
            if k % group:
                continue
            parts = quantize_int4(w, group, torch.bfloat16)
            s, z = parts["scale"].bfloat16(), parts["zero"].bfloat16()
            ref = dequantize(parts).double() @ normed
            error = lambda y: ((y.sum(0).double() - ref).norm() / ref.norm()).item()  # noqa: E731
            folded, rounded = error(gemv.int4_gemv(x, parts["int4"], s, z, norm)), \
                error(gemv.int4_gemv(norm(x), parts["int4"], s, z))
            # x's planes hold x g within step / 508 a group; with the group sums
            # of x g itself (pack_x) that error counts up to ~2.7x. bf16's two
            # roundings of norm(x) cost more than ten times that.
            assert folded < 3e-4 and folded < rounded / 5, (n, k, scale, group, folded, rounded)
            worst = max(worst, folded)
# The bf16 GEMV given the norm (gemv.norm_parts): x g rounded to bf16 once,
# the sums scaled by 1/rms from sums of squares per 256 inputs (576: one
# group; 768: three, a partial block of N_SQ), against fp64 and against the
# same GEMV of norm(x), which bf16 rounds twice (x / rms, then times g). At
# 768, Gemma's (1 + w), which norm(x) computes in fp32 and rounds once.
for n, k, offset in ((96, 576, 0.0), (40, 768, 1.0), (64, 4096, 0.0)):
    w = (torch.randn(n, k) * 0.02).bfloat16()
    norm = RMSNorm(k, 1e-5, offset).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k) + 0.5 - offset)
    for scale in (1e-3, 1.0, 40.0):
        x = (torch.randn(k) * scale).to(torch.bfloat16)
        xd = x.double()
        ref = w.double() @ (xd * torch.rsqrt(xd.square().mean() + norm.eps) * (offset + norm.weight.double()))
        error = lambda y: ((y.sum(0).double() - ref).norm() / ref.norm()).item()  # noqa: E731
        folded, rounded = error(gemv.scaled_gemv(x, w, norm)), error(gemv.scaled_gemv(norm(x), w))
        # x g's rounding to bf16 (unit roundoff 2**-8 = 3.9e-3) dominates: up to
        # 2.4e-3, against up to 3.7e-3 for norm(x)'s two roundings (one for (1 + w))
        assert folded < 3e-3 and folded < (1.5 if offset else 1) * rounded, (n, k, scale, folded, rounded)
        worst_bf16 = max(worst_bf16, folded)
# A bf16 int4 model decoding one token through the kernels, every norm folded
# into the GEMV after it (the output layer is int8: the norm applied first),
# against the same model dequantized; and Gemma's norms, (1 + w), with norms
# after attention and the MLP as well (those stay: no GEMV follows them).
for extra in ({}, dict(norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_pytorch_tanh")):
    args = ModelArgs(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, **extra)
    state = random_state_dict(args, torch.float32, std=0.1)
    for name in state:  # (norm weights away from 1 - offset, so a misplaced offset shows)
        if name.endswith("norm.weight"):
            state[name] = state[name] + torch.rand(state[name].shape) * 0.5
    qargs, qstate = quantize_state_dict(args, state, "int4", 32)
    qstate = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in qstate.items()}
    dense = {}
    for n, t in qstate.items():
        base, _, suffix = n.rpartition("_")
        if suffix in ("int4", "int8"):
            dense[base] = dequantize(quantized_entries(qstate, base)).to(torch.bfloat16)
        elif suffix not in ("scale", "zero"):
            dense[n] = t
    models = [fuse_for_decode(build_model(qargs, qstate)), build_model(qargs, dense)]
    assert models[0].layers[0].attention.wqkv.norm is not None  # the norm moved into the Linear after it
    for m in models:
        m.setup_caches(1, 16)
    with torch.no_grad():
        logits = [m(torch.tensor([[3]]), torch.tensor([0]), kv_len=1) for m in models]
    assert logits[0].dtype == torch.float32
    err = ((logits[0] - logits[1]).norm() / logits[1].norm()).item()
    assert err < 2e-2, (extra, err)  # bf16 activations, two layers
print("norm ok", worst, worst_bf16)
"""


@pytest.mark.slow
def test_int4_gemv_applies_the_norm_before_it():
    """int4: the norm's weight folded into x's planes, its 1/rms into the sums;
    bf16: its weight into x, its 1/rms into the sums."""
    assert "norm ok" in run_interpreted(NORM_CHILD)


@pytest.mark.slow
def test_dp4a_kernels_represent_x_within_their_bound():
    """x's int8 planes inside the dp4a kernels hold x within step / 508 per
    block of inputs, at any scale and with outliers, read through identity
    weights (int8, and int4 with its nibble order and zero term)."""
    assert "represented ok" in run_interpreted(REPRESENTATION_CHILD)


def test_fusion_fuses_q_k_normed_attention(monkeypatch):
    """A model with q/k norms (Qwen3, Gemma 3) takes the decode attention kernel
    too: the norms are applied to its projections first (the kernel's own
    numbers against the plain model: MODEL_ATTENTION_CHILD)."""
    import torch
    from brisklm import fusion
    from brisklm.model import ModelArgs, build_model, random_state_dict
    monkeypatch.setattr(fusion.gemv, "available", lambda device: True)  # as on an NVIDIA GPU
    monkeypatch.setattr(fusion.attention_kernel, "supported", lambda *a: True)
    for qk_norm in (False, True):
        args = ModelArgs(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, qk_norm=qk_norm)
        model = fusion.fuse_for_decode(build_model(args, random_state_dict(args, torch.float32)))
        assert isinstance(model.layers[0].attention, fusion.FusedAttention) and model.decode_kernels["attention"]
        assert hasattr(model.layers[0].attention, "q_norm") == qk_norm
        assert isinstance(model.layers[1].feed_forward.w13, fusion.FusedLinear)
