"""A few tokens times quantized weights, in Triton (CUDA only): prefill of a
short prompt, and the verify step of speculative decoding.

At up to FEW_ROWS tokens a Linear still costs its weight's bytes, not its
arithmetic, so it should read the codes once, as the GEMVs do. The plain path
widens the whole matrix to the activation dtype first and then multiplies:
it writes and reads the weight again at two or four times its size (a
short prompt cost ten decode steps). Here each program loads a (BLOCK_N, BLOCK_K) tile of
codes, widens it in registers and multiplies it with the rows of x on the
tensor cores (tl.dot), accumulating in fp32. On Hopper the tile comes through
the bulk tensor copy engine (TMA: weight_tiles), one instruction a tile (on
an H100, the 8B int8 verify step at 5 rows 4.62 -> 3.75 ms with the blocks
swept for it, 1.17 decode steps). The slices of K (SPLIT_K) give
the GPU enough programs when N is small, and are summed by the caller. SWAP
puts the weight tile first in the dot and x second (dense's and int4 halves' choice).
int4 codes in groups of 64 or more skip the conversion to floats
(_int4_halves_kernel, HALVES): the high nibbles meet x's even columns and
the low ones its odd columns in two dots, each code made the dot's operand
by one OR of its bits, the group's scale and zero applied to the dot's sums
(on an H100, 0.86x the widened tile's time at 2-9 rows, 0.65x at 17).

Formats (quantize.py): int8 or fp8 (N, K) codes whose per-row scale the
caller applies; int8 with a scale per group (GGUF Q8_0); int4 (N, K/2) with
two codes a byte, even k in the high nibble, w = (q - 8) s + z per group;
dense weights (N, K), read as they are (unused where cuBLAS is faster).
The same launch runs under TRITON_INTERPRET=1 on CPU tensors (the tests).
"""
from __future__ import annotations

import torch

from . import interpreted
from .gemv import available, early_launch, triton

FEW_ROWS = 64  # up to this many tokens, a quantized Linear on a GPU uses these kernels
TMA = True  # the weight tiles through the bulk tensor copy engine where it reads them (weight_tiles)

ROW_SCALED, GROUPED_INT8, INT4, DENSE = 0, 1, 2, 3

