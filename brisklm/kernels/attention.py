"""Attention for one new token (or a few) against the KV cache, in Triton (split-K decoding).

At batch 1 a decode step's attention reads each cached key and value once,
and for short contexts it is all launch latency: flex attention spends three
kernels (plus block-mask indexing) on it. Here one program owns one KV head
with its whole group of query heads (grouped-query attention reads each key
once for the group) and one of NUM_SPLITS slices of the filled positions.
The filled length is read on the device (input_pos + 1), so the same kernel
serves every step of a CUDA graph, and the slices grow with the length: the
positions not yet written cost nothing. With NUM_SPLITS > 1 each slice
writes its normalized output and log-sum-exp, and a second kernel combines
the slices that held positions.

The kernel also does what came before attention: the per-head RMSNorm of
the new query and key where the model has one (Qwen3, Gemma 3), RoPE on
them, and storing the new key and value in the cache (the slice that holds
the new position does it, and attends to them from registers), so the
projections go straight from the qkv GEMV to this kernel.

The cache may hold int8 codes with a scale per position and head: the key
scale multiplies the scores and the value scale the probabilities, so the
codes go to the tensor cores as they are, widened only to bf16.

A few new tokens at once (a speculative verify step, a short prompt) take
_rows_kernel: the same slicing, with each program's query rows the (token,
head) pairs of its group, so the keys are still read once for all of them.

The same launchers run under TRITON_INTERPRET=1 on CPU tensors (the tests).
"""
from __future__ import annotations

import math

import torch

from . import interpreted
from .gemv import _direct, _shapes_only, available, early_launch, triton

