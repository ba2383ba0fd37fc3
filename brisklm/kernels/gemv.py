"""Batch-1 GEMVs with the dequantization fused, in Triton (CUDA only).

At one token a Linear is y = W x: every weight byte is read once and used
once, so the kernel's whole job is to stream W at the memory's speed and
spend few instructions per byte. Each program owns BLOCK_N output rows and
one of SPLIT_K slices of K; it loads 16-byte vectors along K (rows are
contiguous there), widens them to fp32 and keeps a (BLOCK_N, BLOCK_K) tile of
running products, reduced once at the end. Weights, scales and zeros are
loaded evict_first: read once, they should leave L2 before activations and
the KV cache. The kernels return fp32 partial sums (SPLIT_K, N): the caller's
`.sum(0) * scale`, and whatever follows, is fused by inductor into the next
elementwise kernel instead of a launch of its own.

  scaled_gemv:  int8, float8_e4m3fn or dense weights (N, K); the per-row
                scale is applied by the caller. int8 is read as int32 words
                and widened like the grouped codes below.
  grouped_gemv: a scale per group of G inputs. int4 (`int4_gemv`): codes
                packed two to a byte (N, K/2), even k in the high nibble,
                w = (q - 8) s + z. int8 (`int8_group_gemv`, GGUF Q8_0): w = q s.
                The zero and offset terms need only the per-group sums of x,
                shared by all rows, so the per-code work is a shift, one
                bitwise op and one FMA (see _code_as_float).

With a bf16 or fp16 x (every GPU model), int8 (a scale per row, or per group
as GGUF Q8_0) and int4 codes go through dp4a instead (_int8_dp4a_kernel,
_int4_dp4a_kernel): each program turns its
slice of x into two int8 planes per block of inputs (_x_planes), and each
instruction sums four exact integer products: about 2 instructions a code
against 4.3-4.9 (sm_90 SASS), for an error from x's
representation within 1.6e-5 of each block's largest |x|. After an RMSNorm,
the int4 kernel reads the planes made once instead, with the norm folded in
(pack_x; 1.9 instructions a code against 3.0 making them); the bf16 kernel
reads x times the norm's weight and applies the norm's 1/rms (norm_parts).
fp8 e4m3 codes with a half x go through fp16x2 arithmetic (_fp8_half_kernel, sm_89+): one
conversion turns two codes into fp16 exactly, one fused multiply-add takes
two products, and runs of 16 products are summed in fp16 before fp32 (1.7
instructions a code against 3.5); x is scaled by a power of two so those
sums cannot overflow, for an error near 1e-3 of the output's norm, under
what bf16 resolves.

Block sizes come from `config`, chosen by measurement on an H200
(benchmarks/gemv_sweep.py). The same launchers run under TRITON_INTERPRET=1
on CPU tensors, which is how the tests check the math without a GPU.
"""
from __future__ import annotations

import contextlib
import json
import math
import os

import torch

from . import interpreted

try:
    import triton
    import triton.language as tl
except Exception:  # CPU-only installs (no triton), or a triton that fails to import: torch ops instead
    triton = None


def available(device: torch.device) -> bool:
    """Whether the Triton GEMVs can run for tensors on `device`: NVIDIA GPUs
    only (the kernels use NVIDIA's PTX; a ROCm build of torch also names its
    GPUs "cuda"), or any device under the interpreter."""
    if triton is None:
        return False
    return (device.type == "cuda" and torch.version.hip is None) or interpreted()


# Block sizes (BLOCK_N, BLOCK_K, SPLIT_K, num_warps) per weight element size in
# bits ("8g": int8 with a scale per group), where the measured table (gemv_tuned.json, written by
# benchmarks/gemv_sweep.py for a device) has no entry. BLOCK_K counts codes.
DEFAULT_CONFIG = {16: (8, 512, 1, 4), 8: (16, 1024, 1, 4), 4: (32, 1024, 1, 8), "8g": (32, 512, 1, 4),
                  "8d": (16, 1024, 1, 4), "4d": (64, 512, 1, 4),  # d: dp4a (half x); 4d: best for 3 of 5 8B shapes
                  "8gd": (16, 1024, 1, 4),  # Q8_0 through dp4a (GGUF), as 8d
                  "8f": (16, 1024, 1, 4)}  # fp8 in fp16x2 arithmetic
TUNED_FILE = os.path.join(os.path.dirname(__file__), "gemv_tuned.json")
_tuned: dict | None = None


def tuned() -> dict:
    """The measured table for this process's GPU: "bits:N:K" -> entry. What
    this GPU has no entry for comes from a measured GPU of its architecture
    and number of SMs (an H100's from the H200's: the same SMs, other
    memory), not the fixed defaults, which leave SMs idle on wide matrices."""
    global _tuned
    if _tuned is None:
        table = {}
        if os.path.exists(TUNED_FILE) and torch.cuda.is_available():
            with open(TUNED_FILE) as f:
                tables = json.load(f)
            name, kind = torch.cuda.get_device_name(), gpu_kind()
            alike = next((t for other, t in tables.items() if other != name and t.get("_gpu") == kind), {})
            table = {**alike, **tables.get(name, {})}
        _tuned = {key: entry for key, entry in table.items() if key != "_gpu"}
    return _tuned