if triton is not None:
    import triton.language as tl

    from .gemv import _await_inputs

    _ROW_SCALED, _INT4, _DENSE = tl.constexpr(ROW_SCALED), tl.constexpr(INT4), tl.constexpr(DENSE)

    @triton.jit
    def _few_rows_kernel(x_ptr, w_ptr, w_desc, s_ptr, z_ptr, out_ptr, M, N, K, K_PER_SPLIT, N_PER_X,
                         KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr,
                         INTERPRET: tl.constexpr, PDL: tl.constexpr):
        _await_inputs(PDL)
        pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        x_ptr += (pid_n * BLOCK_N // N_PER_X) * M * K  # (the rows of x for this tile's block of N_PER_X outputs)
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
                if TMA:
                    pairs = w_desc.load([pid_n * BLOCK_N, k0 // 2])
                else:
                    pairs = tl.load(w_ptr + cols[:, None] * (K // 2) + half[None, :],
                                    mask=col_ok[:, None] & (half[None, :] < K // 2), other=0,
                                    eviction_policy="evict_first")
                codes = tl.join(pairs >> 4, pairs & 15).reshape(BLOCK_N, BLOCK_K)  # even k first
                w = codes.to(tl.float32) - 8.0
            elif TMA:  # (the copy engine reads zeros past the matrix's edges: no masks)
                w = w_desc.load([pid_n * BLOCK_N, k0])
                if KIND == _ROW_SCALED and not INTERPRET:
                    w = w.to(x.dtype)  # (exact: |q| <= 127, and fp8's 3 mantissa bits)
                elif KIND != _DENSE:
                    w = w.to(tl.float32)
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
    def _int4_halves_kernel(xe_ptr, xo_ptr, w_ptr, w_desc, s_ptr, z_ptr, out_ptr, M, N, K, K_PER_SPLIT, N_PER_X,
                            GROUP: tl.constexpr, ONE: tl.constexpr, SHIFT: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr,
                            INTERPRET: tl.constexpr, PDL: tl.constexpr):
        """int4 codes (N, K/2) times x (M, K) given as its even and odd columns
        (xe, xo: (M, K/2)): the high nibbles (even k) meet xe, the low ones
        xo, each a dot of its own, with no widening or reordering of the
        tile. A code q enters the dot as 128 + q in x's dtype, exact, whose
        bits are those of 128 (ONE) with q in the low mantissa bits (shifted
        by SHIFT: 0 in bf16, 3 in fp16): an OR, no conversion. w = (q - 8) s
        + z, so a group's sum is s (d - 136 xs) + z xs, d the group's dot and
        xs its sum of x, taken here from the same loaded values (a sum made
        elsewhere, from x before its rounding to x's dtype, is off by 136
        times that rounding)."""
        HALF: tl.constexpr = GROUP // 2
        OFFSET: tl.constexpr = 128.0
        _await_inputs(PDL)
        pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        x_block = (pid_n * BLOCK_N // N_PER_X) * M * (K // 2)  # (as in _few_rows_kernel)
        xe_ptr += x_block
        xo_ptr += x_block
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_first = split * K_PER_SPLIT
        for k0 in range(k_first, k_first + K_PER_SPLIT, BLOCK_K):
            for j in tl.static_range(BLOCK_K // GROUP):
                g = k0 // GROUP + j
                half = g * HALF + tl.arange(0, HALF)
                if TMA:
                    pairs = w_desc.load([pid_n * BLOCK_N, g * HALF])
                else:
                    pairs = tl.load(w_ptr + cols[:, None] * (K // 2) + half[None, :], mask=col_ok[:, None], other=0,
                                    eviction_policy="evict_first")
                xe = tl.load(xe_ptr + rows[:, None] * (K // 2) + half[None, :], mask=row_ok[:, None], other=0.0)
                xo = tl.load(xo_ptr + rows[:, None] * (K // 2) + half[None, :], mask=row_ok[:, None], other=0.0)
                xs = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)
                if INTERPRET:  # (no bf16 dot there: the same numbers in fp32)
                    hi, lo = (pairs >> 4).to(tl.float32) + OFFSET, (pairs & 15).to(tl.float32) + OFFSET
                    xe, xo = xe.to(tl.float32), xo.to(tl.float32)
                else:
                    hi = (((pairs >> 4) << SHIFT).to(tl.int16) | ONE).to(xe.dtype, bitcast=True)
                    lo = (((pairs & 15) << SHIFT).to(tl.int16) | ONE).to(xe.dtype, bitcast=True)
                s = tl.load(s_ptr + cols * (K // GROUP) + g, mask=col_ok, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + cols * (K // GROUP) + g, mask=col_ok, other=0.0).to(tl.float32)
                if SWAP:
                    d = tl.dot(lo, tl.trans(xo), tl.dot(hi, tl.trans(xe)))
                    acc += s[:, None] * (d - (OFFSET + 8.0) * xs[None, :]) + z[:, None] * xs[None, :]
                else:
                    d = tl.dot(xo, tl.trans(lo), tl.dot(xe, tl.trans(hi)))
                    acc += (d - (OFFSET + 8.0) * xs[:, None]) * s[None, :] + xs[:, None] * z[None, :]
        out = out_ptr + split * M * N
        if SWAP:
            tl.store(out + rows[None, :] * N + cols[:, None], acc, mask=row_ok[None, :] & col_ok[:, None])
        else:
            tl.store(out + rows[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def supported(x: torch.Tensor) -> bool:
    """Whether x (..., K), several tokens, goes through these kernels."""
    rows = x.numel() // x.shape[-1]
    return 1 < rows <= FEW_ROWS and x.dtype in (torch.bfloat16, torch.float16) and available(x.device)


# Per weight kind: (BLOCK_N, BLOCK_K at most, warps, stages, SWAP, programs wanted); BLOCK_M is
# the rows rounded up to 16. The fastest of a sweep at 5 rows over the 8B shapes (benchmarks/
# few_rows.py --sweep; int8 and dense on an H100 with the copy engine's tiles, int4 on an H200
# before them, and again first on the H100). Dense bf16 lost to cuBLAS there as a kernel alone,
# but won in the compiled verify step, where ours launches early (fusion.DENSE_ROWS). Q8_0's
# scale per 32 inputs was not swept.
CONFIG = {ROW_SCALED: (64, 256, 4, 3, False, 264), GROUPED_INT8: (64, 128, 4, 3, False, 264),
          INT4: (32, 256, 4, 3, False, 528), DENSE: (64, 128, 4, 3, True, 264)}

# int4 through _int4_halves_kernel: (BLOCK_N, groups a step, warps, stages, SWAP, programs
# wanted); BLOCK_M as blocks(). Empty: int4 through _few_rows_kernel's widened tile.
HALVES = (64, 2, 4, 3, True, 528)
MIN_HALVES_GROUP = 64


def blocks(kind: int, m: int, n: int, k: int, group: int | None, per_x: int = 0) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, SWAP): about
    `programs` programs, splitting K where the tiles of N alone give too few;
    each tile within one block of per_x outputs (if given)."""
    block_n, block_k, warps, stages, swap, programs = CONFIG[kind]
    block_n = whole_tiles(block_n, per_x)
    block_k = block_k if group is None else min(block_k, max(group, 32))
    while k % block_k and block_k > 32:
        block_k //= 2
    block_m, split = rows_and_split(m, n, -(-k // block_k), block_n, programs)
    return block_m, block_n, block_k, split, warps, stages, swap


def whole_tiles(block_n: int, per_x: int) -> int:
    """BLOCK_N, halved until it divides per_x (0: any)."""
    while per_x % block_n and block_n > 16:
        block_n //= 2
    if per_x % block_n:
        raise ValueError(f"{per_x} outputs for each x do not split into tiles of 16")
    return block_n


def rows_and_split(m: int, n: int, steps: int, block_n: int, programs: int) -> tuple[int, int]:
    """(BLOCK_M, SPLIT_K) for M rows, N outputs and K in `steps` blocks: the
    rows rounded up to 16, and K split into a divisor of its steps so that
    the tiles give about `programs` programs."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = -(-n // block_n) * -(-m // block_m)
    split = max(1, min(steps // 2, programs // tiles))
    while steps % split:
        split -= 1
    return block_m, split


def few_rows_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None = None,
                    zero: torch.Tensor | None = None) -> torch.Tensor:
    """(M, N) fp32 sums of x (M, K) times the codes' weights: codes (N, K) int8
    or fp8 with no scale (the caller's per-row scale), int8 with a scale (N,
    K/G), int4 pairs (N, K/2) uint8 with scale and zero (N, K/G), or dense
    weights (N, K) in x's dtype. x (E, M, K): rows of their own for each
    block of N/E outputs (an MoE layer's experts stacked as one matrix)."""
    if halves_group(codes, scale, x):
        xe, xo = x[..., 0::2].contiguous(), x[..., 1::2].contiguous()  # (in a compiled step: made with x)
        partial = (_halves_op if _traced(codes) else _launch_halves)(xe, xo, codes, scale, zero)
    else:
        partial = (_few_rows_op if _traced(codes) else _launch)(x, codes, scale, zero)
    return partial[0] if len(partial) == 1 else partial.sum(0)  # (outside the op: a compiled step fuses it)


def _traced(codes) -> bool:
    """Whether to call the custom op (the compiler traces), not launch directly
    (outside a trace, the op's call would only import the compiler)."""
    return codes.is_cuda and not interpreted() and torch.compiler.is_compiling()


def halves_group(codes: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor) -> int | None:
    """The group of int4 codes read by _int4_halves_kernel (HALVES), else None:
    groups of 64 or more (at 32, GGUF's Q4_0 and Q4_1, the halves measured
    only 4% faster at the 8B shapes, too little for the copy of x's halves
    that a compiled step makes in a kernel of its own after the attention
    kernel), a bf16 or fp16 x. (The kernel reads groups of 32 too: half a
    group is the dot's depth, at least 16.)"""
    if codes.dtype != torch.uint8 or not HALVES or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    group = x.shape[-1] // scale.shape[1]
    return group if group >= MIN_HALVES_GROUP else None


def halves_blocks(m: int, n: int, k: int, group: int, per_x: int = 0) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, SWAP), as blocks()."""
    block_n, groups, warps, stages, swap, programs = HALVES
    block_n = whole_tiles(block_n, per_x)
    block_k = group * groups
    while k % block_k:
        block_k -= group
    block_m, split = rows_and_split(m, n, k // block_k, block_n, programs)
    return block_m, block_n, block_k, split, warps, stages, swap


def per_x(x: torch.Tensor, n: int) -> int:
    """The outputs that each (M, K) of x meets: N/E for x (E, M, K); 0 (all) for x (M, K)."""
    if x.dim() == 2:
        return 0
    if n % x.shape[0]:
        raise ValueError(f"{n} outputs do not split among {x.shape[0]} blocks of rows")
    return n // x.shape[0]


def _halves_shape(xe, codes, scale):
    """(K, group, the empty partial sums (SPLIT_K, M, N), halves_blocks())."""
    (m, k), n = (xe.shape[-2], 2 * xe.shape[-1]), codes.shape[0]
    group = k // scale.shape[1]
    chosen = halves_blocks(m, n, k, group, per_x(xe, n))
    return k, group, xe.new_empty(chosen[3], m, n, dtype=torch.float32), chosen


def _launch_halves(xe, xo, codes, scale, zero):
    """The split-K partial sums (SPLIT_K, M, N) in fp32."""
    k, group, out, (block_m, block_n, block_k, split, warps, stages, swap) = _halves_shape(xe, codes, scale)
    m, n = xe.shape[-2], codes.shape[0]
    if k != 2 * codes.shape[1]:
        raise ValueError(f"x has {k} inputs, the int4 codes {2 * codes.shape[1]}")
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    pdl = early_launch(xe.device)  # (launched while the kernel before finishes, as the GEMVs are)
    # (contiguous: the compiler may hand a custom op other strides than eager code has)
    desc = weight_tiles(codes, block_n, group // 2)
    _int4_halves_kernel[grid](xe.contiguous(), xo.contiguous(), codes, desc, scale, zero, out, m, n, k, k // split,
                              per_x(xe, n) or n,
                              GROUP=group, ONE=0x4300 if xe.dtype == torch.bfloat16 else 0x5800,
                              SHIFT=0 if xe.dtype == torch.bfloat16 else 3, BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap, TMA=desc is not codes,
                              INTERPRET=interpreted(), PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return out


def weight_tiles(codes: torch.Tensor, rows: int, columns: int):
    """A descriptor of codes' (rows, columns) tiles, for the bulk tensor copy
    engine (Hopper's TMA; under the interpreter too, for the tests), where it
    can read them (rows 16-byte aligned); else codes, read through pointers.
    The copy engine fetches a whole tile with one instruction, and zeros
    past the matrix's edges (no masks)."""
    aligned = codes.dim() == 2 and codes.stride(1) == 1 and (codes.stride(0) * codes.element_size()) % 16 == 0 \
        and codes.data_ptr() % 16 == 0
    on_chip = interpreted() or (codes.is_cuda and torch.cuda.get_device_capability(codes.device)[0] >= 9)
    if not (TMA and aligned and on_chip):
        return codes
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor.from_tensor(codes, [rows, columns])


def kind_of(codes: torch.Tensor, scale: torch.Tensor | None) -> int:
    if codes.dtype == torch.uint8:
        return INT4
    if codes.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return DENSE
    return ROW_SCALED if scale is None else GROUPED_INT8


def _launch_shape(x, codes, scale):
    """(kind, group, the empty fp32 partial sums (SPLIT_K, M, N), blocks()) of these operands."""
    kind = kind_of(codes, scale)
    (m, k), n = x.shape[-2:], codes.shape[0]
    group = None if scale is None else k // scale.shape[1]
    chosen = blocks(kind, m, n, k, group, per_x(x, n))
    return kind, group, x.new_empty(chosen[3], m, n, dtype=torch.float32), chosen


def _launch(x, codes, scale, zero):
    """The split-K partial sums (SPLIT_K, M, N) in fp32."""
    m, k = x.shape[-2:]
    n = codes.shape[0]
    kind, group, out, (block_m, block_n, block_k, split, warps, stages, swap) = _launch_shape(x, codes, scale)
    if kind == INT4 and k != 2 * codes.shape[1]:
        raise ValueError(f"x has {k} inputs, the int4 codes {2 * codes.shape[1]}")
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    k_per_split = -(-k // block_k) // split * block_k
    absent = codes if scale is None else scale  # (pointers the kernel's format does not read)
    pdl = early_launch(x.device)  # (launched while the kernel before finishes, as the GEMVs are)
    desc = weight_tiles(codes, block_n, block_k // 2 if kind == INT4 else block_k)
    _few_rows_kernel[grid](x.contiguous(), codes, desc, absent, absent if zero is None else zero, out, m, n, k,
                           k_per_split, per_x(x, n) or n, KIND=kind, GROUP=group or 1, BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=block_k, SWAP=swap, TMA=desc is not codes, INTERPRET=interpreted(), PDL=pdl,
                           num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return out


if triton is not None:  # opaque to the compiler, which would otherwise widen the whole weight again
    _few_rows_op = torch.library.custom_op("brisklm::few_rows_matmul", _launch, mutates_args=(),
                                           schema="(Tensor x, Tensor codes, Tensor? scale, Tensor? zero) -> Tensor")

    _few_rows_op.register_fake(lambda x, codes, scale, zero: _launch_shape(x, codes, scale)[2])

    _halves_op = torch.library.custom_op(
        "brisklm::int4_halves_matmul", _launch_halves, mutates_args=(),
        schema="(Tensor xe, Tensor xo, Tensor codes, Tensor scale, Tensor zero) -> Tensor")

    _halves_op.register_fake(lambda xe, xo, codes, scale, zero: _halves_shape(xe, codes, scale)[2])
