"""Attention for one new token against the KV cache, in Triton (split-K decoding).

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

The cache may hold int8 codes with a scale per position and head: the key
scale multiplies the scores and the value scale the probabilities, so the
codes go to the tensor cores as they are, widened only to bf16.

The same launchers run under TRITON_INTERPRET=1 on CPU tensors (the tests).
"""
from __future__ import annotations

import math
import os

import torch

from .gemv import _direct, available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _attend(q, k_ptr, v_ptr, ks_ptr, vs_ptr, rows, ok, d, m, denom, acc,
                QK_SCALE: tl.constexpr, INT8: tl.constexpr, F32: tl.constexpr):
        """Online softmax over one block of positions (rows, masked by ok)."""
        k = tl.load(k_ptr + rows[:, None] * d.shape[0] + d[None, :], mask=ok[:, None], other=0)
        v = tl.load(v_ptr + rows[:, None] * d.shape[0] + d[None, :], mask=ok[:, None], other=0)
        k, v = k.to(q.dtype), v.to(q.dtype)  # int8 codes are exact in bf16
        scores = tl.dot(q, tl.trans(k), input_precision="ieee" if F32 else None) * QK_SCALE
        if INT8:
            scores *= tl.load(ks_ptr + rows, mask=ok, other=0.0).to(tl.float32)[None, :]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        if INT8:
            p *= tl.load(vs_ptr + rows, mask=ok, other=0.0).to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee" if F32 else None)
        return m_new, denom, acc

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, o_ptr, lse_ptr, S, H, WINDOW,
                      QK_SCALE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK_S: tl.constexpr, NUM_SPLITS: tl.constexpr, MAX_BLOCKS: tl.constexpr,
                      INT8: tl.constexpr, F32: tl.constexpr, INTERPRET: tl.constexpr):
        kv_head, split = tl.program_id(0), tl.program_id(1)
        length = tl.load(pos_ptr) + 1
        lo = tl.maximum(length - WINDOW, 0)  # the first position a sliding window keeps
        blocks_per_split = tl.cdiv(tl.cdiv(length - lo, BLOCK_S), NUM_SPLITS)
        first = lo + split * blocks_per_split * BLOCK_S
        end = tl.minimum(first + blocks_per_split * BLOCK_S, length)
        g, d, s = tl.arange(0, G_PAD), tl.arange(0, D), tl.arange(0, BLOCK_S)
        heads = kv_head * G + g
        q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
        if F32:  # fp32 models, and the interpreter (whose bf16 tl.dot is wrong)
            q = q.to(tl.float32)
        m = tl.full((G_PAD,), float("-inf"), tl.float32)
        denom = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        row0 = kv_head * S
        if INTERPRET:  # no runtime loop bounds there: a constant trip count, empty blocks skipped
            for i in range(MAX_BLOCKS):
                start = first + i * BLOCK_S
                if start < end:
                    m, denom, acc = _attend(q, k_ptr, v_ptr, ks_ptr, vs_ptr, row0 + start + s, start + s < end,
                                            d, m, denom, acc, QK_SCALE, INT8, F32)
        else:
            for start in tl.range(first, end, BLOCK_S):
                m, denom, acc = _attend(q, k_ptr, v_ptr, ks_ptr, vs_ptr, row0 + start + s, start + s < end,
                                        d, m, denom, acc, QK_SCALE, INT8, F32)
        filled = denom > 0  # false in the slices past the filled length
        safe = tl.where(filled, denom, 1.0)
        out = acc / safe[:, None]
        o_ptrs = o_ptr + (split * H + heads)[:, None] * D + d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(g < G)[:, None])
        if NUM_SPLITS > 1:  # natural log, for the combine
            lse = tl.where(filled, m / 1.4426950408889634 + tl.log(safe), float("-inf"))
            tl.store(lse_ptr + split * H + heads, lse, mask=g < G)

    @triton.jit
    def _combine_kernel(o_ptr, lse_ptr, out_ptr, H, D: tl.constexpr, NUM_SPLITS: tl.constexpr):
        head = tl.program_id(0)
        sp, d = tl.arange(0, NUM_SPLITS), tl.arange(0, D)
        lse = tl.load(lse_ptr + sp * H + head)
        used = lse > float("-inf")  # slices that held positions; the rest are not read
        weight = tl.where(used, tl.exp(lse - tl.max(lse, axis=0)), 0.0)
        o = tl.load(o_ptr + (sp * H + head)[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        out = tl.sum(o * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(out_ptr + head * D + d, out.to(out_ptr.dtype.element_ty))


def num_splits(max_seq_length: int) -> int:
    """Slices per KV head: enough programs to stream a full cache at the memory's
    speed (about 256 positions each), a power of two up to 64."""
    return min(64, triton.next_power_of_2(triton.cdiv(max_seq_length, 256)))


def supported(device: torch.device, batch: int, tokens: int, head_dim: int) -> bool:
    """Whether the kernel can serve this step: one sequence, one new token."""
    return (available(device) and batch == 1 and tokens == 1 and head_dim >= 16
            and head_dim & (head_dim - 1) == 0)


def _launch(q, k, v, k_scale, v_scale, input_pos, window, launch):
    _, n_heads, _, d = q.shape
    n_kv, max_len = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    splits, block = num_splits(max_len), 64
    int8 = k.dtype == torch.int8
    dtype = q.dtype
    out = torch.empty((1, n_heads, 1, d), device=q.device, dtype=dtype)
    partial = out if splits == 1 else torch.empty((splits, n_heads, d), device=q.device, dtype=torch.float32)
    lse = torch.empty((splits, n_heads), device=q.device, dtype=torch.float32)
    max_blocks = triton.cdiv(triton.cdiv(max_len, block), splits)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    launch(_split_kernel)[(n_kv, splits)](
        q, k, v, k_scale, v_scale, input_pos, partial, lse, max_len, n_heads, min(window or max_len, max_len),
        QK_SCALE=1.4426950408889634 / math.sqrt(d),  # softmax in base 2
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK_S=block,
        NUM_SPLITS=splits, MAX_BLOCKS=max_blocks, INT8=int8, F32=dtype == torch.float32 or interpret,
        INTERPRET=interpret,
        num_warps=4)
    if splits > 1:
        launch(_combine_kernel)[(n_heads,)](partial, lse, out, n_heads, D=d, NUM_SPLITS=splits,
                                            num_warps=4)
    return out


if triton is not None and hasattr(torch.library, "triton_op"):
    from torch.library import triton_op, wrap_triton

    @triton_op("brisklm::decode_attention", mutates_args={})
    def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                             v_scale: torch.Tensor, input_pos: torch.Tensor, window: int) -> torch.Tensor:
        return _launch(q, k, v, k_scale, v_scale, input_pos, window, wrap_triton)


def decode_attention(q, k, v, input_pos, k_scale=None, v_scale=None, window: int | None = None) -> torch.Tensor:
    """Causal attention of one query token at position input_pos (shape (1,))
    over the cache's positions 0..input_pos (with a sliding window, the last
    `window` of them).

    q: (1, H, 1, D); k, v: (1, Hkv, S, D) in q's dtype, or int8 codes with
    k_scale, v_scale (1, Hkv, S, 1). Returns (1, H, 1, D) in q's dtype."""
    k_scale = k if k_scale is None else k_scale  # not read without int8
    v_scale = v if v_scale is None else v_scale
    args = (q.contiguous(), k, v, k_scale, v_scale, input_pos, window or 0)
    if q.is_cuda and hasattr(torch.library, "triton_op"):
        return _decode_attention_op(*args)
    return _launch(*args, _direct)
