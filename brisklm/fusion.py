"""The GPU decode path as one transform of a built model: `fuse_for_decode`.

model.py is the plain forward (norm, then Linear; attention over the cache
with PyTorch ops). On NVIDIA GPUs this pass swaps in our Triton kernels, the
only place a kernel route is chosen:

- every Linear becomes a FusedLinear: one token goes through a batch-1 GEMV
  (kernels/gemv.py) that reads the weight in its stored format, 2..FEW_ROWS
  tokens of a quantized weight (2..DENSE_ROWS of a dense one) through
  kernels/matmul.py, and anything else through the format's own forward;
  each format's kernels are its Route, registered in ROUTES (a new format
  registers one, or runs its own forward);
- the RMSNorm before wqkv, w13 and the output layer moves into that Linear
  (the model's norm becomes a pass-through), where the bf16 and int4 GEMVs
  apply it inside the kernel (no kernel between two GEMVs that reduces over
  all of x); the other routes apply it first;
- an MoE layer's experts' Linears too: one token's chosen experts are
  read in place from the stacked weights, at their index on the device
  (FusedLinear.expert_forward, gemv.expert_gemv), where the plain format
  copies each one out first; a few tokens that together choose every
  expert read all the w13 matrices in one launch and all the w2 matrices
  in another, each expert with its own tokens' rows, where an expert no
  token chose is not read (FusedLinear.experts_forward);
- Attention becomes FusedAttention (the same modules): one token's RoPE, cache write and
  attention in one kernel (kernels/attention.py) that reads the filled
  length on the device, so a decode step needs no host value and replays
  from a CUDA graph uncompiled.

On other devices (CPUs, AMD, Apple) it changes nothing: the kernels use
NVIDIA's PTX. `brisk ... --no_fused_kernels` (load(fused_kernels=False))
skips it, to compare.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels import attention as attention_kernel
from .kernels import gemv, matmul
from .model import Attention, Linear, MoEFeedForward, RMSNorm, Transformer, WeightFormat
from .quantize import GroupedInt8Linear, Int4WeightOnlyLinear, ScaledWeightOnlyLinear


class Folded(nn.Module):
    """Where an RMSNorm was: it now lives in the Linear after it (FusedLinear.norm)."""

    def forward(self, x):
        return x


class Route:
    """How the kernels read one weight format, as stored: one token's GEMV (the
    norm before it applied), a few rows' matmul on the tensor cores, an MoE
    expert's matrix in place in the stacked tensors. None: no kernel serves
    it, and the format's own forward runs."""
    prefill_chunk = 0  # the prompt chunk the few-rows kernel suits (steps.Steps.prefill_chunk), 0: any

    def adopt(self, w: WeightFormat):
        """Put w's tensors in the precision the kernels read."""

    def one_token(self, w, x, norm):
        return None

    def few_rows(self, w, x):
        return None

    def expert(self, w, part: dict, x, e):
        return None

    def every_expert(self, w, part: dict, x, counts=None):
        """x (M, K), or each expert's own rows (E, M, K), times every expert's
        matrix at once, `part` holding them stacked (E, N, ...): (M, E * N) as
        one matrix of E * N rows. counts (E,): the rows of x that are real
        for each expert (the rest may be skipped, summed as zeros)."""
        return None


DENSE_ROWS = 16  # up to this many tokens, a dense Linear on a GPU uses kernels/matmul.py (one row tile)
ROUTES: dict[type, Route] = {}  # each weight format's, registered below


def route(format: type):
    """Register the decorated Route for `format` (and its subclasses)."""
    def register(cls):
        ROUTES[format] = cls()
        return cls
    return register


def route_of(w: WeightFormat) -> Route:
    return next((ROUTES[c] for c in type(w).__mro__ if c in ROUTES), NO_ROUTE)


NO_ROUTE = Route()


def normed(x, norm):
    return x if norm is None else norm(x)


@route(Linear)
class DenseRoute(Route):
    def one_token(self, w, x, norm):  # only where ours measured faster than cuBLAS (bf16, fp16 weights)
        if x.is_cuda and w.weight.element_size() == 2 and gemv.beats_dense(w.out_features, w.in_features):
            return gemv.scaled_gemv(x, w.weight, norm).sum(0)
        return None

    def few_rows(self, w, x):
        """A verify step's rows (up to DENSE_ROWS) through our kernel, which
        starts while the kernel before it finishes as the GEMVs do; cuBLAS's
        do not: in an H100's compiled verify step ours made the 5-row forward
        0.72x as long for SmolLM2 and 0.95x for the 8B (RESULTS.md). More rows
        (prefill chunks): cuBLAS."""
        if x.shape[0] <= DENSE_ROWS and w.weight.dtype == x.dtype:
            return matmul.few_rows_matmul(x, w.weight)
        return None

    def expert(self, w, part, x, e):
        y = gemv.expert_gemv(x, part["weight"], e)
        return None if y is None else y.sum(0)

    def every_expert(self, w, part, x, counts=None):
        if x.dim() == 3:
            return torch.bmm(x, part["weight"].transpose(1, 2)).transpose(0, 1).flatten(1)
        return F.linear(x, part["weight"].flatten(0, 1))


