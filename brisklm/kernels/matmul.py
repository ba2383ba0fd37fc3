"""A few tokens times quantized weights, in Triton (CUDA only): prefill of a
short prompt, and the verify step of speculative decoding.

At up to FEW_ROWS tokens a Linear still costs its weight's bytes, not its
arithmetic, so it should read the codes once, as the GEMVs do. The plain path
widens the whole matrix to the activation dtype first and then multiplies:
it writes and reads the weight again at two or four times its size (a
short prompt cost ten decode steps). Here each program loads a (BLOCK_N, BLOCK_K) tile of
codes, widens it in registers and multiplies it with the rows of x on the
tensor cores (tl.dot), accumulating in fp32. On Hopper the tile comes through
the bulk tensor copy engine (TMA: weight_tiles), one instruction a tile: the
tile's loads, not its dot, set its time. The slices of K (SPLIT_K) give
the GPU enough programs when N is small, and are summed by the caller. An
MoE layer's experts run as one matrix, each block of N with rows of its own
and, where counts are given, only as many of them as that expert's tokens:
a tile of rows past them reads no weights (an expert no token chose costs
nothing). SWAP puts the weight tile first in the dot and x second (dense's
and int4's choice).
int4 codes in groups of 64 or more skip the conversion to floats
(_int4_words_kernel, WORDS): read as int32 words, each word turned into
the dot's operands two codes at a time by one lop3 of its bits (128 + q),
x taken in four pieces whose columns match the codes' order in the words,
the group's scale and zero applied to the dot's sums (making each operand
from a byte, as before, cost more than the codes' reads). Figures:
benchmarks/RESULTS.md, "Speculative decoding on the H200".

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
    def _few_rows_kernel(x_ptr, w_ptr, w_desc, s_ptr, z_ptr, counts_ptr, out_ptr, M, N, K, K_PER_SPLIT, N_PER_X,
                         KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr,
                         COUNTED: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
        _await_inputs(PDL)
        pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        block_x = pid_n * BLOCK_N // N_PER_X  # (the rows of x for this tile's block of N_PER_X outputs)
        x_ptr += block_x * M * K
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_first, k_end, row_ok = _row_range(counts_ptr, block_x, split, K_PER_SPLIT, M, pid_m, BLOCK_M, COUNTED)
        col_ok = cols < N
        if SWAP:  # the weight tile as the dot's first operand (it can stay in registers), x^T second
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_first, k_end, BLOCK_K):
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
        tl.store(out, tl.trans(acc) if SWAP else acc, mask=(rows < M)[:, None] & col_ok[None, :])

    @triton.jit
    def _row_range(counts_ptr, block_x, split, K_PER_SPLIT, M, pid_m, BLOCK_M: tl.constexpr, COUNTED: tl.constexpr):
        """(first k, end of k, the rows of x read) of a program: with COUNTED, x's
        block of rows holds counts[block_x] real rows and the rest are
        skipped, read as zeros (a tile with none of them sums nothing: its
        outputs are zeros, and its weights are never read)."""
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        k_first = split * K_PER_SPLIT
        if COUNTED:
            real = tl.load(counts_ptr + block_x).to(tl.int32)
            return k_first, tl.where(pid_m * BLOCK_M < real, k_first + K_PER_SPLIT, k_first), rows < real
        return k_first, k_first + K_PER_SPLIT, rows < M


    # Each lop3 makes two operands from one word of codes: (word & 0x000F000F) | ONE, two nibbles
    # into the low mantissa bits of two 16-bit floats, 128 + q each (bf16: ONE = 128.0 twice;
    # fp16: the nibbles shifted up 3 bits, ONE = 128.0 in fp16, whose unit there is 1/8).
    _NIBBLES_BF16 = tl.constexpr("lop3.b32 $0, $1, 983055, 1124090624, 234;")
    _NIBBLES_FP16 = tl.constexpr("lop3.b32 $0, $1, 7864440, 1476417536, 234;")

    @triton.jit
    def _nibble_operands(w, SH: tl.constexpr, FP16: tl.constexpr, INTERPRET: tl.constexpr,
                         BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
        """(BLOCK_N, WORDS) int32 words of int4 codes -> (BLOCK_N, 2 WORDS)
        operands 128 + q: the nibbles at bits 4 SH and 16 + 4 SH of each word
        (word j of a group holds k = 8j..8j + 7; these are k = 8j + (SH ^ 1)
        and 8j + (SH ^ 1) + 4: columns 2j and 2j + 1)."""
        if INTERPRET:  # (no PTX there: the same numbers in fp32)
            ws = w >> (4 * SH)
            op = tl.join(ws & 15, (ws >> 16) & 15).to(tl.float32) + 128.0
        else:
            if FP16:
                ws = (w << 3) if SH == 0 else (w >> (4 * SH - 3))
            else:
                ws = w >> (4 * SH)
            op = tl.inline_asm_elementwise(_NIBBLES_FP16 if FP16 else _NIBBLES_BF16, "=r,r,r", [tl.join(ws, ws)],
                                           dtype=tl.float16 if FP16 else tl.bfloat16, is_pure=True, pack=2)
        return tl.reshape(op, (BLOCK_N, 2 * WORDS))

    @triton.jit
    def _int4_words_kernel(xq_ptr, w_ptr, w_desc, s_ptr, z_ptr, counts_ptr, out_ptr, M, N, K, K_PER_SPLIT, N_PER_X,
                           X_PIECE, GROUP: tl.constexpr, FP16: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr,
                           COUNTED: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
        """int4 codes read as int32 words (N, K/8) times x in four pieces (xq:
        (4, M, K/4), xq[c][:, 2j + t] = x[:, 8j + c + 4t], `x_pieces`): each
        lop3 turns a word into two of the dot's operands, 128 + q
        (_nibble_operands), the four shifts of a word meeting the four
        pieces. w = (q - 8) s + z, so a group's sum is s d + (z - 136 s) xs,
        d the dots and xs the group's sum of x, taken by the tensor cores from
        the same loaded values (a dot with ones: a sum made elsewhere, from x
        before its rounding to x's dtype, is off by 136 times that rounding;
        a tl.sum of the loaded pieces made the verify step slower)."""
        WORDS: tl.constexpr = GROUP // 8
        OFFSET: tl.constexpr = 136.0  # 128 in each operand, and the codes' 8
        _await_inputs(PDL)
        pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        block_x = pid_n * BLOCK_N // N_PER_X  # (as in _few_rows_kernel)
        xq_ptr += block_x * M * (K // 4)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_first, k_end, row_ok = _row_range(counts_ptr, block_x, split, K_PER_SPLIT, M, pid_m, BLOCK_M, COUNTED)
        col_ok = cols < N
        shape: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
        acc = tl.zeros(shape, dtype=tl.float32)
        ones = tl.full((BLOCK_N, 2 * WORDS), 1.0, tl.float32 if INTERPRET else xq_ptr.dtype.element_ty)
        for k0 in range(k_first, k_end, BLOCK_K):
            for j in tl.static_range(BLOCK_K // GROUP):
                g = k0 // GROUP + j
                if TMA:
                    w = w_desc.load([pid_n * BLOCK_N, g * WORDS])
                else:
                    w = tl.load(w_ptr + cols[:, None] * (K // 8) + g * WORDS + tl.arange(0, WORDS)[None, :],
                                mask=col_ok[:, None], other=0, eviction_policy="evict_first")
                piece = g * (2 * WORDS) + tl.arange(0, 2 * WORDS)
                d = tl.zeros(shape, dtype=tl.float32)
                xs = tl.zeros(shape, dtype=tl.float32)
                for sh in tl.static_range(4):
                    xc = tl.load(xq_ptr + (sh ^ 1) * X_PIECE + rows[:, None] * (K // 4) + piece[None, :],
                                 mask=row_ok[:, None], other=0.0)
                    if INTERPRET:
                        xc = xc.to(tl.float32)
                    op = _nibble_operands(w, sh, FP16, INTERPRET, BLOCK_N, WORDS)
                    if SWAP:
                        d = tl.dot(op, tl.trans(xc), d)
                        xs = tl.dot(ones, tl.trans(xc), xs)
                    else:
                        d = tl.dot(xc, tl.trans(op), d)
                        xs = tl.dot(xc, tl.trans(ones), xs)
                s = tl.load(s_ptr + cols * (K // GROUP) + g, mask=col_ok, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + cols * (K // GROUP) + g, mask=col_ok, other=0.0).to(tl.float32)
                if SWAP:
                    acc += s[:, None] * d + (z - OFFSET * s)[:, None] * xs
                else:
                    acc += d * s[None, :] + xs * (z - OFFSET * s)[None, :]
        out = out_ptr + split * M * N
        if SWAP:
            tl.store(out + rows[None, :] * N + cols[:, None], acc, mask=(rows < M)[None, :] & col_ok[:, None])
        else:
            tl.store(out + rows[:, None] * N + cols[None, :], acc, mask=(rows < M)[:, None] & col_ok[None, :])


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

# int4 through _int4_words_kernel: (BLOCK_N, groups a step, warps, stages, SWAP, programs
# wanted); BLOCK_M as blocks(). Empty: int4 through _few_rows_kernel's widened tile.
WORDS = (64, 2, 4, 3, True, 528)
MIN_WORDS_GROUP = 64  # (a group's quarter is the dot's depth, at least 16)
# Where each block of x's rows has its own count of real rows (an MoE layer's experts, each
# with the tokens that chose it): at most this many rows a tile. A tile past an expert's count
# reads nothing; one more tile of rows reads the expert's weights again.
COUNTED_ROWS = 32


def blocks(kind: int, m: int, n: int, k: int, group: int | None, per_x: int = 0,
           counted: bool = False) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, SWAP): about
    `programs` programs, splitting K where the tiles of N alone give too few;
    each tile within one block of per_x outputs (if given)."""
    block_n, block_k, warps, stages, swap, programs = CONFIG[kind]
    block_n = whole_tiles(block_n, per_x)
    block_k = block_k if group is None else min(block_k, max(group, 32))
    while k % block_k and block_k > 32:
        block_k //= 2
    block_m, split = rows_and_split(m, n, -(-k // block_k), block_n, programs, counted)
    return block_m, block_n, block_k, split, warps, stages, swap


def whole_tiles(block_n: int, per_x: int) -> int:
    """BLOCK_N, halved until it divides per_x (0: any)."""
    while per_x % block_n and block_n > 16:
        block_n //= 2
    if per_x % block_n:
        raise ValueError(f"{per_x} outputs for each x do not split into tiles of 16")
    return block_n


def rows_and_split(m: int, n: int, steps: int, block_n: int, programs: int, counted: bool = False) -> tuple[int, int]:
    """(BLOCK_M, SPLIT_K) for M rows, N outputs and K in `steps` blocks: the
    rows rounded up to 16 (counted: at most COUNTED_ROWS, the tiles past the
    first not counted, as they mostly read nothing), and K split into a
    divisor of its steps so that the tiles give about `programs` programs."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_m = min(block_m, COUNTED_ROWS) if counted else block_m
    tiles = -(-n // block_n) * (1 if counted else -(-m // block_m))
    split = max(1, min(steps // 2, programs // tiles))
    while steps % split:
        split -= 1
    return block_m, split


def few_rows_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None = None,
                    zero: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """(M, N) fp32 sums of x (M, K) times the codes' weights: codes (N, K) int8
    or fp8 with no scale (the caller's per-row scale), int8 with a scale (N,
    K/G), int4 pairs (N, K/2) uint8 with scale and zero (N, K/G), or dense
    weights (N, K) in x's dtype. x (E, M, K): rows of their own for each
    block of N/E outputs (an MoE layer's experts stacked as one matrix), of
    which only the first counts[e] (counts (E,) on the device, if given)
    are read: the sums of the others are zeros."""
    if words_group(codes, scale, x):
        xq = x_pieces(x)  # (in a compiled step: made with x)
        partial = (_words_op if _traced(codes) else _launch_words)(xq, codes, scale, zero, counts)
    else:
        partial = (_few_rows_op if _traced(codes) else _launch)(x, codes, scale, zero, counts)
    return partial[0] if len(partial) == 1 else partial.sum(0)  # (outside the op: a compiled step fuses it)


def _traced(codes) -> bool:
    """Whether to call the custom op (the compiler traces), not launch directly
    (outside a trace, the op's call would only import the compiler)."""
    return codes.is_cuda and not interpreted() and torch.compiler.is_compiling()


def words_group(codes: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor) -> int | None:
    """The group of int4 codes read by _int4_words_kernel (WORDS), else None:
    groups of a power of two from 64 (at 32, GGUF's Q4_0 and Q4_1, a quarter
    group is too shallow for the dot), codes that read as int32 words, a
    bf16 or fp16 x."""
    if codes.dtype != torch.uint8 or not WORDS or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    group = x.shape[-1] // scale.shape[1]
    words = codes.dim() == 2 and codes.stride(1) == 1 and codes.shape[1] % 4 == 0 and codes.stride(0) % 4 == 0
    return group if words and group >= MIN_WORDS_GROUP and group & (group - 1) == 0 else None


def x_pieces(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) as the four pieces _int4_words_kernel reads, (4, ..., K/4):
    piece c holds inputs 8j + c and 8j + c + 4 at columns 2j and 2j + 1."""
    return x.unflatten(-1, (-1, 2, 4)).movedim(-1, 0).flatten(-2).contiguous()


def words_blocks(m: int, n: int, k: int, group: int, per_x: int = 0, counted: bool = False) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, SWAP), as blocks()."""
    block_n, groups, warps, stages, swap, programs = WORDS
    block_n = whole_tiles(block_n, per_x)
    block_k = group * groups
    while k % block_k:
        block_k -= group
    block_m, split = rows_and_split(m, n, k // block_k, block_n, programs, counted)
    return block_m, block_n, block_k, split, warps, stages, swap


def per_x(x: torch.Tensor, n: int) -> int:
    """The outputs that each (M, K) of x meets: N/E for x (E, M, K); 0 (all) for x (M, K)."""
    if x.dim() == 2:
        return 0
    if n % x.shape[0]:
        raise ValueError(f"{n} outputs do not split among {x.shape[0]} blocks of rows")
    return n // x.shape[0]


def _words_shape(xq, codes, scale, counts=None):
    """(K, group, the empty partial sums (SPLIT_K, M, N), words_blocks())."""
    (m, k), n = (xq.shape[-2], 4 * xq.shape[-1]), codes.shape[0]
    group = k // scale.shape[1]
    chosen = words_blocks(m, n, k, group, per_x(xq[0], n), counts is not None)
    return k, group, xq.new_empty(chosen[3], m, n, dtype=torch.float32), chosen


def _launch_words(xq, codes, scale, zero, counts=None):
    """The split-K partial sums (SPLIT_K, M, N) in fp32."""
    k, group, out, (block_m, block_n, block_k, split, warps, stages, swap) = _words_shape(xq, codes, scale, counts)
    m, n = xq.shape[-2], codes.shape[0]
    if k != 2 * codes.shape[1]:
        raise ValueError(f"x has {k} inputs, the int4 codes {2 * codes.shape[1]}")
    words = codes.view(torch.int32)
    desc = weight_tiles(words, block_n, group // 8)
    xq = xq.contiguous()  # (the compiler may hand a custom op other strides than eager code has)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)  # (an expert's tiles of rows one after another)
    pdl = early_launch(xq.device)  # (launched while the kernel before finishes, as the GEMVs are)
    _int4_words_kernel[grid](xq, words, desc, scale, zero, zero if counts is None else counts, out, m, n, k,
                             k // split, per_x(xq[0], n) or n, xq[0].numel(), GROUP=group,
                             FP16=xq.dtype == torch.float16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             SWAP=swap, TMA=desc is not words, COUNTED=counts is not None, INTERPRET=interpreted(),
                             PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl)
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


def _launch_shape(x, codes, scale, counts=None):
    """(kind, group, the empty fp32 partial sums (SPLIT_K, M, N), blocks()) of these operands."""
    kind = kind_of(codes, scale)
    (m, k), n = x.shape[-2:], codes.shape[0]
    group = None if scale is None else k // scale.shape[1]
    chosen = blocks(kind, m, n, k, group, per_x(x, n), counts is not None)
    return kind, group, x.new_empty(chosen[3], m, n, dtype=torch.float32), chosen


def _launch(x, codes, scale, zero, counts=None):
    """The split-K partial sums (SPLIT_K, M, N) in fp32."""
    m, k = x.shape[-2:]
    n = codes.shape[0]
    kind, group, out, (block_m, block_n, block_k, split, warps, stages, swap) = _launch_shape(x, codes, scale, counts)
    if kind == INT4 and k != 2 * codes.shape[1]:
        raise ValueError(f"x has {k} inputs, the int4 codes {2 * codes.shape[1]}")
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)  # (as in _launch_words)
    k_per_split = -(-k // block_k) // split * block_k
    absent = codes if scale is None else scale  # (pointers the kernel's format does not read)
    pdl = early_launch(x.device)  # (launched while the kernel before finishes, as the GEMVs are)
    desc = weight_tiles(codes, block_n, block_k // 2 if kind == INT4 else block_k)
    _few_rows_kernel[grid](x.contiguous(), codes, desc, absent, absent if zero is None else zero,
                           absent if counts is None else counts, out, m, n, k, k_per_split, per_x(x, n) or n,
                           KIND=kind, GROUP=group or 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap,
                           TMA=desc is not codes, COUNTED=counts is not None, INTERPRET=interpreted(), PDL=pdl,
                           num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return out


if triton is not None:  # opaque to the compiler, which would otherwise widen the whole weight again
    _few_rows_op = torch.library.custom_op(
        "brisklm::few_rows_matmul", _launch, mutates_args=(),
        schema="(Tensor x, Tensor codes, Tensor? scale, Tensor? zero, Tensor? counts) -> Tensor")

    _few_rows_op.register_fake(lambda x, codes, scale, zero, counts: _launch_shape(x, codes, scale, counts)[2])

    _words_op = torch.library.custom_op(
        "brisklm::int4_words_matmul", _launch_words, mutates_args=(),
        schema="(Tensor xq, Tensor codes, Tensor scale, Tensor zero, Tensor? counts) -> Tensor")

    _words_op.register_fake(lambda xq, codes, scale, zero, counts: _words_shape(xq, codes, scale, counts)[2])
