"""A few tokens times quantized weights, in Triton (CUDA only): prefill of a
short prompt, and the verify step of speculative decoding.

At up to FEW_ROWS tokens a Linear still costs its weight's bytes, not its
arithmetic, so it should read the codes once, as the GEMVs do. The plain path
widens the whole matrix to the activation dtype first and then multiplies:
it writes and reads the weight again at two or four times its size (a
short prompt cost ten decode steps). Here each program loads a (BLOCK_N, BLOCK_K) tile of
codes, widens it in registers and multiplies it with the rows of x on the
tensor cores (tl.dot), accumulating in fp32; the slices of K (SPLIT_K) give
the GPU enough programs when N is small, and are summed by the caller. SWAP
puts the weight tile first in the dot and x second (the int8 kernel's choice).

Formats (quantize.py): int8 or fp8 (N, K) codes whose per-row scale the
caller applies; int8 with a scale per group (GGUF Q8_0); int4 (N, K/2) with
two codes a byte, even k in the high nibble, w = (q - 8) s + z per group;
dense weights (N, K), read as they are (unused where cuBLAS is faster).
The same launch runs under TRITON_INTERPRET=1 on CPU tensors (the tests).
"""
from __future__ import annotations

import torch

from . import interpreted
from .gemv import available, triton

FEW_ROWS = 64  # up to this many tokens, a quantized Linear on a GPU uses these kernels

ROW_SCALED, GROUPED_INT8, INT4, DENSE = 0, 1, 2, 3