@route(Int4WeightOnlyLinear)
class Int4Route(Route):
    prefill_chunk = matmul.FEW_ROWS  # (reads the codes once a chunk: faster than 256-token chunks)

    def one_token(self, w, x, norm):
        if w.padded != w.in_features:  # (the norm cannot fold into a padded x)
            x, norm = F.pad(normed(x, norm), (0, w.padded - w.in_features)), None
        return gemv.int4_gemv(x, w.packed, w.scale, w.zero, norm).sum(0)

    def few_rows(self, w, x):
        x = F.pad(x, (0, w.padded - w.in_features)) if w.padded != w.in_features else x
        return matmul.few_rows_matmul(x, w.packed, w.scale, w.zero)

    def expert(self, w, part, x, e):
        y = gemv.expert_gemv(x, part["packed"], e, part["scale"], part["zero"]) if w.padded == w.in_features else None
        return None if y is None else y.sum(0)

    def every_expert(self, w, part, x, counts=None):
        x = F.pad(x, (0, w.padded - w.in_features)) if w.padded != w.in_features else x
        return matmul.few_rows_matmul(x, *(part[name].flatten(0, 1) for name in ("packed", "scale", "zero")),
                                      counts=counts)


@route(ScaledWeightOnlyLinear)
class ScaledRoute(Route):  # int8 and fp8 (measured no gain from folding the norm)
    def one_token(self, w, x, norm):
        return gemv.scaled_gemv(normed(x, norm), w.weight).sum(0) * w.scale.float()

    def few_rows(self, w, x):
        return matmul.few_rows_matmul(x, w.weight) * w.scale

    def expert(self, w, part, x, e):
        y = gemv.expert_gemv(x, part["weight"], e)  # (None for codes the kernel takes not: fp8)
        return None if y is None else y.sum(0) * part["scale"].index_select(0, e)[0].float()

    def every_expert(self, w, part, x, counts=None):
        return matmul.few_rows_matmul(x, part["weight"].flatten(0, 1), counts=counts) * part["scale"].flatten()


@route(GroupedInt8Linear)
class GroupedInt8Route(Route):  # Q8_0
    def adopt(self, w):
        w.scale = w.scale.half()  # the kernels read Q8_0's own precision

    def one_token(self, w, x, norm):
        return gemv.int8_group_gemv(normed(x, norm), w.weight, w.scale).sum(0)

    def few_rows(self, w, x):
        return matmul.few_rows_matmul(x, w.weight, w.scale)

    def every_expert(self, w, part, x, counts=None):
        return matmul.few_rows_matmul(x, part["weight"].flatten(0, 1), part["scale"].flatten(0, 1), counts=counts)


class FusedLinear(WeightFormat):
    """A weight format (`inner`, in its stored layout) with its kernels'
    route in front (ROUTES), and the RMSNorm before it (`norm`), if any."""

    def __init__(self, inner: WeightFormat, norm: RMSNorm | None = None):
        super().__init__()
        self.inner, self.norm, self.route = inner, norm, route_of(inner)
        self.in_features, self.out_features, self.bias = inner.in_features, inner.out_features, inner.bias
        self.route.adopt(inner)

    def forward(self, x):
        shape, rows = x.shape, x.numel() // self.in_features
        y = self.route.one_token(self.inner, x.reshape(-1), self.norm) if rows == 1 and gemv.available(x.device) \
            else None
        if y is None:
            x = normed(x, self.norm)
            y = self.route.few_rows(self.inner, x.reshape(-1, self.in_features)) if matmul.supported(x) else None
            if y is None:
                return self.inner(x)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def expert_forward(self, stacked, x, e):
        """An MoE expert's matrix read in place in the stacked tensors, where
        the route has a kernel for it (one token): no copy of the expert."""
        parts = {name.removeprefix("inner."): t for name, t in stacked.items()}
        y = self.route.expert(self.inner, parts, x.reshape(-1), e) \
            if x.numel() == self.in_features and gemv.available(x.device) else None
        if y is None:
            return super().expert_forward(stacked, x, e)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def experts_forward(self, stacked, x, counts=None):
        """Every expert's matrix as one of E * N rows, where the route has a
        kernel for it (a few rows): one launch reads them all (but those of
        experts with no rows, where counts says so)."""
        parts = {name.removeprefix("inner."): t for name, t in stacked.items()}
        fits = self.bias is None and all(t.numel() < 2**31 for t in parts.values())  # (the kernels' int32 offsets)
        rows = x[0] if x.dim() == 3 else x
        y = self.route.every_expert(self.inner, parts, x, counts) if fits and matmul.supported(rows) else None
        if y is None:
            return super().experts_forward(stacked, x, counts)
        y = y.view(rows.shape[0], -1, self.out_features).transpose(0, 1)  # (E, M, N), each expert's rows together:
        return y.to(x.dtype, memory_format=torch.contiguous_format)  # (the cast lays them out)

    def prepare(self, device, compiled=False):
        """Nothing: the kernels read `inner` as stored."""