if triton is not None:  # without triton (CPU wheels) only supported() is used, and says no
    import triton.language as tl

    from .gemv import _await_inputs

    @triton.jit
    def _online(scores, m, denom, ROWS: tl.constexpr):
        """One block's step of the online softmax (base 2): the new running max,
        the factor for what was summed before, the block's weights and the new
        denominator. With ROWS, a row that has seen nothing yet (its max still
        -inf) gets weights 0, not NaN: a few-token step's windows can leave a
        row a block with no visible key (one token's never do)."""
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if ROWS else m_new
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        return m_new, alpha, p, denom * alpha + tl.sum(p, axis=1)

    @triton.jit
    def _head_norm(x1, x2, w_ptr, eps, AXIS: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr):
        """The RMSNorm over each head (its halves x1, x2 along AXIS) with weight
        w, rounded as model.RMSNorm rounds: w times x / rms rounded, or with an
        OFFSET (Gemma's 1 + w) x / rms times (1 + w) in fp32, rounded once."""
        if NORM:
            dtype = x1.dtype
            x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
            half = tl.arange(0, x1.shape[AXIS])
            w1 = tl.load(w_ptr + half).to(tl.float32) + OFFSET
            w2 = tl.load(w_ptr + x1.shape[AXIS] + half).to(tl.float32) + OFFSET
            inv = tl.rsqrt((tl.sum(x1 * x1, axis=AXIS) + tl.sum(x2 * x2, axis=AXIS)) / (2 * x1.shape[AXIS]) + eps)
            if AXIS == 1:
                inv, w1, w2 = inv[:, None], w1[None, :], w2[None, :]
            x1, x2 = x1 * inv, x2 * inv
            if OFFSET == 0.0:
                x1, x2 = x1.to(dtype).to(tl.float32), x2.to(dtype).to(tl.float32)
            x1, x2 = (x1 * w1).to(dtype), (x2 * w2).to(dtype)
        return x1, x2

    @triton.jit
    def _queries(q_ptrs, ok, cos, sin, qw_ptr, eps, F32: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr):
        """Query rows (at q_ptrs, masked by ok) normed (NORM) and RoPE'd, in
        halves; in fp32 for fp32 models and the interpreter (whose bf16
        tl.dot is wrong)."""
        q1, q2 = _head_norm(tl.load(q_ptrs, mask=ok, other=0.0), tl.load(q_ptrs + cos.shape[1], mask=ok, other=0.0),
                            qw_ptr, eps, 1, NORM, OFFSET)
        q1, q2 = _rope(q1, q2, cos, sin, q_ptrs.dtype.element_ty)
        if F32:
            q1, q2 = q1.to(tl.float32), q2.to(tl.float32)
        return q1, q2

    @triton.jit
    def _attend_cached(q1, q2, k_ptr, v_ptr, ks_ptr, vs_ptr, row0, first, cached_end, q_lo,
                       D: tl.constexpr, QK_SCALE: tl.constexpr, BLOCK_S: tl.constexpr, MAX_BLOCKS: tl.constexpr,
                       INT8: tl.constexpr, F32: tl.constexpr, ROWS: tl.constexpr, INTERPRET: tl.constexpr):
        """The online softmax's state (max, denominator, output sums) of the
        query rows over the cached positions first..cached_end-1 of a slice."""
        m = tl.full((q1.shape[0],), float("-inf"), tl.float32)
        denom = tl.zeros((q1.shape[0],), tl.float32)
        acc = tl.zeros((q1.shape[0], D), tl.float32)
        s = tl.arange(0, BLOCK_S)
        if INTERPRET:  # no runtime loop bounds there: a constant trip count, empty blocks skipped
            for i in range(MAX_BLOCKS):
                start = first + i * BLOCK_S
                if start < cached_end:
                    m, denom, acc = _attend(q1, q2, k_ptr, v_ptr, ks_ptr, vs_ptr, row0 + start + s,
                                            start + s < cached_end, m, denom, acc, start + s, q_lo,
                                            D, QK_SCALE, INT8, F32, ROWS)
        else:
            for start in tl.range(first, cached_end, BLOCK_S):
                m, denom, acc = _attend(q1, q2, k_ptr, v_ptr, ks_ptr, vs_ptr, row0 + start + s,
                                        start + s < cached_end, m, denom, acc, start + s, q_lo,
                                        D, QK_SCALE, INT8, F32, ROWS)
        return m, denom, acc

    @triton.jit
    def _store_slice(acc, m, denom, o_ptr, lse_ptr, out_rows, ok, D: tl.constexpr, NUM_SPLITS: tl.constexpr):
        """A slice's normalized output at rows out_rows of (splits x rows, D), and
        its log-sum-exp for the combine."""
        filled = denom > 0  # false in the slices past the filled length
        safe = tl.where(filled, denom, 1.0)
        out = acc / safe[:, None]
        d = tl.arange(0, D)
        tl.store(o_ptr + out_rows[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=ok[:, None])
        if NUM_SPLITS > 1:  # natural log
            lse = tl.where(filled, m / 1.4426950408889634 + tl.log(safe), float("-inf"))
            tl.store(lse_ptr + out_rows, lse, mask=ok)

    @triton.jit
    def _attend(q1, q2, k_ptr, v_ptr, ks_ptr, vs_ptr, rows, ok, m, denom, acc, key_pos, q_lo,
                D: tl.constexpr, QK_SCALE: tl.constexpr, INT8: tl.constexpr, F32: tl.constexpr,
                ROWS: tl.constexpr):
        """Online softmax over one block of cached positions (rows, masked by ok).
        Queries and keys come in halves, as RoPE rotates them. With ROWS (a
        few new tokens' queries), each query row sees only the keys at or past
        its own window's start q_lo (key_pos: the block's positions)."""
        half, d = tl.arange(0, D // 2), tl.arange(0, D)
        k_rows = k_ptr + rows[:, None] * D
        k1 = tl.load(k_rows + half[None, :], mask=ok[:, None], other=0).to(q1.dtype)  # int8 is exact in bf16
        k2 = tl.load(k_rows + D // 2 + half[None, :], mask=ok[:, None], other=0).to(q1.dtype)
        v = tl.load(v_ptr + rows[:, None] * D + d[None, :], mask=ok[:, None], other=0).to(q1.dtype)
        precision: tl.constexpr = "ieee" if F32 else None
        scores = tl.dot(q1, tl.trans(k1), input_precision=precision)
        scores = (scores + tl.dot(q2, tl.trans(k2), input_precision=precision)) * QK_SCALE
        if INT8:
            scores *= tl.load(ks_ptr + rows, mask=ok, other=0.0).to(tl.float32)[None, :]
        if ROWS:
            scores = tl.where(ok[None, :] & (key_pos[None, :] >= q_lo[:, None]), scores, float("-inf"))
        else:
            scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new, alpha, p, denom = _online(scores, m, denom, ROWS)
        if INT8:
            p *= tl.load(vs_ptr + rows, mask=ok, other=0.0).to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q1.dtype), v, input_precision=precision)
        return m_new, denom, acc

    @triton.jit
    def _rope(x1, x2, cos, sin, dtype):
        """The half-split rotation, in fp32, rounded to the model's dtype as the reference does."""
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)

    @triton.jit
    def _round(x):
        """Round half to even, as torch.round (for |x| < 2**22): adding 1.5 * 2**23
        leaves no fraction bits."""
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def _split_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, o_ptr, lse_ptr, S, H,
                      qw_ptr, kw_ptr, eps, WINDOW, NORM: tl.constexpr, OFFSET: tl.constexpr, QK_SCALE: tl.constexpr,
                      G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK_S: tl.constexpr, NUM_SPLITS: tl.constexpr, MAX_BLOCKS: tl.constexpr,
                      INT8: tl.constexpr, F32: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
        _await_inputs(PDL)
        kv_head, split = tl.program_id(0), tl.program_id(1)
        pos = tl.load(pos_ptr)  # the new token's; the cache holds positions 0..pos-1
        lo = tl.maximum(pos + 1 - WINDOW, 0)  # the first position a sliding window keeps
        blocks_per_split = tl.cdiv(tl.cdiv(pos + 1 - lo, BLOCK_S), NUM_SPLITS)
        first = lo + split * blocks_per_split * BLOCK_S
        end = tl.minimum(first + blocks_per_split * BLOCK_S, pos + 1)
        g, half = tl.arange(0, G_PAD), tl.arange(0, D // 2)
        heads = kv_head * G + g
        dtype = qkv_ptr.dtype.element_ty
        cos, sin = tl.load(cos_ptr + half), tl.load(sin_ptr + half)
        q1, q2 = _queries(qkv_ptr + heads[:, None] * D + half[None, :], (g < G)[:, None], cos[None, :], sin[None, :],
                          qw_ptr, eps, F32, NORM, OFFSET)
        row0 = kv_head * S
        m, denom, acc = _attend_cached(q1, q2, k_ptr, v_ptr, ks_ptr, vs_ptr, row0, first, tl.minimum(end, pos), 0,
                                       D, QK_SCALE, BLOCK_S, MAX_BLOCKS, INT8, F32, False, INTERPRET)
        if (first <= pos) & (pos < end):  # this slice holds the new token: store it, attend to it
            k_ptrs = qkv_ptr + (H + kv_head) * D + half
            k1, k2 = _head_norm(tl.load(k_ptrs), tl.load(k_ptrs + D // 2), kw_ptr, eps, 0, NORM, OFFSET)
            k1, k2 = _rope(k1, k2, cos, sin, dtype)
            k1, k2 = k1.to(tl.float32), k2.to(tl.float32)
            d = tl.arange(0, D)
            v = tl.load(qkv_ptr + (H + H // G + kv_head) * D + d).to(tl.float32)
            cache_row = (row0 + pos) * D
            if INT8:  # codes from the fp32 scale; the scale is kept in the model's dtype
                k_scale = tl.maximum(tl.maximum(tl.max(tl.abs(k1), axis=0), tl.max(tl.abs(k2), axis=0)), 1e-8) / 127
                v_scale = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-8) / 127
                k1, k2, v = _round(k1 / k_scale), _round(k2 / k_scale), _round(v / v_scale)
                tl.store(k_ptr + cache_row + half, k1.to(tl.int8))
                tl.store(k_ptr + cache_row + D // 2 + half, k2.to(tl.int8))
                tl.store(v_ptr + cache_row + d, v.to(tl.int8))
                k_scale, v_scale = k_scale.to(dtype), v_scale.to(dtype)
                tl.store(ks_ptr + row0 + pos, k_scale)
                tl.store(vs_ptr + row0 + pos, v_scale)
                # attend to what later steps will read back
                k1 = (k1 * k_scale.to(tl.float32)).to(dtype).to(tl.float32)
                k2 = (k2 * k_scale.to(tl.float32)).to(dtype).to(tl.float32)
                v = (v * v_scale.to(tl.float32)).to(dtype).to(tl.float32)
            else:
                tl.store(k_ptr + cache_row + half, k1.to(dtype))
                tl.store(k_ptr + cache_row + D // 2 + half, k2.to(dtype))
                tl.store(v_ptr + cache_row + d, v.to(dtype))
            score = tl.sum(q1.to(tl.float32) * k1[None, :], axis=1) + tl.sum(q2.to(tl.float32) * k2[None, :], axis=1)
            score *= QK_SCALE
            m_new = tl.maximum(m, score)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(score - m_new)
            denom = denom * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v[None, :]
            m = m_new
        _store_slice(acc, m, denom, o_ptr, lse_ptr, split * H + heads, g < G, D, NUM_SPLITS)

    @triton.jit
    def _rows_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, o_ptr, lse_ptr, S, H,
                     qw_ptr, kw_ptr, eps, T, WINDOW, NORM: tl.constexpr, OFFSET: tl.constexpr, QK_SCALE: tl.constexpr,
                     G: tl.constexpr, QROWS: tl.constexpr, T_PAD: tl.constexpr,
                     D: tl.constexpr, BLOCK_S: tl.constexpr, NUM_SPLITS: tl.constexpr, MAX_BLOCKS: tl.constexpr,
                     INT8: tl.constexpr, F32: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
        """_split_kernel for T new tokens at positions pos..pos+T-1 (a
        speculative verify step, a short prompt): the query rows of a program
        are (token, head of the group) pairs, a chunk of the tokens (grid axis
        2). The cached positions 0..pos-1 are sliced as for one token; the
        slice that holds pos also takes the T new keys, RoPE'd from the
        projections in registers, stores them (chunk 0 does) and attends to
        them causally."""
        _await_inputs(PDL)
        kv_head, split, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        pos = tl.load(pos_ptr)  # the first new token's; the cache holds positions 0..pos-1
        lo = tl.maximum(pos + 1 - WINDOW, 0)  # the first position the first token's window keeps
        blocks_per_split = tl.cdiv(tl.cdiv(pos + 1 - lo, BLOCK_S), NUM_SPLITS)
        first = lo + split * blocks_per_split * BLOCK_S
        end = tl.minimum(first + blocks_per_split * BLOCK_S, pos + 1)
        r, half = tl.arange(0, QROWS), tl.arange(0, D // 2)
        per_chunk: tl.constexpr = QROWS // G
        t = chunk * per_chunk + r // G  # each query row's token
        valid = (r < per_chunk * G) & (t < T)
        heads = kv_head * G + r % G
        q_lo = tl.maximum(pos + t + 1 - WINDOW, 0)  # each row's window start
        stride = (H + 2 * (H // G)) * D  # of qkv's rows
        dtype = qkv_ptr.dtype.element_ty
        cos = tl.load(cos_ptr + t[:, None] * (D // 2) + half[None, :], mask=valid[:, None], other=1.0)
        sin = tl.load(sin_ptr + t[:, None] * (D // 2) + half[None, :], mask=valid[:, None], other=0.0)
        q1, q2 = _queries(qkv_ptr + t[:, None] * stride + heads[:, None] * D + half[None, :], valid[:, None], cos, sin,
                          qw_ptr, eps, F32, NORM, OFFSET)
        row0 = kv_head * S
        m, denom, acc = _attend_cached(q1, q2, k_ptr, v_ptr, ks_ptr, vs_ptr, row0, first, tl.minimum(end, pos), q_lo,
                                       D, QK_SCALE, BLOCK_S, MAX_BLOCKS, INT8, F32, True, INTERPRET)
        if (first <= pos) & (pos < end):  # this slice holds the new tokens: store them, attend to them
            u = tl.arange(0, T_PAD)  # the new tokens, as keys
            new = u < T
            d = tl.arange(0, D)
            k_cos = tl.load(cos_ptr + u[:, None] * (D // 2) + half[None, :], mask=new[:, None], other=1.0)
            k_sin = tl.load(sin_ptr + u[:, None] * (D // 2) + half[None, :], mask=new[:, None], other=0.0)
            k_ptrs = qkv_ptr + u[:, None] * stride + (H + kv_head) * D + half[None, :]
            k1, k2 = _head_norm(tl.load(k_ptrs, mask=new[:, None], other=0.0),
                                tl.load(k_ptrs + D // 2, mask=new[:, None], other=0.0), kw_ptr, eps, 1, NORM, OFFSET)
            k1, k2 = _rope(k1, k2, k_cos, k_sin, dtype)
            k1, k2 = k1.to(tl.float32), k2.to(tl.float32)
            v = tl.load(qkv_ptr + u[:, None] * stride + (H + H // G + kv_head) * D + d[None, :],
                        mask=new[:, None], other=0.0).to(tl.float32)
            cache_rows = row0 + pos + u
            store = new & (pos + u < S) & (u >= chunk * T_PAD)  # (true in chunk 0 only: u < T_PAD)
            if INT8:  # codes from the fp32 scale; the scale is kept in the model's dtype
                k_scale = tl.maximum(tl.maximum(tl.max(tl.abs(k1), axis=1), tl.max(tl.abs(k2), axis=1)), 1e-8) / 127
                v_scale = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-8) / 127
                k1, k2 = _round(k1 / k_scale[:, None]), _round(k2 / k_scale[:, None])
                v = _round(v / v_scale[:, None])
                tl.store(k_ptr + cache_rows[:, None] * D + half[None, :], k1.to(tl.int8), mask=store[:, None])
                tl.store(k_ptr + cache_rows[:, None] * D + D // 2 + half[None, :], k2.to(tl.int8),
                         mask=store[:, None])
                tl.store(v_ptr + cache_rows[:, None] * D + d[None, :], v.to(tl.int8), mask=store[:, None])
                k_scale, v_scale = k_scale.to(dtype), v_scale.to(dtype)
                tl.store(ks_ptr + cache_rows, k_scale, mask=store)
                tl.store(vs_ptr + cache_rows, v_scale, mask=store)
                # attend to what later steps will read back
                k1 = (k1 * k_scale.to(tl.float32)[:, None]).to(dtype).to(tl.float32)
                k2 = (k2 * k_scale.to(tl.float32)[:, None]).to(dtype).to(tl.float32)
                v = (v * v_scale.to(tl.float32)[:, None]).to(dtype).to(tl.float32)
            else:
                tl.store(k_ptr + cache_rows[:, None] * D + half[None, :], k1.to(dtype), mask=store[:, None])
                tl.store(k_ptr + cache_rows[:, None] * D + D // 2 + half[None, :], k2.to(dtype),
                         mask=store[:, None])
                tl.store(v_ptr + cache_rows[:, None] * D + d[None, :], v.to(dtype), mask=store[:, None])
            # (every value here is one of the model's dtype: exact in q1's)
            precision: tl.constexpr = "ieee" if F32 else None
            scores = tl.dot(q1, tl.trans(k1.to(q1.dtype)), input_precision=precision)
            scores = (scores + tl.dot(q2, tl.trans(k2.to(q1.dtype)), input_precision=precision)) * QK_SCALE
            seen = new[None, :] & (u[None, :] <= t[:, None]) & (pos + u[None, :] >= q_lo[:, None])
            scores = tl.where(seen, scores, float("-inf"))
            m_new, alpha, p, denom = _online(scores, m, denom, True)
            acc = acc * alpha[:, None] + tl.dot(p.to(q1.dtype), v.to(q1.dtype), input_precision=precision)
            m = m_new
        # (token, head) rows of (splits, T * H, D)
        _store_slice(acc, m, denom, o_ptr, lse_ptr, split * T * H + t * H + heads, valid, D, NUM_SPLITS)

    @triton.jit
    def _combine_kernel(o_ptr, lse_ptr, out_ptr, H, D: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
        _await_inputs(PDL)
        head = tl.program_id(0)
        sp, d = tl.arange(0, NUM_SPLITS), tl.arange(0, D)
        lse = tl.load(lse_ptr + sp * H + head)
        used = lse > float("-inf")  # slices that held positions; the rest are not read
        weight = tl.where(used, tl.exp(lse - tl.max(lse, axis=0)), 0.0)
        o = tl.load(o_ptr + (sp * H + head)[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        out = tl.sum(o * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(out_ptr + head * D + d, out.to(out_ptr.dtype.element_ty))


# Launch settings, chosen by benchmarks/attention_check.py --sweep on an H200.
BLOCK_S, NUM_WARPS, NUM_STAGES, MAX_SPLITS, POSITIONS_PER_SPLIT = 64, 4, 3, 32, 256


def num_splits(max_seq_length: int) -> int:
    """Slices per KV head: enough programs to stream a full cache at the memory's
    speed (POSITIONS_PER_SPLIT positions each), a power of two up to MAX_SPLITS
    (one or two waves of programs at 8 KV heads: more cost more than they balance)."""
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(max_seq_length, POSITIONS_PER_SPLIT)))


# decode_attention's qk_norm where the model has no q/k norms: (q weight, k weight, eps, offset)
NO_NORM = (None, None, 0.0, 0.0)

# The most new tokens a step may bring (a verify step's drafts + 1; a short prompt: its graph,
# up to the 64-token bucket, needs no mask, so the block-compiled steps serve it).
MAX_TOKENS = 64


def supported(device: torch.device, batch: int, tokens: int, head_dim: int) -> bool:
    """Whether the kernels can serve this step: one sequence, up to MAX_TOKENS
    new tokens, and heads whose halves (RoPE's rotation pairs) fill a
    tensor-core dot (K >= 16)."""
    return (available(device) and batch == 1 and 1 <= tokens <= MAX_TOKENS and head_dim >= 32
            and head_dim & (head_dim - 1) == 0)


def _launch(qkv, cos, sin, k, v, k_scale, v_scale, input_pos, window, scale, launch, qk_norm=NO_NORM):
    n_kv, max_len, d = k.shape[1:]
    tokens = qkv.shape[0] if qkv.dim() == 2 else 1
    n_heads = qkv.shape[-1] // d - 2 * n_kv
    group = n_heads // n_kv
    splits, block = num_splits(max_len), BLOCK_S
    int8 = k.dtype == torch.int8
    dtype = qkv.dtype
    out = torch.empty((1, tokens, n_heads * d), device=qkv.device, dtype=dtype)
    rows = tokens * n_heads  # (token, head) pairs
    partial = out if splits == 1 else torch.empty((splits, rows, d), device=qkv.device, dtype=torch.float32)
    lse = torch.empty((splits, rows), device=qkv.device, dtype=torch.float32)
    max_blocks = triton.cdiv(triton.cdiv(max_len, block), splits)
    interpret = interpreted()
    pdl = early_launch(qkv.device)
    common = dict(QK_SCALE=1.4426950408889634 * (scale or 1 / math.sqrt(d)),  # softmax in base 2
                  D=d, BLOCK_S=block, NUM_SPLITS=splits, MAX_BLOCKS=max_blocks, INT8=int8,
                  F32=dtype == torch.float32 or interpret, INTERPRET=interpret, PDL=pdl,
                  num_warps=NUM_WARPS, num_stages=NUM_STAGES, launch_pdl=pdl)
    q_weight, k_weight, eps, offset = qk_norm
    common.update(NORM=q_weight is not None, OFFSET=float(offset))
    q_weight, k_weight = (cos, cos) if q_weight is None else (q_weight, k_weight)  # (cos: an unread pointer)
    args = (qkv, cos, sin, k, v, k_scale, v_scale, input_pos, partial, lse, max_len, n_heads, q_weight, k_weight, eps)
    window = min(window or max_len, max_len)
    if tokens == 1:
        launch(_split_kernel)[(n_kv, splits)](*args, window, G=group, G_PAD=max(16, triton.next_power_of_2(group)),
                                              **common)
    else:  # query rows: (token, head) pairs of a group, QROWS a program, up to 64 (or one group)
        qrows = min(max(16, triton.next_power_of_2(tokens * group)), max(64, triton.next_power_of_2(group)))
        chunks = triton.cdiv(tokens, qrows // group)
        launch(_rows_kernel)[(n_kv, splits, chunks)](*args, tokens, window, G=group, QROWS=qrows,
                                                     T_PAD=max(16, triton.next_power_of_2(tokens)), **common)
    if splits > 1:
        launch(_combine_kernel)[(rows,)](partial, lse, out, rows, D=d, NUM_SPLITS=splits, PDL=pdl,
                                         num_warps=4, launch_pdl=pdl)
    return out


if triton is not None:  # opaque custom ops, as the GEMVs (kernels/gemv.py)
    @torch.library.custom_op("brisklm::decode_attention", mutates_args=("k", "v"))
    def _decode_attention_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, input_pos: torch.Tensor, window: int, scale: float,
                             q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                             offset: float) -> torch.Tensor:
        return _launch(qkv, cos, sin, k, v, k, v, input_pos, window, scale, _direct,  # no scales to read
                       (q_weight, k_weight, eps, offset))

    @_decode_attention_op.register_fake
    def _(qkv, cos, sin, k, v, input_pos, window, scale, q_weight, k_weight, eps, offset):
        return _launch(qkv, cos, sin, k, v, k, v, input_pos, window, scale, _shapes_only)

    @torch.library.custom_op("brisklm::decode_attention_int8", mutates_args=("k", "v", "k_scale", "v_scale"))
    def _decode_attention_int8_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                                  input_pos: torch.Tensor, window: int, scale: float,
                                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                                  offset: float) -> torch.Tensor:
        return _launch(qkv, cos, sin, k, v, k_scale, v_scale, input_pos, window, scale, _direct,
                       (q_weight, k_weight, eps, offset))

    @_decode_attention_int8_op.register_fake
    def _(qkv, cos, sin, k, v, k_scale, v_scale, input_pos, window, scale, q_weight, k_weight, eps, offset):
        return _launch(qkv, cos, sin, k, v, k_scale, v_scale, input_pos, window, scale, _shapes_only)


def decode_attention(qkv, cos, sin, k, v, input_pos, k_scale=None, v_scale=None,
                     window: int | None = None, scale: float | None = None, qk_norm=NO_NORM) -> torch.Tensor:
    """The attention of T (up to MAX_TOKENS) new tokens at positions
    input_pos[0].. : per-head norms of their queries and keys (qk_norm), RoPE
    on them, their keys and values stored in the cache, then causal
    attention, each over positions 0..its own (with a sliding window, the
    last `window` of them).

    qkv: the tokens' projections, (H + 2 Hkv) * D for one token or
    (T, (H + 2 Hkv) * D), q heads, then k, then v, before RoPE; cos, sin:
    (D/2,) or (T, D/2) fp32 for those positions; k, v: the cache
    (1, Hkv, S, D) in qkv's dtype, or int8 codes with k_scale, v_scale
    (1, Hkv, S, 1), written in place; scale: the scores' factor (default
    D**-0.5); qk_norm: (q weight (D,), k weight (D,), eps, offset) of
    RMSNorms over each head (offset: Gemma's 1 + w), NO_NORM for none. Returns (1, T, H * D)
    in qkv's dtype."""
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    window, scale = window or 0, scale or 0.0
    if not torch.compiler.is_compiling():  # (a custom op's call imports the compiler)
        return _launch(qkv, cos, sin, k, v, k if k_scale is None else k_scale, v if v_scale is None else v_scale,
                       input_pos, window, scale, _direct, qk_norm)
    if k_scale is None:
        return _decode_attention_op(qkv, cos, sin, k, v, input_pos, window, scale, *qk_norm)
    return _decode_attention_int8_op(qkv, cos, sin, k, v, k_scale, v_scale, input_pos, window, scale, *qk_norm)