if triton is not None:
    import triton.language as tl

    _ROW_SCALED, _INT4, _DENSE = tl.constexpr(ROW_SCALED), tl.constexpr(INT4), tl.constexpr(DENSE)

    @triton.jit
    def _few_rows_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_PER_SPLIT,
                         KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                         INTERPRET: tl.constexpr):
        pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        if SWAP:  # the weight tile as the dot's first operand (it can stay in registers), x^T second
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_first = split * K_PER_SPLIT
        for k0 in range(k_first, k_first + K_PER_SPLIT, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if KIND == _INT4:
                half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                pairs = tl.load(w_ptr + cols[:, None] * (K // 2) + half[None, :],
                                mask=col_ok[:, None] & (half[None, :] < K // 2), other=0,
                                eviction_policy="evict_first")
                codes = tl.join(pairs >> 4, pairs & 15).reshape(BLOCK_N, BLOCK_K)  # even k first
                w = codes.to(tl.float32) - 8.0
            elif KIND == _DENSE:
                w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0,
                            eviction_policy="evict_first")
            else:
                ok = col_ok[:, None] & k_ok[None, :]  # (no `other`: fp8 takes none)
                w = tl.where(ok, tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=ok,
                                         eviction_policy="evict_first").to(tl.float32), 0.0)
            if KIND != _ROW_SCALED and KIND != _DENSE:
                if GROUP >= BLOCK_K:  # the tile lies in one group: a scale per row
                    where = cols[:, None] * (K // GROUP) + k0 // GROUP
                    ok = col_ok[:, None]
                else:
                    where = cols[:, None] * (K // GROUP) + ks[None, :] // GROUP
                    ok = col_ok[:, None] & k_ok[None, :]
                w = w * tl.load(s_ptr + where, mask=ok, other=0.0).to(tl.float32)
                if KIND == _INT4:
                    w = w + tl.load(z_ptr + where, mask=ok, other=0.0).to(tl.float32)
            if INTERPRET:  # (the interpreter's dot takes no bf16)
                x, w = x.to(tl.float32), w.to(tl.float32)
            else:
                w = w.to(x.dtype)
            if SWAP:
                acc += tl.dot(w, tl.trans(x))
            else:
                acc += tl.dot(x, tl.trans(w))
        out = out_ptr + split * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out, tl.trans(acc) if SWAP else acc, mask=row_ok[:, None] & col_ok[None, :])


    @triton.jit
    def _int4_int8_kernel(xe_ptr, xo_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K,
                          GROUPS_PER_SPLIT, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """int4 codes times int8 rows of x on the integer tensor cores, a group
        at a time: sum_k x_k w_k over a group = xs (s (sum_k xq_k q_k - 8
        sum_k xq_k) + z sum_k xq_k), with x = xs xq (a scale per row and group)
        and w = (q - 8) s + z. The codes go to the dot as they are, unpacked
        to int8 (the high nibbles hold x's even columns, the low ones its
        odd: xe and xo); only the per-group sums are scaled in fp32."""
        pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        groups = K // GROUP
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        g_first = split * GROUPS_PER_SPLIT
        for g in range(g_first, g_first + GROUPS_PER_SPLIT):
            half = g * (GROUP // 2) + tl.arange(0, GROUP // 2)
            pairs = tl.load(w_ptr + cols[:, None] * (K // 2) + half[None, :], mask=col_ok[:, None], other=0,
                            eviction_policy="evict_first")
            xe = tl.load(xe_ptr + rows[:, None] * (K // 2) + half[None, :], mask=row_ok[:, None], other=0)
            xo = tl.load(xo_ptr + rows[:, None] * (K // 2) + half[None, :], mask=row_ok[:, None], other=0)
            dots = tl.dot(xe, tl.trans((pairs >> 4).to(tl.int8)), out_dtype=tl.int32)
            dots = tl.dot(xo, tl.trans((pairs & 15).to(tl.int8)), dots, out_dtype=tl.int32)
            scale = tl.load(s_ptr + cols * groups + g, mask=col_ok, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + cols * groups + g, mask=col_ok, other=0.0).to(tl.float32)
            x_scale = tl.load(xs_ptr + rows * groups + g, mask=row_ok, other=0.0)
            x_sum = tl.load(xsum_ptr + rows * groups + g, mask=row_ok, other=0.0)
            sums = scale[None, :] * (dots.to(tl.float32) - 8.0 * x_sum[:, None]) + zero[None, :] * x_sum[:, None]
            acc += x_scale[:, None] * sums
        out = out_ptr + split * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


def int8_rows(x: torch.Tensor, group: int):
    """x (M, K) as int8 codes with a scale per row and group of `group`
    inputs: (even columns, odd columns) (M, K/2) int8, the scales and the
    codes' sums (M, K/group) fp32."""
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    scale = xg.abs().amax(-1).clamp_min(1e-8) / 127
    codes = torch.round(xg / scale[..., None])
    sums = codes.sum(-1)
    codes = codes.to(torch.int8).view(m, k)
    return codes[:, 0::2].contiguous(), codes[:, 1::2].contiguous(), scale, sums


def int4_int8_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     block_m: int = 16, block_n: int = 64, programs: int = 528, warps: int = 4,
                     stages: int = 3) -> torch.Tensor:
    """(M, N) fp32: x (M, K) times int4 codes (N, K/2) with scale and zero (N,
    K/G), x quantized to int8 per row and group (int8_rows), on the integer
    tensor cores (_int4_int8_kernel; groups of 64 inputs or more)."""
    m, k = x.shape
    n, groups = packed.shape[0], scale.shape[1]
    group = k // groups
    if 2 * packed.shape[1] != k or group < 64:
        raise ValueError(f"int4 codes of {2 * packed.shape[1]} inputs in groups of {group} for x of {k}")
    xe, xo, xs, xsum = int8_rows(x, group)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = max(1, min(groups // 2, programs // tiles))
    while groups % split:
        split -= 1
    out = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    _int4_int8_kernel[grid](xe, xo, xs, xsum, packed, scale, zero, out, m, n, k, groups // split,
                            GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return out.sum(0)


def supported(x: torch.Tensor) -> bool:
    """Whether x (..., K), several tokens, goes through these kernels."""
    rows = x.numel() // x.shape[-1]
    return 1 < rows <= FEW_ROWS and x.dtype in (torch.bfloat16, torch.float16) and available(x.device)


# Per weight kind: (BLOCK_N, BLOCK_K at most, warps, stages, SWAP, programs wanted); BLOCK_M is
# the rows rounded up to 16. The fastest of a sweep on an H200 at 5 rows over the 8B shapes
# (benchmarks/few_rows.py --sweep); dense bf16 lost to cuBLAS there, so fusion.py leaves dense
# weights to cuBLAS. Q8_0's scale per 32 inputs was not swept.
CONFIG = {ROW_SCALED: (64, 128, 4, 3, True, 528), GROUPED_INT8: (64, 128, 4, 3, False, 264),
          INT4: (32, 256, 4, 3, False, 528), DENSE: (64, 128, 4, 3, False, 264)}


def blocks(kind: int, m: int, n: int, k: int, group: int | None) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, SWAP): about
    `programs` programs, splitting K where the tiles of N alone give too few."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k, warps, stages, swap, programs = CONFIG[kind]
    block_k = block_k if group is None else min(block_k, max(group, 32))
    while k % block_k and block_k > 32:
        block_k //= 2
    steps = -(-k // block_k)
    tiles = -(-n // block_n) * -(-m // block_m)
    split = max(1, min(steps // 2, programs // tiles))
    while steps % split:
        split -= 1
    return block_m, block_n, block_k, split, warps, stages, swap


def few_rows_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None = None,
                    zero: torch.Tensor | None = None) -> torch.Tensor:
    """(M, N) fp32 sums of x (M, K) times the codes' weights: codes (N, K) int8
    or fp8 with no scale (the caller's per-row scale), int8 with a scale (N,
    K/G), int4 pairs (N, K/2) uint8 with scale and zero (N, K/G), or dense
    weights (N, K) in x's dtype."""
    if codes.is_cuda and not interpreted() and torch.compiler.is_compiling():  # (outside a trace, the
        return _few_rows_op(x, codes, scale, zero).sum(0)  # op's call would only import the compiler)
    partial = _launch(x, codes, scale, zero)  # (the sum outside the op: a compiled step fuses it)
    return partial[0] if len(partial) == 1 else partial.sum(0)


def kind_of(codes: torch.Tensor, scale: torch.Tensor | None) -> int:
    if codes.dtype == torch.uint8:
        return INT4
    if codes.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return DENSE
    return ROW_SCALED if scale is None else GROUPED_INT8


def _launch_shape(x, codes, scale):
    """(kind, group, the empty fp32 partial sums (SPLIT_K, M, N), blocks()) of these operands."""
    kind = kind_of(codes, scale)
    (m, k), n = x.shape, codes.shape[0]
    group = None if scale is None else k // scale.shape[1]
    chosen = blocks(kind, m, n, k, group)
    return kind, group, x.new_empty(chosen[3], m, n, dtype=torch.float32), chosen


def _launch(x, codes, scale, zero):
    """The split-K partial sums (SPLIT_K, M, N) in fp32."""
    m, k = x.shape
    n = codes.shape[0]
    kind, group, out, (block_m, block_n, block_k, split, warps, stages, swap) = _launch_shape(x, codes, scale)
    if kind == INT4 and k != 2 * codes.shape[1]:
        raise ValueError(f"x has {k} inputs, the int4 codes {2 * codes.shape[1]}")
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    k_per_split = -(-k // block_k) // split * block_k
    absent = codes if scale is None else scale  # (pointers the kernel's format does not read)
    _few_rows_kernel[grid](x.contiguous(), codes, absent, absent if zero is None else zero, out, m, n, k,
                           k_per_split, KIND=kind, GROUP=group or 1, BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=block_k, SWAP=swap, INTERPRET=interpreted(), num_warps=warps, num_stages=stages)
    return out


if triton is not None:  # opaque to the compiler, which would otherwise widen the whole weight again
    _few_rows_op = torch.library.custom_op("brisklm::few_rows_matmul", _launch, mutates_args=(),
                                           schema="(Tensor x, Tensor codes, Tensor? scale, Tensor? zero) -> Tensor")

    _few_rows_op.register_fake(lambda x, codes, scale, zero: _launch_shape(x, codes, scale)[2])