class FusedAttention(Attention):
    """Attention whose step over one token, or a few (batch 1: decoding, a
    speculative verify step, a short prompt), is one Triton kernel: RoPE on
    the queries and keys, the keys and values stored at input_pos, attention
    over the positions each token sees (the last `window` of them), the
    per-head q/k norms first where the model has them (Qwen3, Gemma 3)."""

    @classmethod
    def replacing(cls, plain: Attention, args, layer: int) -> "FusedAttention":
        """The FusedAttention of the same layer, holding plain's modules (its
        Linears, norms and cache): the same state at the same names."""
        with torch.device("meta"):
            fused = cls(args, layer)
        for name, module in plain.named_children():
            setattr(fused, name, module)
        return fused

    def attend(self, x, cos, sin, mask, input_pos):
        T = x.shape[1]
        if not attention_kernel.supported(x.device, x.shape[0], T, self.head_dim):
            return super().attend(x, cos, sin, mask, input_pos)
        cache = self.kv_cache
        scales = (cache.k_scale, cache.v_scale) if cache.k.dtype == torch.int8 else (None, None)
        if not self.rope:  # (a layer without RoPE, SmolLM3's: the identity rotation)
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        qkv = self.wqkv(x).reshape(T, -1)
        qk_norm = attention_kernel.NO_NORM
        if isinstance(self.q_norm, RMSNorm):
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.offset)
        y = attention_kernel.decode_attention(qkv, cos.reshape(T, -1), sin.reshape(T, -1), cache.k, cache.v,
                                              input_pos, *scales, window=self.window, scale=self.scale,
                                              qk_norm=qk_norm)
        return y


def fuse_for_decode(model: Transformer) -> Transformer:
    """Swap in the Triton decode kernels where they run (see the module's
    docstring); elsewhere, or once done, return the model unchanged. Call it
    before `model.prepare`: the kernels read the weights as stored."""
    device = model.device
    if model.decode_kernels or not gemv.available(device):
        return model
    a = model.args
    fused_attention = attention_kernel.supported(device, 1, 1, a.head_dim)

    def fold(linear, norm):
        return FusedLinear(linear, norm), Folded()

    for i, layer in enumerate(model.layers):
        attn, ffn = layer.attention, layer.feed_forward
        attn.wqkv, layer.attention_norm = fold(attn.wqkv, layer.attention_norm)
        attn.wo = FusedLinear(attn.wo)
        if isinstance(ffn, MoEFeedForward):  # each expert's Linears (its norm stays: the router reads it too)
            for expert in ffn.experts:  # (a decode step then reads the chosen experts in place: expert_forward)
                expert.w13, expert.w2 = FusedLinear(expert.w13), FusedLinear(expert.w2)
        else:
            ffn.w13, layer.ffn_norm = fold(ffn.w13, layer.ffn_norm)
            ffn.w2 = FusedLinear(ffn.w2)
        if fused_attention:
            layer.attention = FusedAttention.replacing(attn, a, i)
    model.output, model.norm = fold(model.output, model.norm)
    # (a long prompt's prefill runs in chunks, steps.py: of the size a format's route suits)
    chunk = max((m.route.prefill_chunk for m in model.modules() if isinstance(m, FusedLinear)), default=0)
    model.decode_kernels = {"attention": attention_kernel.MAX_TOKENS if fused_attention else 0,
                            "gemv": gemv.tuned(), "prefill_chunk": chunk}
    return model