def gpu_kind() -> dict:
    """What a table of block sizes suits: the architecture and the number of SMs."""
    props = torch.cuda.get_device_properties()
    return {"capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count}


@contextlib.contextmanager
def tuned_table(table: dict):
    """Use `table` ("bits:N:K" -> {"config": (BLOCK_N, BLOCK_K, SPLIT_K,
    num_warps)}) instead of the measured one inside this block: for sweeps
    of block sizes, and ({}) to send every bf16 matrix through cuBLAS."""
    global _tuned
    saved, _tuned = _tuned, dict(table)
    try:
        yield
    finally:
        _tuned = saved


def measured(bits: int | str, n: int, k: int) -> dict | None:
    """The table's entry for this shape, else for the nearest measured shape
    of the same width (by the ratios of N and of K): its blocks suit a
    shape of about its size (the table holds the 8B's; Qwen3-8B's w2 is
    4096 x 12288, Phi-4's 5120 x 17920), where the fixed defaults give a
    wide matrix too few programs."""
    table = tuned()
    entry = table.get(f"{bits}:{n}:{k}")
    if entry is not None:
        return entry
    shapes = [tuple(map(int, key.split(":")[1:])) for key in table if key.split(":")[0] == str(bits)]
    if not shapes:
        return None
    distance = lambda shape: abs(math.log(shape[0] / n)) + abs(math.log(shape[1] / k))
    near = min(shapes, key=distance)
    return table[f"{bits}:{near[0]}:{near[1]}"]


def traced_as_constants():
    """Mark `config` traced as its result (the graph records the blocks it
    launches). Called where our modules are compiled (api.compiling), not at
    import: torch.compiler's import takes a second of every start."""
    torch.compiler.assume_constant_result(config)


def config(bits: int | str, n: int, k: int, group: int | None = None) -> tuple[int, int, int, int]:
    entry = measured(bits, n, k)
    if entry:
        block_n, block_k, split_k, warps = entry["config"]
    else:  # (the default blocks, K split to fill the GPU)
        block_n, block_k, _, warps = DEFAULT_CONFIG[bits]
        split_k = filling_split(n, block_n)
    block_k = max(block_k, group or 1)
    # Blocks tile K exactly where they can (no masks along K), and hold whole
    # groups; where no block does, K is ragged anyway and the wide block stays.
    exact = block_k
    while exact > max(group or 1, 32) and k % exact:
        exact //= 2
    block_k = exact if k % exact == 0 else block_k
    # The split nearest the wanted one that divides K's blocks (17920 = 35 blocks of 512: 5 for 4).
    blocks = k // block_k if k % block_k == 0 else 1  # (a ragged K is not split)
    split_k = min((s for s in range(1, 2 * split_k + 1) if blocks % s == 0), key=lambda s: (abs(s - split_k), -s))
    return block_n, block_k, split_k, warps


def filling_split(n: int, block_n: int, programs_an_sm: int = 4) -> int:
    """The split of K that gives a GPU with no measured blocks about
    `programs_an_sm` programs an SM where its rows alone give fewer (a
    matrix of 6144 rows in blocks of 64 is 96 programs: most of a GPU's
    SMs idle); 1 off GPUs."""
    if not torch.cuda.is_available():
        return 1
    wanted = programs_an_sm * torch.cuda.get_device_properties().multi_processor_count
    programs, split = -(-n // block_n), 1
    while programs * split < wanted and split < 8:
        split *= 2
    return split


def beats_dense(n: int, k: int) -> bool:
    """Whether our bf16 GEMV measured faster than cuBLAS for this shape, or
    the nearest measured one, here."""
    entry = measured(16, n, k)
    return bool(entry and entry.get("us", 1e9) < entry.get("cublas_us", 0))


def early_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch while the kernel before them finishes
    (programmatic dependent launch: Hopper and later; not under the interpreter;
    BRISKLM_PDL=0 turns it off, for profiles whose kernel times must not
    include the wait for the kernel before)."""
    return (device.type == "cuda" and not interpreted()
            and os.environ.get("BRISKLM_PDL") != "0" and torch.cuda.get_device_capability(device)[0] >= 9)


if triton is not None:

    @triton.jit
    def _await_inputs(PDL: tl.constexpr):
        """Launched early (launch_pdl), a kernel waits here until the kernel before it
        has finished and its writes are visible, then lets the next one launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _norm_scale(sq_ptr, n_sq, eps, K, N_SQ: tl.constexpr):
        """An RMSNorm's 1/rms, from the sums of squares of its input's n_sq groups
        (norm_parts); 1 where the GEMV takes no norm (N_SQ 0). Each thread sums
        them itself, from scalar loads issued before the main loop: their latency
        hides behind it, and no program ends with an exchange between threads
        (which measured dearer than the norm kernel it saves; RESULTS.md)."""
        if N_SQ == 0:
            scale = 1.0
        else:
            total = 0.0
            for g in tl.static_range(N_SQ):
                total += tl.load(sq_ptr + g, mask=g < n_sq, other=0.0)
            scale = tl.rsqrt(total / K + eps)
        return scale

    @triton.jit
    def _scaled_gemv_kernel(x_ptr, w_ptr, out_ptr, sq_ptr, n_sq, eps, N, K, expert_ptr, K_PER_SPLIT: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                            N_SQ: tl.constexpr, EXPERT: tl.constexpr, PDL: tl.constexpr):
        _await_inputs(PDL)
        if EXPERT:  # w: the (N, K) matrix at index *expert_ptr of stacked ones
            w_ptr += tl.load(expert_ptr).to(tl.int64) * N * K
        norm_scale = _norm_scale(sq_ptr, n_sq, eps, K, N_SQ)  # the RMSNorm before, if any
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for i in range(0, K_PER_SPLIT, BLOCK_K):
            k = k_start + i + cols
            if EVEN_K:
                x = tl.load(x_ptr + k)
                w = tl.load(w_rows + k[None, :], mask=row_ok[:, None], eviction_policy="evict_first")
            else:
                k_ok = k < K
                x = tl.load(x_ptr + k, mask=k_ok, other=0)
                w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], eviction_policy="evict_first")
                w = tl.where(k_ok[None, :], w.to(tl.float32), 0.0)  # masked lanes are undefined
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(out_ptr + pid_k * N + rows, tl.sum(acc, axis=1) * norm_scale, mask=row_ok)

    @triton.jit
    def _code_as_float(w, SHIFT: tl.constexpr, BITS: tl.constexpr, bits_of_one):
        """1 + c / 2**BITS, where c is the BITS-bit field of the int32 `w` at bit
        SHIFT (for int8, with its top bit flipped): the field is moved to the top
        of an fp32 mantissa under the exponent of 1.0. A shift and one LOP3
        instead of an int-to-float conversion, which runs at a fraction of the
        FMA rate and was the int4 and int8 kernels' limit on the H200.

        bits_of_one is 1.0's bit pattern, with the flip bit for int8 (ONE_BITS).
        It comes as a runtime argument: in a register, the mask and the merge
        are one LOP3; as two immediates they took two (sm_90 SASS)."""
        TOP: tl.constexpr = 23 - BITS
        if SHIFT <= TOP:
            v = w << (TOP - SHIFT)
        else:
            v = w >> (SHIFT - TOP)
        return ((v & (((1 << BITS) - 1) << TOP)) ^ bits_of_one).to(tl.float32, bitcast=True)

    @triton.jit
    def _int8_gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, one_bits, K_PER_SPLIT: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        _await_inputs(PDL)
        # Weights read as int32 words of 4 codes. With u = q + 128 (the byte with
        # its top bit flipped) each code becomes f = 1 + u/256, so
        # sum x q = 256 sum x f - 384 sum x.
        WORDS: tl.constexpr = BLOCK_K // 4
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * (K // 4)
        words = tl.arange(0, WORDS)
        acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        x_sum = tl.zeros((WORDS,), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for i in range(0, K_PER_SPLIT, BLOCK_K):
            k0 = k_start + i
            w = tl.load(w_rows + (k0 // 4 + words)[None, :], mask=row_ok[:, None], eviction_policy="evict_first")
            for b in tl.static_range(4):  # byte b of a word is k = 4 * word + b
                x = tl.load(x_ptr + k0 + 4 * words + b).to(tl.float32)
                acc += _code_as_float(w, 8 * b, 8, one_bits) * x[None, :]
                x_sum += x
        y = 256 * tl.sum(acc, axis=1) - 384 * tl.sum(x_sum, axis=0)
        tl.store(out_ptr + pid_k * N + rows, y, mask=row_ok)

    @triton.jit
    def _grouped_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, K, one_bits, K_PER_SPLIT: tl.constexpr,
                             BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        _await_inputs(PDL)
        # Codes with a scale per group of GROUP inputs, read as int32 words:
        #   int4 (BITS 4): 8 codes a word, byte j holding k = 2j in its high
        #        nibble and 2j + 1 in its low one; w = (q - 8) s + z.
        #   int8 (BITS 8, GGUF Q8_0): 4 codes a word, byte b holding k = 4 word + b; w = q s.
        # Each code c (int8: q + 128) becomes f = 1 + c/A with A = 2**BITS, so
        #   x.q = A (x.f) - (A + OFFSET) sum x, OFFSET = 0 (int4) or 128 (int8),
        # and a group adds A s (x.f) + (z - (A + 8) s) sum x (int4) or - 384 s sum x (int8).
        CODES: tl.constexpr = 32 // BITS
        A: tl.constexpr = 1 << BITS
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        WPG: tl.constexpr = GROUP // CODES
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n_groups = K // GROUP
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None, None] * (K // CODES)
        g_off = tl.arange(0, GROUPS)
        words = g_off[:, None] * WPG + tl.arange(0, WPG)[None, :]  # (GROUPS, WPG)
        acc = tl.zeros((BLOCK_N, GROUPS, WPG), dtype=tl.float32)
        acc_sum = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for i in range(0, K_PER_SPLIT, BLOCK_K):
            k0 = k_start + i
            w = tl.load(w_rows + (k0 // CODES + words)[None, :, :], mask=row_ok[:, None, None],
                        eviction_policy="evict_first")
            dot = tl.zeros((BLOCK_N, GROUPS, WPG), dtype=tl.float32)
            x_sum = tl.zeros((GROUPS, WPG), dtype=tl.float32)
            for p in tl.static_range(CODES):
                x = tl.load(x_ptr + k0 + CODES * words + p).to(tl.float32)
                if BITS == 4:
                    code = _code_as_float(w, 8 * (p // 2) + 4 * (1 - p % 2), 4, one_bits)
                else:
                    code = _code_as_float(w, 8 * p, 8, one_bits)
                dot += code * x[None, :, :]
                x_sum += x
            sz = rows[:, None] * n_groups + (k0 // GROUP + g_off)[None, :]
            s = tl.load(s_ptr + sz, mask=row_ok[:, None], other=0).to(tl.float32)
            if BITS == 4:
                per_sum = tl.load(z_ptr + sz, mask=row_ok[:, None], other=0).to(tl.float32) - (A + 8) * s
            else:
                per_sum = -(A + 128) * s
            acc += dot * (A * s)[:, :, None]
            acc_sum += per_sum * tl.sum(x_sum, axis=1)[None, :]
        y = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(acc_sum, axis=1)
        tl.store(out_ptr + pid_k * N + rows, y, mask=row_ok)


    # dp4a: four int8 products summed into an int32 in one instruction. The
    # activation becomes two int8 planes per block of inputs (_x_planes:
    # x ~ step (hi + lo / X_LO)), so codes times x are exact integer sums; the
    # two planes' sums of a word are merged as hi X_LO + lo (fits int32 for
    # blocks of up to 256 inputs), reduced over the block, then scaled once.
    DP4A_INT8 = tl.constexpr("""{
    .reg .b32 h, l;
    dp4a.s32.s32 h, $1, $2, 0;
    dp4a.s32.s32 l, $1, $3, 0;
    mad.lo.s32 $0, h, 254, l;
    }""")

    DP4A_INT4 = tl.constexpr("""{
    .reg .b32 e, o, h, l;
    and.b32 o, $1, 0x0F0F0F0F;
    shr.u32 e, $1, 4;
    and.b32 e, e, 0x0F0F0F0F;
    dp4a.u32.s32 h, e, $2, 0;
    dp4a.u32.s32 h, o, $3, h;
    dp4a.u32.s32 l, e, $4, 0;
    dp4a.u32.s32 l, o, $5, l;
    mad.lo.s32 $0, h, 254, l;
    }""")

    @triton.jit
    def _bytes_dot(a, b, A_SIGNED: tl.constexpr):
        """dp4a in integer ops, for the interpreter: the 4 bytes of a (signed or
        not) times the 4 signed bytes of b, summed."""
        total = a * 0
        for i in tl.static_range(4):
            if A_SIGNED:
                ai = (a << (24 - 8 * i)) >> 24
            else:
                ai = (a >> (8 * i)) & 255
            total += ai * ((b << (24 - 8 * i)) >> 24)
        return total

    @triton.jit
    def _int8_word_dot(w, x_hi, x_lo, INTERPRET: tl.constexpr):
        """Per int32 word of 4 int8 codes: codes . x_hi * X_LO + codes . x_lo."""
        if INTERPRET:  # no PTX there
            return _bytes_dot(w, x_hi, True) * 254 + _bytes_dot(w, x_lo, True)
        return tl.inline_asm_elementwise(DP4A_INT8, "=r,r,r,r", [w, x_hi, x_lo], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _int4_word_dot(w, xe_hi, xo_hi, xe_lo, xo_lo, INTERPRET: tl.constexpr):
        """Per int32 word of 8 int4 codes q (high nibbles: even k, low: odd k):
        q . x_hi * X_LO + q . x_lo, x's planes split into even and odd k."""
        if INTERPRET:
            e, o = (w >> 4) & 0x0F0F0F0F, w & 0x0F0F0F0F
            return (_bytes_dot(e, xe_hi, False) + _bytes_dot(o, xo_hi, False)) * 254 \
                + _bytes_dot(e, xe_lo, False) + _bytes_dot(o, xo_lo, False)
        return tl.inline_asm_elementwise(DP4A_INT4, "=r,r,r,r,r,r", [w, xe_hi, xo_hi, xe_lo, xo_lo],
                                         dtype=tl.int32, is_pure=True, pack=1)

    PRMT_EVEN_ODD = tl.constexpr("prmt.b32 $0, $2, $3, 0x6420; prmt.b32 $1, $2, $3, 0x7531;")

    @triton.jit
    def _even_odd(a, b, INTERPRET: tl.constexpr):
        """Two int32 words of 4 bytes each (inputs 0-3 and 4-7) -> the words of
        their even inputs (0, 2, 4, 6) and of their odd ones: one PRMT each."""
        if INTERPRET:
            even = (a & 0xFF) | ((a >> 8) & 0xFF00) | ((b & 0xFF) << 16) | (((b >> 8) & 0xFF00) << 16)
            odd = ((a >> 8) & 0xFF) | ((a >> 16) & 0xFF00) | (((b >> 8) & 0xFF) << 16) | (((b >> 16) & 0xFF00) << 16)
            return even, odd
        return tl.inline_asm_elementwise(PRMT_EVEN_ODD, "=r,=r,r,r", [a, b], dtype=(tl.int32, tl.int32),
                                         is_pure=True, pack=1)

    @triton.jit
    def _x_planes(xf):
        """x (blocks, inputs) as int8-valued planes: per block a step (its
        largest |x| / 127), hi = round(x / step) and lo = hi's rounding error
        in units of step / X_LO, so x = step (hi + lo / X_LO) within step / 508
        (1.6e-5 of the block's largest |x|). Each program computes them for
        its slice of x: no kernel before the GEMV to pack x."""
        step = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30) * (1 / 127)
        inv = 1 / step[:, None]
        hi = tl.floor(xf * inv + 0.5)
        lo = tl.floor((xf - hi * step[:, None]) * (254 * inv) + 0.5)
        return hi, lo, step

    @triton.jit
    def _as_words(v):
        """(..., 4) int8-valued floats -> (...) int32 words, byte i = v[..., i]."""
        b = v.to(tl.int32) & 255
        return tl.sum(b << (8 * tl.arange(0, 4)), axis=-1)

    @triton.jit
    def _block_words(xf, BLOCKS: tl.constexpr, XB: tl.constexpr):
        """x (BLOCKS * XB,) fp32 as _x_planes' hi and lo planes in int32 words,
        (BLOCKS, XB / 4) each, and the step of each block."""
        hi, lo, step = _x_planes(tl.reshape(xf, (BLOCKS, XB)))
        return _as_words(tl.reshape(hi, (BLOCKS, XB // 4, 4))), _as_words(tl.reshape(lo, (BLOCKS, XB // 4, 4))), step

    @triton.jit
    def _int8_dp4a_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, expert_ptr, K_PER_SPLIT: tl.constexpr, XB: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPED: tl.constexpr,
                          EXPERT: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
        _await_inputs(PDL)
        if EXPERT:  # the codes (and scales) at index *expert_ptr of stacked ones
            e = tl.load(expert_ptr).to(tl.int64)
            w_ptr += e * N * (K // 4)
            if GROUPED:
                s_ptr += e * N * (K // XB)
        # int8 codes, a scale per row (applied by the caller); x in blocks of XB
        # inputs, each with its own step: y = sum_blocks step / X_LO (sum over the block's words).
        # GROUPED (GGUF Q8_0): a scale per group of XB inputs too (s_ptr, (N, K / XB)),
        # applied here to each block's sum.
        BLOCKS: tl.constexpr = BLOCK_K // XB
        WPB: tl.constexpr = XB // 4
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * (K // 4)
        words = tl.arange(0, BLOCK_K // 4)
        acc = tl.zeros((BLOCK_N, BLOCKS), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for i in range(0, K_PER_SPLIT, BLOCK_K):
            # loaded as rows of words, the lanes along K, then viewed by block: a (BLOCK_N, BLOCKS, WPB)
            # tile of small blocks (GGUF's 32 inputs) got its lanes across rows, uncoalesced
            w = tl.load(w_rows + ((k_start + i) // 4 + words)[None, :], mask=row_ok[:, None],
                        eviction_policy="evict_first")
            w = tl.reshape(w, (BLOCK_N, BLOCKS, WPB))
            x_hi, x_lo, step = _block_words(tl.load(x_ptr + k_start + i + tl.arange(0, BLOCK_K)).to(tl.float32),
                                            BLOCKS, XB)
            d = tl.sum(_int8_word_dot(w, x_hi[None], x_lo[None], INTERPRET), axis=2).to(tl.float32)
            if GROUPED:
                blocks = (k_start + i) // XB + tl.arange(0, BLOCKS)
                d *= tl.load(s_ptr + rows[:, None] * (K // XB) + blocks[None, :], mask=row_ok[:, None],
                             other=0, eviction_policy="evict_first").to(tl.float32)
            acc += d * (step * (1 / 254))[None, :]
        tl.store(out_ptr + pid_k * N + rows, tl.sum(acc, axis=1), mask=row_ok)

    @triton.jit
    def _int4_dp4a_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, lo_ptr, step_ptr, xsum_ptr, sq_ptr, eps, N, K,
                          expert_ptr, K_PER_SPLIT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, W_ALIGN: tl.constexpr, S_ALIGN: tl.constexpr,
                          PACKED: tl.constexpr, N_SQ: tl.constexpr, EXPERT: tl.constexpr, INTERPRET: tl.constexpr,
                          PDL: tl.constexpr):
        _await_inputs(PDL)
        if EXPERT:  # codes, scales and zeros at index *expert_ptr of stacked ones
            e = tl.load(expert_ptr).to(tl.int64)
            w_ptr += e * N * (K // 8)
            s_ptr += e * N * (K // GROUP)
            z_ptr += e * N * (K // GROUP)
        # int4 codes, w = (q - 8) s + z per group; x in blocks of one group:
        #   y = sum_groups s step / X_LO (sum over the group's words) + (z - 8 s) sum x.
        # Each program makes x's planes from its slice of x; or, PACKED, they come
        # from pack_x (x_ptr, lo_ptr: the hi and lo planes as int32 words; step_ptr,
        # xsum_ptr: per group), made from an RMSNorm's input times the norm's
        # weight, and y is scaled by the norm's 1/rms, from the sums of squares
        # per group at sq_ptr.
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        WPG: tl.constexpr = GROUP // 8
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n_groups = tl.multiple_of(K // GROUP, S_ALIGN)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * tl.multiple_of(K // 8, W_ALIGN)
        g_off = tl.arange(0, GROUPS)
        words = tl.arange(0, BLOCK_K // 8)
        acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for i in range(0, K_PER_SPLIT, BLOCK_K):
            w = tl.load(w_rows + ((k_start + i) // 8 + words)[None, :], mask=row_ok[:, None],  # lanes along K
                        eviction_policy="evict_first")
            w = tl.reshape(w, (BLOCK_N, GROUPS, WPG))
            g = (k_start + i) // GROUP + g_off
            sz = rows[:, None] * n_groups + g[None, :]
            s = tl.load(s_ptr + sz, mask=row_ok[:, None], other=0, eviction_policy="evict_first").to(tl.float32)
            z = tl.load(z_ptr + sz, mask=row_ok[:, None], other=0, eviction_policy="evict_first").to(tl.float32)
            if PACKED:  # code word j holds inputs 8j..8j+7: plane words 2j and 2j + 1
                j = (k_start + i) // 8 + g_off[:, None] * WPG + tl.arange(0, WPG)[None, :]
                he, ho = _even_odd(tl.load(x_ptr + 2 * j), tl.load(x_ptr + 2 * j + 1), INTERPRET)
                le, lo = _even_odd(tl.load(lo_ptr + 2 * j), tl.load(lo_ptr + 2 * j + 1), INTERPRET)
                step = tl.load(step_ptr + g)
                x_sum = tl.load(xsum_ptr + g)
            else:
                xf = tl.load(x_ptr + k_start + i + tl.arange(0, BLOCK_K)).to(tl.float32)
                hi, lo, step = _x_planes(tl.reshape(xf, (GROUPS, GROUP)))
                x_sum = tl.sum(hi + lo * (1 / 254), axis=1) * step
                # a word's 8 codes: high nibbles even k, low nibbles odd k
                hi_even, hi_odd = tl.split(tl.reshape(hi, (GROUPS, WPG, 4, 2)))
                lo_even, lo_odd = tl.split(tl.reshape(lo, (GROUPS, WPG, 4, 2)))
                he, ho = _as_words(hi_even), _as_words(hi_odd)
                le, lo = _as_words(lo_even), _as_words(lo_odd)
            d = tl.sum(_int4_word_dot(w, he[None], ho[None], le[None], lo[None], INTERPRET), axis=2)
            acc += d.to(tl.float32) * s * (step * (1 / 254))[None, :] + (z - 8 * s) * x_sum[None, :]
        y = tl.sum(acc, axis=1)
        if PACKED:
            sq_groups = tl.arange(0, N_SQ)
            sq = tl.load(sq_ptr + sq_groups, mask=sq_groups < n_groups, other=0)
            y *= tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        tl.store(out_ptr + pid_k * N + rows, y, mask=row_ok)

    def _fp8_half_asm() -> str:
        """PTX: four int32 words of fp8 e4m3 codes ($1-$4: 16 consecutive
        inputs of a row) times x held as eight f16x2 pairs ($5-$12: inputs
        2m, 2m + 1), as one fp32 ($0). Each cvt turns two codes into an f16x2
        exactly (the low byte into the low half); the 16 products are summed in
        f16x2 fused multiply-adds, the two halves in fp32 at the end."""
        lines = ["{", ".reg .b16 lo, hi;", ".reg .b32 c, s;", ".reg .f32 a, b;"]
        for j in range(4):
            lines += [f"mov.b32 {{lo, hi}}, ${1 + j};", "cvt.rn.f16x2.e4m3x2 c, lo;",
                      "mul.rn.f16x2 s, c, $5;" if j == 0 else f"fma.rn.f16x2 s, c, ${5 + 2 * j}, s;",
                      "cvt.rn.f16x2.e4m3x2 c, hi;", f"fma.rn.f16x2 s, c, ${6 + 2 * j}, s;"]
        return "\n".join(lines + ["mov.b32 {lo, hi}, s;", "cvt.f32.f16 a, lo;", "cvt.f32.f16 b, hi;",
                                   "add.f32 $0, a, b;", "}"])

    FP8_HALF = tl.constexpr(_fp8_half_asm())

    @triton.jit
    def _split4(v):
        """(..., 2, 2) -> the four (...) slices v[..., j // 2, j % 2], j = 0..3."""
        a, b = tl.split(v)  # a: j = 0, 2; b: j = 1, 3
        v0, v2 = tl.split(a)
        v1, v3 = tl.split(b)
        return v0, v1, v2, v3

    @triton.jit
    def _fp8_half_kernel(x_ptr, w_ptr, w8_ptr, out_ptr, N, K, K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
        # fp8 e4m3 codes (a scale per row, applied by the caller) for a half x,
        # in fp16x2 arithmetic (FP8_HALF): x scaled by a power of two, exactly,
        # so that 16 products sum in fp16 without overflow; sums of 16 in fp32.
        _await_inputs(PDL)
        CHUNKS: tl.constexpr = BLOCK_K // 16
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        top = tl.zeros((BLOCK_K,), dtype=tl.float32)  # the program's largest |x|, read once before
        for i in range(0, K_PER_SPLIT, BLOCK_K):
            top = tl.maximum(top, tl.abs(tl.load(x_ptr + k_start + i + tl.arange(0, BLOCK_K)).to(tl.float32)))
        # up = 2**(2 - the exponent of the largest |x|): |x| up < 8, so 16 products
        # of |code| <= 448 stay under fp16's 65504 (built from the exponent bits)
        exponent = (tl.maximum(tl.max(top, axis=0), 1e-30).to(tl.int32, bitcast=True) >> 23) & 255
        up = ((256 - exponent) << 23).to(tl.float32, bitcast=True)
        for i in range(0, K_PER_SPLIT, BLOCK_K):
            k0 = k_start + i
            xh = (tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32) * up).to(tl.float16)
            if INTERPRET:  # no PTX there: the codes through the fp8 view, sums in fp32
                w8 = tl.load(w8_ptr + rows.to(tl.int64)[:, None] * K + k0 + tl.arange(0, BLOCK_K)[None, :],
                             mask=row_ok[:, None]).to(tl.float32)
                d = tl.sum(tl.reshape(w8 * xh.to(tl.float32)[None, :], (BLOCK_N, CHUNKS, 16)), axis=2)
            else:
                # rows of words, lanes along K (a (BLOCK_N, CHUNKS, 4) tile had its lanes across rows)
                w_cols = k0 // 4 + tl.arange(0, 4 * CHUNKS)
                w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * (K // 4) + w_cols[None, :], mask=row_ok[:, None],
                            eviction_policy="evict_first")
                w0, w1, w2, w3 = _split4(tl.reshape(w, (BLOCK_N, CHUNKS, 2, 2)))  # word j: inputs 4j..4j+3
                bits = xh.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                lo, hi = tl.split(tl.reshape(bits, (CHUNKS, 8, 2)))
                pairs = lo | (hi << 16)  # (CHUNKS, 8): pair m holds inputs 2m (low half) and 2m + 1
                q0, q1, q2, q3 = _split4(tl.reshape(pairs, (CHUNKS, 2, 2, 2)))  # q_c[:, a]: pair 4a + c
                x0, x4 = tl.split(q0)
                x1, x5 = tl.split(q1)
                x2, x6 = tl.split(q2)
                x3, x7 = tl.split(q3)
                d = tl.inline_asm_elementwise(
                    FP8_HALF, "=r" + ",r" * 12,
                    [w0, w1, w2, w3, x0[None], x1[None], x2[None], x3[None], x4[None], x5[None], x6[None],
                     x7[None]], dtype=tl.float32, is_pure=True, pack=1)
            acc += d
        tl.store(out_ptr + pid_k * N + rows, tl.sum(acc, axis=1) / up, mask=row_ok)

# 1.0's fp32 bits; for int8 codes also bit 22, the code's top bit flipped
# (q + 128) where _code_as_float moves it.
ONE_BITS = {4: 0x3F800000, 8: 0x3F800000 | 0x80 << 15}


def scaled_config(w: torch.Tensor) -> tuple[int, int, int, int]:
    return config(w.element_size() * 8, *w.shape)


def grouped_config(codes: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int, int]:
    bits = 4 if codes.dtype == torch.uint8 else 8
    k = codes.shape[1] * 8 // bits
    return config(4 if bits == 4 else "8g", codes.shape[0], k, k // scale.shape[1])


def _launch_scaled(x, w, squares, eps, cfg, launch, expert=None):
    """squares, eps: an RMSNorm folded in (norm_parts; bf16 weights only), or None.
    expert (1,): w is stacked matrices (E, N, K), of which this one is read
    (dense weights only)."""
    n, k = w.shape[-2:]
    block_n, block_k, split_k, warps = cfg
    out = torch.empty((split_k, n), device=x.device, dtype=torch.float32)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    grid = (triton.cdiv(n, block_n), split_k)
    even = k % block_k == 0 and k_per_split * split_k == k
    pdl = early_launch(x.device)
    if w.dtype == torch.int8 and even and expert is None:
        launch(_int8_gemv_kernel)[grid](x, w.view(torch.int32), out, n, k, ONE_BITS[8], k_per_split, BLOCK_N=block_n,
                                        BLOCK_K=block_k, PDL=pdl, num_warps=warps, launch_pdl=pdl)
    else:
        n_sq = 0 if squares is None else squares.numel()
        launch(_scaled_gemv_kernel)[grid](x, w, out, x if squares is None else squares, n_sq, eps, n, k,
                                          x if expert is None else expert, k_per_split, BLOCK_N=block_n,
                                          BLOCK_K=block_k, EVEN_K=even, N_SQ=triton.next_power_of_2(n_sq) if n_sq else 0,
                                          EXPERT=expert is not None, PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out


def _launch_grouped(x, codes, scale, zero, cfg, launch):
    """codes: (N, K/2) uint8 int4 pairs (with zero) or (N, K) int8 (zero unused)."""
    bits = 4 if codes.dtype == torch.uint8 else 8
    n, k = codes.shape[0], codes.shape[1] * 8 // bits
    group = k // scale.shape[1]
    block_n, block_k, split_k, warps = cfg
    out = torch.empty((split_k, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, block_n), split_k)
    pdl = early_launch(x.device)
    launch(_grouped_gemv_kernel)[grid](x, codes.view(torch.int32), scale, zero, out, n, k, ONE_BITS[bits],
                                       k // split_k, BITS=bits, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k,
                                       PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out


X_LO = 254  # the lo plane's unit: step / X_LO (|lo| <= 127 holds hi's rounding error, at most step / 2)


def dp4a_block(k: int) -> int | None:
    """The block of inputs that shares an int8 step for int8 weights (at most
    256, so the merged word sums fit int32)."""
    return next((b for b in (256, 128, 64, 32) if k % b == 0), None)


def _launch_int8_dp4a(x, w, cfg, launch, scale=None, expert=None):
    """A scale per row (applied by the caller), or with `scale` (N, K / G) one
    per group of G inputs. expert (1,): w (and scale) are stacked, (E, N, K),
    and this one of them is read."""
    n, k = w.shape[-2:]
    block_n, block_k, split_k, warps = cfg
    out = torch.empty((split_k, n), device=w.device, dtype=torch.float32)
    pdl = early_launch(w.device)
    launch(_int8_dp4a_kernel)[(triton.cdiv(n, block_n), split_k)](
        x, w.view(torch.int32), w if scale is None else scale, out, n, k, w if expert is None else expert,
        k // split_k, XB=dp4a_block(k) if scale is None else k // scale.shape[-1], BLOCK_N=block_n, BLOCK_K=block_k,
        GROUPED=scale is not None, EXPERT=expert is not None, INTERPRET=interpreted(), PDL=pdl, num_warps=warps,
        launch_pdl=pdl)
    return out


def _launch_int8_group_dp4a(x, w, scale, cfg, launch):
    return _launch_int8_dp4a(x, w, cfg, launch, scale)


def _row_align(n: int) -> int:
    """The largest power of two up to 16 that divides n."""
    return min(16, n & -n)


def _launch_int4_dp4a(x, codes, scale, zero, cfg, launch, packed=None, eps=0.0, expert=None):
    """x (K,); or, with packed = (lo, step, x_sum, squares) and the norm's eps,
    x is the hi plane from pack_x. expert (1,): codes, scale and zero are
    stacked, (E, N, ...), and this one of them is read."""
    # The kernel is told how aligned its rows are (W_ALIGN int32 words of codes,
    # S_ALIGN scales): knowing only that K is a multiple of 16, Triton saw rows
    # of codes 8-byte aligned (64-bit loads) and rows of scales unaligned (one
    # 2-byte load a scale). With 16-byte loads and the tile loaded along K the
    # kernel issues fewer instructions a code, and int4 decodes faster.
    n, k = codes.shape[-2], codes.shape[-1] * 2
    block_n, block_k, split_k, warps = cfg
    out = torch.empty((split_k, n), device=codes.device, dtype=torch.float32)
    pdl = early_launch(codes.device)
    if packed:  # the planes read as int32 words
        lo, step, x_sum, squares = packed
        x, lo = x.view(torch.int32), lo.view(torch.int32)
    else:
        lo = step = x_sum = squares = x  # unread
    launch(_int4_dp4a_kernel)[(triton.cdiv(n, block_n), split_k)](
        x, codes.view(torch.int32), scale, zero, out, lo, step, x_sum, squares, eps, n, k,
        codes if expert is None else expert, k // split_k, GROUP=k // scale.shape[-1], BLOCK_N=block_n,
        BLOCK_K=block_k, W_ALIGN=_row_align(k // 8), S_ALIGN=_row_align(scale.shape[-1]), PACKED=packed is not None,
        N_SQ=triton.next_power_of_2(scale.shape[-1]), EXPERT=expert is not None, INTERPRET=interpreted(), PDL=pdl,
        num_warps=warps, launch_pdl=pdl)
    return out


def _launch_expert(x, w, scale, zero, expert, cfg, launch):
    """One of stacked matrices (expert_gemv): int4 or int8 codes through dp4a, dense weights as they are."""
    if w.dtype == torch.uint8:
        return _launch_int4_dp4a(x, w, scale, zero, cfg, launch, expert=expert)
    if w.dtype == torch.int8:
        return _launch_int8_dp4a(x, w, cfg, launch, expert=expert)
    return _launch_scaled(x, w, None, 0.0, cfg, launch, expert=expert)


def _launch_int4_packed(hi, lo, step, x_sum, squares, eps, codes, scale, zero, cfg, launch):
    return _launch_int4_dp4a(hi, codes, scale, zero, cfg, launch, (lo, step, x_sum, squares), eps)


def _norm_input(x: torch.Tensor, norm_weight: torch.Tensor, group: int):
    """An RMSNorm's input x (K,) as a GEMV after it takes it: x g in fp32, in
    groups of `group` inputs, and the sum of squares of x per group (from
    which the GEMV applies the norm's 1/rms to its sums)."""
    xf = x.float().reshape(-1, group)
    return xf * norm_weight.float().reshape(-1, group), xf.square().sum(1)


def pack_x(x: torch.Tensor, group: int, norm_weight: torch.Tensor):
    """An RMSNorm's input x (K,) and weight g as the int4 dp4a GEMV after the
    norm reads them, in torch ops that inductor compiles into one kernel with
    the residual add that makes x. That kernel replaces the norm's, and no GEMV
    program makes x's planes itself (their layout conversions were a
    noticeable share of an int4 decode step).

    The planes are those of x g: the norm's 1/rms is one factor for all of x,
    which the GEMV applies to its sums, from the sums of squares per group
    returned here; so the reduction over all of x needs no kernel of its own.
    Returns (hi, lo, step, x_sum, squares): the int8 planes of x g, as
    _x_planes makes them, (K / group, group) in x's order; per group its step,
    sum of x g, and sum of x**2. The sum is x g's own, not its represented
    value's: that keeps inductor to one kernel, for an error up to 2.7x the
    representation's, far under bf16's rounding of norm(x) that it replaces
    (see the test)."""
    v, squares = _norm_input(x, norm_weight, group)
    step = v.abs().amax(1, keepdim=True).clamp(min=1e-30) * (1 / 127)
    inv = 1 / step
    hi = torch.floor(v * inv + 0.5)
    lo = torch.floor((v - hi * step) * (X_LO * inv) + 0.5)
    return hi.to(torch.int8), lo.to(torch.int8), step.reshape(-1), v.sum(1), squares


def int8_dp4a_config(w: torch.Tensor) -> tuple[int, int, int, int]:
    return config("8d", *w.shape, dp4a_block(w.shape[1]))


def int4_dp4a_config(codes: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int, int]:
    k = codes.shape[1] * 2
    return config("4d", codes.shape[0], k, k // scale.shape[1])


def uses_dp4a(x: torch.Tensor, codes: torch.Tensor, group: int | None = None) -> bool:
    """int8 (a scale per row or per group) or int4 codes, a half-precision x: the dp4a kernels."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if codes.dtype == torch.int8:
        return group in (32, 64, 128, 256) if group else dp4a_block(codes.shape[1]) is not None
    return codes.dtype == torch.uint8 and group in (32, 64, 128, 256)


def uses_fp8_half(x: torch.Tensor, w: torch.Tensor) -> bool:
    """fp8 e4m3 codes, a half-precision x, where PTX converts e4m3 pairs (sm_89+): the fp16x2 kernel."""
    if w.dtype != torch.float8_e4m3fn or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    block_k, split_k = config("8f", *w.shape)[1:3]
    fits = w.shape[1] % (block_k * split_k) == 0 and block_k % 16 == 0
    return fits and (not w.is_cuda or torch.cuda.get_device_capability(w.device) >= (8, 9))


def _launch_fp8_half(x, w, cfg, launch):
    n, k = w.shape
    block_n, block_k, split_k, warps = cfg
    out = torch.empty((split_k, n), device=w.device, dtype=torch.float32)
    pdl = early_launch(w.device)
    launch(_fp8_half_kernel)[(triton.cdiv(n, block_n), split_k)](
        x, w.view(torch.int32), w, out, n, k, k // split_k, BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRET=interpreted(), PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out


def _direct(kernel):
    return kernel


class _Skip:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _shapes_only(kernel):
    """A launcher that launches nothing: the ops' fake implementations run the
    launch code for the output it allocates."""
    return _Skip()


if triton is not None:
    # Custom ops, opaque to the compiler: they launch the kernels themselves
    # (with programmatic dependent launch, which inductor gives only its own
    # kernels) and run inside the compiled step's CUDA graph all the same.
    # Their block sizes are an argument, a constant in the traced graph: the
    # output's shape (SPLIT_K, N) depends on them, so a compiled graph cached
    # on disk must not outlive a change of the tuned table.
    def _gemv_op(name: str, launcher, schema: str):
        """The op `name` running `launcher`, whose fake implementation runs the
        same launch code for its output only."""
        op = torch.library.custom_op(f"brisklm::{name}", lambda *args: launcher(*args, _direct), mutates_args=(),
                                     schema=schema)
        op.register_fake(lambda *args: launcher(*args, _shapes_only))
        return op

    _scaled_gemv_op = _gemv_op("scaled_gemv", _launch_scaled,
                               "(Tensor x, Tensor w, Tensor? squares, float eps, int[] cfg) -> Tensor")
    _grouped_gemv_op = _gemv_op("grouped_gemv", _launch_grouped,
                                "(Tensor x, Tensor codes, Tensor scale, Tensor zero, int[] cfg) -> Tensor")
    _int8_dp4a_op = _gemv_op("int8_dp4a_gemv", _launch_int8_dp4a, "(Tensor x, Tensor w, int[] cfg) -> Tensor")
    _int8_group_dp4a_op = _gemv_op("int8_group_dp4a_gemv", _launch_int8_group_dp4a,
                                   "(Tensor x, Tensor w, Tensor scale, int[] cfg) -> Tensor")
    _int4_dp4a_op = _gemv_op("int4_dp4a_gemv", _launch_int4_dp4a,
                             "(Tensor x, Tensor codes, Tensor scale, Tensor zero, int[] cfg) -> Tensor")
    _int4_packed_op = _gemv_op("int4_packed_gemv", _launch_int4_packed,
                               "(Tensor hi, Tensor lo, Tensor step, Tensor x_sum, Tensor squares, float eps, "
                               "Tensor codes, Tensor scale, Tensor zero, int[] cfg) -> Tensor")
    _fp8_half_op = _gemv_op("fp8_half_gemv", _launch_fp8_half, "(Tensor x, Tensor w, int[] cfg) -> Tensor")
    _expert_gemv_op = _gemv_op("expert_gemv", _launch_expert,
                               "(Tensor x, Tensor w, Tensor? scale, Tensor? zero, Tensor expert, int[] cfg) -> Tensor")


def _run(op, launcher, *args):
    """The custom op where the compiler traces; elsewhere the same launch, directly
    (calling a custom op imports the compiler, a second of a warm start)."""
    return op(*args) if torch.compiler.is_compiling() else launcher(*args, _direct)


NORM_GROUP = 256  # inputs per sum of squares in norm_parts


def norm_parts(x: torch.Tensor, norm):
    """A bf16 (K,) vector x and the RMSNorm module `norm` before a bf16 GEMV,
    as the GEMV takes them: x g, and the sums of squares of x per group of
    NORM_GROUP inputs (all of x where K is not a multiple), from which the
    kernel scales its sums by the norm's 1/rms. In torch ops that inductor
    compiles into one kernel of K / NORM_GROUP programs with the residual add
    that makes x, where the norm was one program reducing over all of x
    between two GEMVs (a kernel that measured slower). (Groups of 256 or more keep inductor to one block size: under 256 it times
    several at the first run and its picks vary between compiles.) x g is
    rounded to bf16 once, where norm(x) rounds twice.

    The int8, fp8 and Q8_0 kernels measured no gain from the same fold; they
    apply the norm first, and int4 folds it into x's planes (pack_x)."""
    v, squares = _norm_input(x, norm.gain(), NORM_GROUP if x.numel() % NORM_GROUP == 0 else x.numel())
    return v.reshape(-1).to(x.dtype), squares, norm.eps


def scaled_gemv(x: torch.Tensor, w: torch.Tensor, norm=None) -> torch.Tensor:
    """(SPLIT_K, N) fp32 partial sums of w @ x for a (K,) vector x, or of
    w @ norm(x) for the RMSNorm module `norm`."""
    x, squares, eps = x.contiguous(), None, 0.0
    if norm is not None and x.dtype == w.dtype == torch.bfloat16:  # (an fp16 x g might overflow)
        x, squares, eps = norm_parts(x, norm)
    elif norm is not None:
        x = norm(x)
    if uses_dp4a(x, w):
        return _run(_int8_dp4a_op, _launch_int8_dp4a, x, w, list(int8_dp4a_config(w)))
    if uses_fp8_half(x, w):
        return _run(_fp8_half_op, _launch_fp8_half, x, w, list(config("8f", *w.shape)))
    return _run(_scaled_gemv_op, _launch_scaled, x, w, squares, eps, list(scaled_config(w)))


def grouped_gemv(x, codes, scale, zero, norm=None) -> torch.Tensor:
    """(SPLIT_K, N) fp32 partial sums of groupwise int4 or int8 weights times a
    (K,) vector x, or times norm(x) for an RMSNorm module `norm`."""
    x = x.contiguous()
    group = codes.shape[1] * (2 if codes.dtype == torch.uint8 else 1) // scale.shape[1]
    int4_dp4a = codes.dtype == torch.uint8 and uses_dp4a(x, codes, group)
    if int4_dp4a and norm is not None:  # the norm folded into x's planes (pack_x)
        hi, lo, step, x_sum, squares = pack_x(x, group, norm.gain())
        return _run(_int4_packed_op, _launch_int4_packed, hi, lo, step, x_sum, squares, norm.eps, codes, scale,
                    zero, list(int4_dp4a_config(codes, scale)))
    x = x if norm is None else norm(x)
    if int4_dp4a:
        return _run(_int4_dp4a_op, _launch_int4_dp4a, x, codes, scale, zero, list(int4_dp4a_config(codes, scale)))
    if uses_dp4a(x, codes, group):  # GGUF Q8_0 and mode q8_0
        return _run(_int8_group_dp4a_op, _launch_int8_group_dp4a, x, codes, scale,
                    list(config("8gd", *codes.shape, group)))
    return _run(_grouped_gemv_op, _launch_grouped, x, codes, scale, zero, list(grouped_config(codes, scale)))


def expert_gemv(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor, scale=None, zero=None):
    """(SPLIT_K, N) fp32 partial sums of x (K,) times the matrix at index
    `expert` (a (1,) integer tensor, on the device) of the stacked `w` (E, N,
    ...): the weights of an MoE layer's chosen expert, read where they lie,
    with no copy and no host read of the index. int4 codes (E, N, K/2) with
    scale and zero (E, N, K/G), and int8 codes (E, N, K) whose per-row scale
    the caller applies, through the dp4a kernels (a half-precision x); dense
    weights through the bf16 GEMV's kernel. None where no kernel serves."""
    x = x.contiguous()
    if w.dtype == torch.uint8:
        group = 2 * w.shape[-1] // scale.shape[-1]
        if not uses_dp4a(x, w, group):
            return None
        cfg = config("4d", w.shape[1], 2 * w.shape[2], group)
    elif w.dtype == torch.int8:
        if scale is not None or not uses_dp4a(x, w[0]):
            return None
        cfg = config("8d", *w.shape[1:], dp4a_block(w.shape[2]))
    elif w.dtype in (torch.bfloat16, torch.float16):
        cfg = config(16, *w.shape[1:])
    else:
        return None
    return _run(_expert_gemv_op, _launch_expert, x, w, scale, zero, expert, list(cfg))


def int4_gemv(x, packed, scale, zero, norm=None):
    """Partial sums for int4 codes (N, K/2) with scale and zero per group, times x or norm(x)."""
    return grouped_gemv(x, packed, scale, zero, norm)


def int8_group_gemv(x, q, scale):
    """Partial sums for int8 codes (N, K) with a scale per group (GGUF Q8_0)."""
    return grouped_gemv(x, q, scale, scale)  # no zero: the kernel does not read it
