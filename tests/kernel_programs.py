"""The Triton kernels' checks that tests/test_kernels.py runs under Triton's
interpreter on the CPU: the same kernel source the GPU compiles, against fp64
references and against the plain model. Triton picks its interpreter when it
is imported, so these run in a child process with TRITON_INTERPRET=1, all the
selected ones in one:

    TRITON_INTERPRET=1 python tests/kernel_programs.py OUT.json '[["program", {"arg": value}], ...]'

Each program is named for its test (test_NAME runs NAME), raises on a failed
check and returns what it checked; OUT.json gets, for each, that value or the
traceback."""
import contextlib
import copy
import json
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from brisklm.fusion import FusedAttention, FusedLinear, fuse_for_decode
from brisklm.kernels import attention, gemv, matmul
from brisklm.model import KVCache, ModelArgs, RMSNorm, apply_rope, build_model, random_state_dict
from brisklm.quantize import (FORMATS, dequantize, pack_int4, quantize_fp8, quantize_int4, quantize_int8,
                              quantize_state_dict, quantized_entries)

# (N, K): SmolLM2-135M's wqkv and w2 (its wo and w13 differ only in N), and
# ragged shapes (N not a multiple of the row block, K of no block; int4 pads K).
GEMV_SHAPES = [(96, 576), (64, 1536), (37, 200), (5, 96)]  # SmolLM2's K (576, 1536), some of its rows
TINY = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def relative_error(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


@contextlib.contextmanager
def counted(module, name):
    """module.name wrapped to count its calls (one list entry a call: its keyword arguments), restored after."""
    calls, original = [], getattr(module, name)
    setattr(module, name, lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    try:
        yield calls
    finally:
        setattr(module, name, original)


def dequantized(qstate, dtype=None):
    """A quantized state dict's weights dequantized, as a dense model holds them."""
    dense = {}
    for name, t in qstate.items():
        base, _, suffix = name.rpartition("_")
        if suffix in ("int4", "int8", "fp8"):
            w = dequantize(quantized_entries(qstate, base))
            dense[base] = w if dtype is None else w.to(dtype)
        elif suffix not in ("scale", "zero"):
            dense[name] = t
    return dense


# --- the GEMVs and the few-rows matmuls ----------------------------------------

def gemv_kernels_match_fp64_at_smollm2_and_ragged_shapes():
    assert gemv.available(torch.device("cpu"))
    torch.manual_seed(0)
    checked = []
    for n, k in GEMV_SHAPES:
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
            err = relative_error(y, ref)
            # int8 (Q8_0 too) and int4 with a bf16 x go through dp4a, x as int8 planes
            # within 1.6e-5 of each block's largest |x| (gemv._x_planes); the rest sums in fp32
            # (fp8 here too: the fp16 sums of its PTX are checked by test_fp8_half_ptx_...)
            assert err < (1e-4 if name.startswith(("int8", "int4")) else 1e-5), (n, k, name, err)
            checked.append(f"{n}x{k} {name}")
    return checked


def few_rows_matmul_matches_fp64_for_every_format(swap):
    """swap: the weight tile as the dot's first operand, or second. Every
    format through the widened tile (int4 goes through its words by default:
    int4_words_matmul_matches_fp64)."""
    torch.manual_seed(0)
    config, words = matmul.CONFIG, matmul.WORDS
    matmul.CONFIG, matmul.WORDS = {kind: (32, 64, 4, 2, swap, 64) for kind in config}, ()
    try:
        return _few_rows_cases()
    finally:
        matmul.CONFIG, matmul.WORDS = config, words


def _few_rows_cases():
    supported, few_rows, FEW_ROWS = matmul.supported, matmul.few_rows_matmul, matmul.FEW_ROWS
    assert supported(torch.zeros(2, 8, dtype=torch.bfloat16)) and not supported(torch.zeros(1, 8, dtype=torch.bfloat16))
    assert not supported(torch.zeros(FEW_ROWS + 1, 8, dtype=torch.bfloat16))
    checked = []
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
                y = few_rows(x, parts["weight"])
            elif "int4" in parts:
                xp = F.pad(x, (0, 2 * parts["int4"].shape[1] - k))
                y = few_rows(xp, parts["int4"], parts["scale"].bfloat16(), parts["zero"].bfloat16())
            elif name == "q8_0":
                y = few_rows(x, parts["int8"], parts["scale"])
            else:
                y = few_rows(x, parts.get("int8", parts.get("fp8"))) * parts["scale"]
            assert y.shape == (m, n) and y.dtype == torch.float32
            err = relative_error(y.double(), ref)
            assert err < 1e-6, (n, k, m, name, err)  # (the interpreter multiplies in fp32)
            checked.append(f"{n}x{k}x{m} {name}")
    for name in ("int8", "int4-g32"):
        checked.append(rows_for_each_block_of_outputs(name))
        checked.append(rows_counted_for_each_block(name))
    return checked


def rows_for_each_block_of_outputs(name, experts=3, n=48, k=128, m=5):
    """x (E, M, K) against codes of E blocks of N outputs stacked: each block
    meets its own rows (an MoE layer's w2, every expert in one launch). N = 48
    is no multiple of the tests' BLOCK_N of 32 (or WORDS' 64): the tile halves."""
    w = torch.randn(experts * n, k) * 0.02
    x = torch.randn(experts, m, k).to(torch.bfloat16)
    parts = quantize_int8(w) if name == "int8" else quantize_int4(w, int(name.split("-g")[1]), torch.bfloat16)
    dense = dequantize(parts).double()
    ref = torch.cat([x[e].double() @ dense[e * n:(e + 1) * n].t() for e in range(experts)], 1)
    if name == "int8":
        y = matmul.few_rows_matmul(x, parts["int8"]) * parts["scale"]
    else:
        y = matmul.few_rows_matmul(x, parts["int4"], parts["scale"].bfloat16(), parts["zero"].bfloat16())
    assert y.shape == (m, experts * n) and relative_error(y.double(), ref) < 5e-6, name
    try:
        codes = parts["int8" if name == "int8" else "int4"]
        matmul.few_rows_matmul(torch.zeros(5, m, k, dtype=x.dtype), codes, *([] if name == "int8" else
                                                                             [parts["scale"], parts["zero"]]))
        raise AssertionError("144 outputs taken in 5 blocks of rows")
    except ValueError as e:
        assert "144 outputs" in str(e), e
    return f"{name} rows for each of {experts} blocks"


def rows_counted_for_each_block(name, experts=3, n=48, k=128, m=40):
    """x (E, M, K) with counts[e] real rows in block e (an MoE layer's experts,
    each with its own tokens' rows): those match fp64, the rest are zeros,
    through a tile of rows past the count (none real: 0), one partly
    filled (5) and two whole (40, COUNTED_ROWS a tile)."""
    w = torch.randn(experts * n, k) * 0.02
    x = torch.randn(experts, m, k).to(torch.bfloat16)
    counts = torch.tensor([5, 0, 40])
    parts = quantize_int8(w) if name == "int8" else quantize_int4(w, int(name.split("-g")[1]), torch.bfloat16)
    dense = dequantize(parts).double()
    ref = torch.cat([x[e].double() @ dense[e * n:(e + 1) * n].t() for e in range(experts)], 1)
    for e, count in enumerate(counts.tolist()):
        ref[count:, e * n:(e + 1) * n] = 0
    if name == "int8":
        y = matmul.few_rows_matmul(x, parts["int8"], counts=counts) * parts["scale"]
    else:
        y = matmul.few_rows_matmul(x, parts["int4"], parts["scale"].bfloat16(), parts["zero"].bfloat16(), counts=counts)
    assert matmul.rows_and_split(m, n, 4, 16, 64, counted=True)[0] == matmul.COUNTED_ROWS < m
    assert y.shape == (m, experts * n) and relative_error(y.double(), ref) < 5e-6, name
    assert not y[5:, :n].any() and not y[:, n:2 * n].any(), name
    return f"{name} rows counted for each of {experts} blocks"


def int4_words_matmul_matches_fp64():
    """int4 codes read as int32 words times x in four pieces
    (matmul._int4_words_kernel), the weight tile first in the dot and second,
    through the copy engine and through pointers, against fp64; and the bits
    that make two codes of a word the dot's operands in place of a conversion
    (the kernel's lop3 on a GPU: (word & mask) | one, here in torch)."""
    torch.manual_seed(0)
    word = torch.tensor([0x76543210, -0x1234568], dtype=torch.int32)  # (nibbles 0-7; and a negative word)
    nibble = lambda w, bit: (w >> bit) & 15  # noqa: E731
    for dtype, mask, one, up in ((torch.bfloat16, 0x000F000F, 0x43004300, 0), (torch.float16, 0x00780078, 0x58005800, 3)):
        for sh in range(4):
            shifted = (word << up) if sh == 0 and up else word >> (4 * sh - up)
            pair = ((shifted & mask) | one).view(dtype)  # (low half first)
            expected = torch.stack([nibble(word, 4 * sh), nibble(word, 4 * sh + 16)], -1).flatten() + 128.0
            assert torch.equal(pair.double(), expected.double()), (dtype, sh)
    x = torch.arange(16.0)[None]
    assert matmul.x_pieces(x)[:, 0].tolist() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    checked, table = [], matmul.WORDS
    # (N, K, tokens, group): a ragged N, one block of rows and more, two groups a step and one
    for n, k, m, g in ((96, 256, 5, 32), (37, 512, 17, 128), (200, 384, matmul.FEW_ROWS, 64), (40, 192, 3, 64)):
        w = torch.randn(n, k) * 0.02
        parts = quantize_int4(w, g, torch.bfloat16)
        chosen = matmul.words_group(parts["int4"], parts["scale"], torch.zeros(1, k, dtype=torch.bfloat16))
        assert chosen == (g if g >= 64 else None)  # (groups of 32 keep the widened tile)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(m, k).to(dtype)
            scale, zero = parts["scale"].to(dtype), parts["zero"].to(dtype)
            ref = x.double() @ dequantize({**parts, "scale": scale, "zero": zero}).double().t()
            for swap, tma in ((False, True), (True, True), (True, False)) if g >= 64 else ():
                matmul.WORDS, matmul.TMA = (32, 2, 4, 2, swap, 64), tma
                try:
                    y = matmul.few_rows_matmul(x, parts["int4"], scale, zero)
                finally:
                    matmul.WORDS, matmul.TMA = table, True
                # (136 xs taken back from the fp32 dot: ~1e-6, where the widened tile gets ~1e-7)
                assert y.shape == (m, n) and relative_error(y.double(), ref) < 5e-6, (n, k, m, g, dtype, swap, tma)
        checked.append(f"{n}x{k}x{m} g{g}")
    matmul.WORDS = (64, 2, 4, 2, True, 64)
    try:
        checked.append(rows_for_each_block_of_outputs("int4-g64"))
        checked.append(rows_counted_for_each_block("int4-g64"))
    finally:
        matmul.WORDS = table
    # Compiled as a CUDA step runs it (the custom op, after a norm that inductor fuses): the same
    # sums. (x's sums per group made outside the kernel came from x before its rounding to bf16,
    # 136 times that rounding off: 1.7e-2 here.)
    n, k, g = 96, 256, 128
    parts = quantize_int4(torch.randn(n, k) * 0.02, g, torch.bfloat16)
    args = (torch.randn(5, k).to(torch.bfloat16), parts["int4"], parts["scale"].bfloat16(), parts["zero"].bfloat16())

    def normed_matmul(x, codes, scale, zero):
        return matmul.few_rows_matmul(F.rms_norm(x * 2, (k,)), codes, scale, zero)
    traced, matmul._traced = matmul._traced, lambda codes: torch.compiler.is_compiling()
    try:
        compiled = torch.compile(normed_matmul)(*args)
    finally:
        matmul._traced = traced
    assert relative_error(compiled, normed_matmul(*args)) < 1e-6
    checked.append("compiled")
    return checked


def dp4a_kernels_represent_x_within_their_bound():
    """Weights that pick one input per row (the identity): each output is x as the
    dp4a kernels represent it, step (hi + lo / X_LO), which must be within
    step / (2 X_LO) of x (step: the block's largest |x| / 127)."""
    torch.manual_seed(0)
    k = 512
    eye = torch.eye(k)
    int8 = (eye * 127).to(torch.int8), torch.full((k,), 1 / 127)
    worst = 0.0
    for scale in (1e-6, 1.0, 3e4):
        x = (torch.randn(k) * torch.where(torch.rand(k) < 0.03, 50.0, 1.0) * scale).to(torch.bfloat16)
        xf = x.double()
        block = gemv.dp4a_block(k)
        step = xf.reshape(-1, block).abs().amax(1).repeat_interleave(block) / 127
        y = gemv.scaled_gemv(x, int8[0]).sum(0).double() * int8[1].double()
        err = ((y - xf).abs() / step).max().item()
        assert err <= 1 / (2 * gemv.X_LO) + 1e-5, ("int8", scale, err)
        worst = max(worst, err)
        for group in (32, 128):
            codes = pack_int4((4 * eye).to(torch.uint8))  # (q - 8) s + z with z = 8 s: 1 and 0 exactly
            s = torch.full((k, k // group), 0.25, dtype=torch.bfloat16)
            y = gemv.int4_gemv(x, codes, s, s * 8).sum(0).double()
            step = (xf.reshape(-1, group).abs().amax(1) / 127).repeat_interleave(group)
            err = ((y - xf).abs() / step).max().item()
            assert err <= 1 / (2 * gemv.X_LO) + 1e-5, ("int4", group, scale, err)
            worst = max(worst, err)
    return worst


def int4_gemv_applies_the_norm_before_it():
    """The int4 GEMV given the RMSNorm before it (gemv.pack_x): W norm(x) against
    fp64, at SmolLM2's wqkv and w2 input sizes (576 inputs: 18 groups of 32, a
    partial block of sums of squares) and a Llama-3.1-8B-like 4096, a few
    outputs each (the norm is over the inputs); against the same GEMV of
    norm(x) rounded to bf16, the path it replaces. At 1536, Gemma's norm, (1 + w)."""
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
                folded = relative_error(gemv.int4_gemv(x, parts["int4"], s, z, norm).sum(0).double(), ref)
                rounded = relative_error(gemv.int4_gemv(norm(x), parts["int4"], s, z).sum(0).double(), ref)
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
            folded = relative_error(gemv.scaled_gemv(x, w, norm).sum(0).double(), ref)
            rounded = relative_error(gemv.scaled_gemv(norm(x), w).sum(0).double(), ref)
            # x g's rounding to bf16 (unit roundoff 2**-8 = 3.9e-3) dominates: up to
            # 2.4e-3, against up to 3.7e-3 for norm(x)'s two roundings (one for (1 + w))
            assert folded < 3e-3 and folded < (1.5 if offset else 1) * rounded, (n, k, scale, folded, rounded)
            worst_bf16 = max(worst_bf16, folded)
    # A bf16 int4 model decoding one token through the kernels, every norm folded
    # into the GEMV after it (the output layer is int8: the norm applied first),
    # against the same model dequantized; and Gemma's norms, (1 + w), with norms
    # after attention and the MLP as well (those stay: no GEMV follows them).
    for extra in ({}, dict(norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_pytorch_tanh")):
        args = ModelArgs(**TINY, **extra)
        state = random_state_dict(args, torch.float32, std=0.1)
        for name in state:  # (norm weights away from 1 - offset, so a misplaced offset shows)
            if name.endswith("norm.weight"):
                state[name] = state[name] + torch.rand(state[name].shape) * 0.5
        qargs, qstate = quantize_state_dict(args, state, "int4", 32)
        qstate = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in qstate.items()}
        models = [fuse_for_decode(build_model(qargs, qstate, FORMATS)), build_model(qargs, dequantized(qstate, torch.bfloat16), FORMATS)]
        assert models[0].layers[0].attention.wqkv.norm is not None  # the norm moved into the Linear after it
        for m in models:
            m.setup_caches(1, 16)
        with torch.no_grad():
            logits = [m(torch.tensor([[3]]), torch.tensor([0]), kv_len=1) for m in models]
        assert logits[0].dtype == torch.float32
        err = relative_error(logits[0], logits[1])
        assert err < 2e-2, (extra, err)  # bf16 activations, two layers
    return [worst, worst_bf16]


def quantized_model_through_the_kernels_matches_its_dequantized_weights():
    checked = []
    args = ModelArgs(**TINY, attention_bias=True)
    # fp32: prefill multiplies the widened weights; bf16: a few tokens go through kernels/matmul.py
    with counted(matmul, "few_rows_matmul") as calls:
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            state = random_state_dict(args, dtype, std=0.1)
            for mode, group in (("none", None), ("int8", None), ("fp8", None), ("int4", 32)):
                qargs, qstate = (args, state) if mode == "none" else quantize_state_dict(args, state, mode, group or 32)
                a, b = fuse_for_decode(build_model(qargs, qstate, FORMATS)), build_model(qargs, dequantized(qstate, dtype), FORMATS)
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
                        err = relative_error(la, lb)
                        assert err < tolerance, (dtype, mode, start, err)
                        ids = lb[:, -1:].argmax(-1)
                assert bool(calls) == (dtype == torch.bfloat16), (dtype, mode, len(calls))
                checked.append(f"{str(dtype)[6:]} {mode}")
    # An MoE model: each expert's Linears through the kernels, tokens grouped by
    # expert (eager) and each token's experts indexed on the device (by_slot).
    moe = ModelArgs(**{**args.to_dict(), "num_local_experts": 4, "num_experts_per_tok": 2, "attention_bias": False})
    for mode, group in (("int8", None), ("int4", 32)):
        qargs, qstate = quantize_state_dict(moe, random_state_dict(moe, torch.float32, std=0.1), mode, group or 32)
        a, b = fuse_for_decode(build_model(qargs, qstate, FORMATS)), build_model(qargs, dequantized(qstate), FORMATS)
        assert isinstance(a.layers[0].feed_forward.experts[3].w2, FusedLinear)
        for m in (a, b):
            m.setup_caches(1, 16)
            m.prepare()
        with torch.no_grad():
            la, lb = a(torch.tensor([[1, 5, 9, 3]]), torch.arange(4)), b(torch.tensor([[1, 5, 9, 3]]), torch.arange(4))
            ta, tb = (m(lb[:, -1:].argmax(-1), torch.tensor([4])) for m in (a, b))
            assert relative_error(ta, tb) < 1e-5, mode
            ffn, x = a.layers[1].feed_forward, torch.randn(1, 64)
            weights, chosen = ffn.route(x)
            assert torch.allclose(ffn.by_slot(x, weights, chosen), ffn.by_expert(x, weights, chosen), atol=1e-5)
        checked.append(f"moe {mode}")
    # bf16: one token's chosen experts read in place from the stacked weights (FusedLinear.expert_forward,
    # gemv.expert_gemv; Q8_0 has no such kernel and copies them out), against the experts' own modules (by_expert)
    with counted(gemv, "expert_gemv") as in_place:
        for mode in ("int8", "int4", "int4-g64", "q8_0", "bf16"):  # (int4 in groups of 64: its words, WORDS)
            state = random_state_dict(moe, torch.bfloat16, std=0.1)
            fmt, group = mode.split("-g") if "-g" in mode else (mode, 32)
            qargs, qstate = (moe, state) if mode == "bf16" else quantize_state_dict(moe, state, fmt, int(group))
            a = fuse_for_decode(build_model(qargs, qstate, FORMATS))
            a.setup_caches(1, 16)
            a.prepare()
            ffn = a.layers[1].feed_forward
            assert all(isinstance(m, FusedLinear) for m in (ffn.experts[0].w13, ffn.experts[0].w2))
            in_place.clear()
            with torch.no_grad():
                x = torch.randn(2, 64).bfloat16()  # (two rows: a verify step's)
                weights, chosen = ffn.route(x)
                got, want = ffn.by_slot(x, weights, chosen), ffn.by_expert(x, weights, chosen)
            # two rows, two experts each, two matrices each (int4-g64: w2's inputs padded to whole groups, copied)
            assert len(in_place) == {"q8_0": 0, "int4-g64": 4}.get(mode, 8), (mode, len(in_place))
            err = relative_error(got, want)
            assert err < 2e-2, (mode, err)
            checked.append(f"in place {mode}")
            # a short prompt's rows, each expert's tokens gathered into its own (FusedLinear.experts_forward):
            # w13 of all four in one launch, then w2 of all four in another, each reading its counted rows
            with torch.no_grad():
                x = torch.randn(8, 64).bfloat16()
                weights, chosen = ffn.route(x)
                want = ffn.by_expert(x, weights, chosen)
                with counted(matmul, "few_rows_matmul") as launches:
                    got = ffn.by_expert_rows(x, weights, chosen)
            # (bf16: both through cuBLAS)
            assert len(launches) == (0 if mode == "bf16" else 2), (mode, len(launches))
            err = relative_error(got, want)
            assert err < 2e-2, (mode, err)
            # a graph's padded prompt: its 5 padding rows count for no expert, so the kernels read 3 tokens' picks
            real = torch.arange(8) < 3
            with torch.no_grad(), counted(matmul, "few_rows_matmul") as launches:
                got = ffn.by_expert_rows(x, weights, chosen, real)[:3]
            assert all(int(kw["counts"].sum()) == 3 * ffn.top_k for kw in launches), mode
            err = relative_error(got, ffn.by_expert(x[:3], weights[:3], chosen[:3]))
            assert err < 2e-2, (mode, err)
            checked.append(f"every expert {mode}")
    return checked


# --- decode attention ------------------------------------------------------------

def decode_attention_kernel_matches_fp64():
    torch.manual_seed(0)
    # (query heads, KV heads, head dim, cache length, dtype, int8 cache): groups of
    # 1, 3 (SmolLM2) and 4 (Llama-3); one slice and several (num_splits).
    cases = [(8, 2, 64, 200, torch.float32, False), (9, 3, 64, 300, torch.bfloat16, False),
             (8, 2, 128, 3000, torch.bfloat16, False), (8, 2, 128, 700, torch.bfloat16, True),
             (4, 4, 32, 100, torch.float32, True)]
    assert {attention.num_splits(c[3]) for c in cases} == {1, 2, 4, 16}
    windows = [(8, 2, 128, 3000, torch.bfloat16, False, 100), (4, 4, 32, 300, torch.float32, True, 1),
               (9, 3, 64, 300, torch.float32, False, 70)]  # sliding windows
    checked = []
    for h, hkv, d, S, dtype, int8, window in [c + (None,) for c in cases] + windows:
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
            y = attention.decode_attention(qkv, cos, sin, cache.k, cache.v, ip, *scales, window=window)
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
            err = relative_error(y.double().view(h, 1, d), expect)
            # fp32 to rounding. bf16: the interpreter truncates to bf16 (the GPU rounds
            # to nearest: 2.3e-3 there, benchmarks/attention_check.py), so the roped
            # query and the output are each up to 2^-7 off.
            assert err < (1e-6 if dtype == torch.float32 else 8e-3), (h, hkv, d, S, int8, pos, err)
        checked.append(f"{h}/{hkv}x{d} S={S} {str(dtype)[6:]} int8={int8} window={window}")
    return checked


def attention_kernel_over_a_few_new_tokens_matches_fp64():
    torch.manual_seed(0)
    # A few new tokens at once (a speculative verify step, a short prompt): (query heads,
    # KV heads, head dim, cache length, dtype, int8 cache, window, tokens). Groups of 1,
    # 3, 4 and 8 (two chunks of query rows at 9 tokens, four at 64), one slice and
    # several, windows shorter than the tokens (a row sees fewer keys than the one before it).
    cases = [(8, 2, 64, 200, torch.float32, False, None, 5), (9, 3, 64, 300, torch.float32, False, None, 16),
             (16, 2, 32, 700, torch.float32, False, None, 9), (8, 2, 128, 3000, torch.bfloat16, False, None, 5),
             (8, 2, 64, 700, torch.float32, True, None, 4), (4, 4, 32, 300, torch.float32, True, 3, 6),
             (8, 2, 64, 3000, torch.float32, False, 100, 9), (4, 1, 32, 100, torch.float32, False, 2, 2),
             (16, 4, 32, 300, torch.float32, False, None, 64), (8, 2, 32, 700, torch.float32, True, 20, 32)]
    assert {attention.num_splits(c[3]) for c in cases} == {1, 2, 4, 16}
    checked = []
    for h, hkv, d, S, dtype, int8, window, T in cases:
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
            y = attention.decode_attention(qkv, cos, sin, cache.k, cache.v, torch.tensor([pos]), *scales, window=window)
            assert y.shape == (1, T, h * d) and y.dtype == dtype
            for name in ("k", "v") + (("k_scale", "v_scale") if int8 else ()):  # the new tokens, stored
                a, b = getattr(cache, name).double(), getattr(ref, name).double()
                if dtype == torch.float32:
                    assert torch.equal(a, b), (name, pos)
                else:  # (the interpreter truncates to bf16: see decode_attention_kernel_matches_fp64)
                    assert ((a - b).abs() <= b.abs() * 2 ** -6).all(), (name, pos)
            # each token over what the kernel stored, up to its own position, in fp64
            ks, vs = ((getattr(cache, n)[0].double() * (getattr(cache, n + "_scale")[0].double() if int8 else 1))
                      for n in ("k", "v"))
            kk, vv = (t.repeat_interleave(h // hkv, 0) for t in (ks, vs))  # (H, S, D)
            keys, at = torch.arange(S), pos + torch.arange(T)
            seen = (keys[None, :] <= at[:, None]) & (keys[None, :] > at[:, None] - (window or S + 1))  # (T, S)
            scores = (q.double()[0] @ kk.transpose(1, 2) / math.sqrt(d)).masked_fill(~seen, float("-inf"))
            expect = torch.softmax(scores, -1) @ vv  # (H, T, D)
            err = relative_error(y.double().view(T, h, d).transpose(0, 1), expect)
            assert err < (1e-6 if dtype == torch.float32 else 8e-3), (h, hkv, d, S, int8, window, T, pos, err)
        checked.append(f"{h}/{hkv}x{d} S={S} {str(dtype)[6:]} int8={int8} window={window} T={T}")
    return checked


def attention_kernel_applies_the_q_k_norms_as_the_model_does():
    """The per-head q/k norms inside the attention kernel against model.RMSNorm
    applied to qkv first: the output and the keys it stores, one token and a
    few, the cache in the model's dtype and in int8, norms as w and as Gemma's
    1 + w. fp32 to 1e-5; bf16 within its rounding (the interpreter truncates
    where a GPU rounds to nearest, so not bit for bit here)."""
    torch.manual_seed(0)
    H, HKV, D = 4, 2, 32
    checked = []
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
                        y = attention.decode_attention(one(x), one(cos), one(sin), cache.k, cache.v,
                                                       torch.tensor([5]), *scales, qk_norm=norm)
                        keys = cache.k.float() * (cache.k_scale.float() if int8 else 1)
                        outs.append((y.float(), keys[:, :, 5:5 + tokens]))
                    (y, keys), (y_ref, keys_ref) = outs
                    where = (str(dtype), offset, int8, tokens)
                    # (bf16: three truncations where the reference rounds, each up to one unit in the last place)
                    assert (keys - keys_ref).abs().max() <= (4 if int8 else 2) * bound * keys_ref.abs().max(), where
                    assert (y - y_ref).norm() / y_ref.norm() < 2 * bound, where
                    checked.append(" ".join(map(str, where)))
    return checked


def model_decodes_the_same_through_the_attention_kernel():
    """SmolLM3: a layer without RoPE takes the identity rotation. Gemma 3's shape:
    a sliding layer (own RoPE base) and a global one, norms as (1 + w) folded
    into the Linear after them, GeGLU, scaled embeddings, q/k norms before the
    kernel and its own query scale. Qwen3: q/k norms. Partial rotary: RoPE's
    tables padded with the identity."""
    torch.manual_seed(0)
    gemma = dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=1e4,
                 rope_theta=1e6, hidden_act="gelu_pytorch_tanh", embed_scale=11.3, norm_offset=1.0,
                 sandwich_norms=True, qk_norm=True, query_pre_attn_scalar=24)
    checked = []
    for label, no_rope, extra in (("llama", None, {}), ("smollm3", [1, 0], {}), ("gemma3", None, gemma),
                                  ("qwen3", None, dict(qk_norm=True)),
                                  ("phi4-mini", None, dict(partial_rotary_factor=0.5))):  # (RoPE on part of a head)
        args = ModelArgs(**{**TINY, "hidden_size": 128}, no_rope_layers=no_rope, **extra)  # head_dim 32
        state = random_state_dict(args, torch.float32, std=0.1)
        for name in state:  # (norm weights away from 1 - offset, so a misplaced offset shows)
            if name.endswith("norm.weight"):
                state[name] = state[name] + torch.rand(state[name].shape) * 0.5
        fused, plain = fuse_for_decode(build_model(args, state, FORMATS)), build_model(args, state, FORMATS)
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
            err = relative_error(outputs[0], outputs[1])
            assert err < 1e-5, (label, kv_int8, err)
            checked.append(f"{label} kv_int8={kv_int8}")
    return checked


# --- the custom ops ----------------------------------------------------------------

def custom_ops_fake_implementations_and_schemas():
    """The custom ops that compiled CUDA steps call: schema, fake (shape-only)
    implementation against the real one, and tracing by AOT autograd."""
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
    rows = torch.randn(3, 64).to(torch.bfloat16)  # (a verify step's few tokens: split-K partial sums)
    cases += [(matmul._few_rows_op, (rows, q4["int4"], scale, zero, None)),
              (matmul._few_rows_op, (rows, w8, None, None, None)),
              (matmul._few_rows_op, (rows, q8["int8"], q8["scale"].half(), None, None))]
    q64 = quantize_int4(w, 64, torch.bfloat16)  # (int4 in groups of 64: x in four pieces, codes as words)
    cases.append((matmul._words_op, (matmul.x_pieces(rows), q64["int4"], q64["scale"].bfloat16(),
                                     q64["zero"].bfloat16(), None)))
    experts_rows, counts = torch.randn(2, 3, 64).to(torch.bfloat16), torch.tensor([3, 1])  # (an MoE layer's)
    cases += [(matmul._few_rows_op, (experts_rows, w8[:32], None, None, counts)),
              (matmul._words_op, (matmul.x_pieces(experts_rows), q64["int4"][:32], q64["scale"][:32].bfloat16(),
                                  q64["zero"][:32].bfloat16(), counts))]
    wf8 = quantize_fp8(w)["fp8"]
    assert gemv.uses_fp8_half(x, wf8)
    for int8, tokens in ((False, 1), (True, 1), (False, 3), (True, 3)):  # (one new token, and a few)
        cache = KVCache(1, 2, 48, 32, torch.bfloat16, "cpu", int8)
        qkv = torch.randn(tokens, (4 + 2 * 2) * 32).to(torch.bfloat16)
        cos, sin = torch.rand(tokens, 16), torch.rand(tokens, 16)
        pos = torch.tensor([7])
        norm = ((torch.rand(32).bfloat16(), torch.rand(32).bfloat16(), 1e-6, 1.0) if tokens == 3
                else (None, None, 0.0, 0.0))
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
    return len(cases) + 1


def patch_language_once_a_launch() -> None:
    """Triton's interpreter patches triton.language again at every call of a
    jit helper inside a kernel (each program, each loop step): a fifth of the
    time here. The patch is the same each time, so within one launch each
    module set is patched once. (Its private names: where they are not, as
    in another triton version, nothing changes.)"""
    import inspect
    import triton.language as tl
    from triton.runtime import interpreter
    original, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None:
        return
    patched = set()  # (the module sets patched in the running launch)

    def patch_lang(fn):
        key = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        if key in patched:
            return scope_type()
        scope, restore = original(fn), None
        if not patched:  # (the launch's own patch, the one that is restored: the launch ends there)
            restore = scope.restore
            scope.restore = lambda: (patched.clear(), restore())
        patched.add(key)
        return scope
    interpreter._patch_lang = patch_lang


def main(out: str, calls: list) -> None:
    patch_language_once_a_launch()
    results = []
    for name, kwargs in calls:
        start = time.perf_counter()
        try:
            results.append({"value": globals()[name](**kwargs)})
        except Exception:
            results.append({"error": traceback.format_exc()})
        results[-1]["seconds"] = round(time.perf_counter() - start, 1)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
