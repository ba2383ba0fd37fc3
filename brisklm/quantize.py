"""Weight-only quantization: int8 per channel or per group, int4 per group, fp8, as a transformation.

The model code is unchanged: a quantized weight lives in the state dict under
the Linear's name with a suffix, and `build_model` makes the module that
reads it (FORMATS, below, which the loader hands it). Nothing is ever
dequantized into a full-precision copy of the whole model:

  int8  `W_int8` (N, K) int8 and `W_scale` (N,): w = q * scale; or `W_scale`
        (N, K/group): a scale per group of inputs (GGUF Q8_0 and mode q8_0: groups of
        32; the embedding).
  fp8   `W_fp8` (N, K) float8_e4m3fn and `W_scale` (N,): w = f * scale, the
        scale mapping each row's largest magnitude to e4m3's 448.
  int4  `W_int4` (N, K/2) uint8, two codes a byte (even k in the high nibble),
        `W_scale`, `W_zero` (N, K/group): w = (q - 8) * scale + zero, the
        format of PyTorch's int4 "tinygemm" kernels.

The modules here compute with plain PyTorch: on CPUs aten._weight_int8pack_mm
for one int8 token, aten._weight_int4pack_mm_for_cpu for int4 (repacked by
`prepare`), and elsewhere the weight widened to the activation dtype and
multiplied densely (fp8 is emulated that way). On NVIDIA GPUs
fusion.fuse_for_decode wraps them in the Triton kernels, which read the
stored codes as they are (one token: kernels/gemv.py; a few: kernels/matmul.py).

GGUF Q4_0 and Q4_1 blocks are this int4 format with group 32 (Q4_1: scale d,
zero m + 8d; Q4_0: scale d, zero 0), so such files load without a lossy round
trip (checkpoints/gguf.py). RTN (round to nearest) quantizes other weights.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model import Format, WeightFormat, canonical_names, format_entries, layer_part
from .modes import GROUP_SIZES, RTN_MODES

FP8_MAX = 448.0  # largest finite float8_e4m3fn


LINEARS = ("attention.wqkv.weight", "attention.wo.weight", "feed_forward.w13.weight", "feed_forward.w2.weight")


def quantized_linear_names(args) -> list[str]:
    """The Linear weights quantization applies to (the embedding and the
    experts' routers stay dense); the output layer's also where it is tied."""
    layers = [name for name in canonical_names(args) if name.startswith("layers.") and is_quantized_linear(name)]
    return layers + ["output.weight"]


def is_quantized_linear(name: str) -> bool:
    return name == "output.weight" or layer_part(name) in LINEARS


# --- the formats ----------------------------------------------------------------

def quantize_int8(w: torch.Tensor, groupsize: int | None = None) -> dict[str, torch.Tensor]:
    """Symmetric int8 (RTN): a scale per output channel (N,), or with groupsize
    a scale per group of inputs in each row (N, K/groupsize), as GGUF's Q8_0."""
    groups = w.float().reshape(w.shape[0], -1, groupsize or w.shape[1])
    scale = (groups.abs().amax(-1) / 127).clamp(min=1e-10)
    q = torch.round(groups / scale[..., None]).clamp(-128, 127).to(torch.int8).reshape(w.shape)
    return {"int8": q, "scale": scale if groupsize else scale[:, 0]}


def dequantize_grouped(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(..., K) codes times (..., K/group) scales, in dtype: each product rounded
    once (in bf16 a scale rounded first would shift its whole group)."""
    groups = q.float().unflatten(-1, (scale.shape[-1], -1)) * scale.float()[..., None]
    return groups.flatten(-2).to(dtype)


def quantize_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-output-channel scaled float8 (e4m3)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return {"fp8": (w / scale[:, None]).to(torch.float8_e4m3fn), "scale": scale}


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K/2) uint8, even k in the high nibble."""
    codes = codes.to(torch.uint8)
    return (codes[:, ::2] << 4) | codes[:, 1::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) int32 codes."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)


def quantize_int4(w: torch.Tensor, groupsize: int, scale_dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Asymmetric groupwise int4 (RTN): each group of `groupsize` inputs maps its
    [min, max] onto codes 0..15. K is zero-padded to a multiple of the group.

    The kernels read scales and zeros in the activation dtype; rounding them to
    scale_dtype first and choosing the codes against the rounded values keeps
    that rounding from adding to the error (it halved the KL divergence of
    SmolLM2 in bf16)."""
    w = w.float()
    n, k = w.shape
    pad = -k % groupsize
    if pad:
        w = F.pad(w, (0, pad))
    groups = w.reshape(n, -1, groupsize)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype).float()
    zero = (lo + 8 * scale).to(scale_dtype).float()
    codes = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp(0, 15)
    return {"int4": pack_int4(codes.reshape(n, -1)), "scale": scale, "zero": zero}


def dequantize(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weights a quantized entry stands for, in fp32 (for tests and evaluation)."""
    if "int8" in parts or "fp8" in parts:
        q, scale = parts["int8"] if "int8" in parts else parts["fp8"], parts["scale"].float()
        if scale.dim() == 2:  # a scale per group (GGUF Q8_0, the embedding)
            return dequantize_grouped(q, scale)
        return q.float() * scale[:, None]
    codes = unpack_int4(parts["int4"]).float()
    n, k = codes.shape
    scale, zero = parts["scale"].float(), parts["zero"].float()
    g = k // scale.shape[1]
    w = (codes.reshape(n, -1, g) - 8) * scale[..., None] + zero[..., None]
    return w.reshape(n, k)


def check_mode(mode: str, groupsize: int):
    if mode not in RTN_MODES:
        raise ValueError(f"unknown quantization mode {mode!r} (choose from {', '.join(RTN_MODES)})")
    if mode == "int4" and groupsize not in GROUP_SIZES:
        raise ValueError(f"int4 groupsize must be one of {', '.join(map(str, GROUP_SIZES))}, got {groupsize}")


def quantizer(mode: str, groupsize: int = 128):
    """transform(args, name, tensor) -> entries: one canonical tensor in `mode`.

    Readers apply it to each tensor as they read it (checkpoints.load's
    transform), so a model is never whole in its dense form: peak memory is
    the quantized model plus one tensor. A Linear weight becomes its
    quantized entries, the embedding its int8 rows; other tensors pass as
    they are, and so do entries already quantized (a GGUF file's int4
    blocks). A tied embedding also gives the output layer a quantized copy of
    its own: at batch 1 it is one of the largest matrices (`untied` then
    fixes the args)."""
    check_mode(mode, groupsize)

    def transform(args, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        if name == "tok_embeddings.weight" and args.tie_word_embeddings:
            out.update(quantized_weight_entries("output.weight", w, mode, groupsize))
        if is_quantized_linear(name):
            out.update(quantized_weight_entries(name, w, mode, groupsize))
        elif name == "tok_embeddings.weight":
            out.update(quantize_embedding({name: w}))
        else:
            out[name] = w
        return out

    return transform


def untied(args, state: dict):
    """args for `state`: untied where the output layer has entries of its own."""
    if args.tie_word_embeddings and quantized_entries(state, "output.weight"):
        from dataclasses import replace
        return replace(args, tie_word_embeddings=False)
    return args


def quantize_state_dict(args, state: dict, mode: str, groupsize: int = 128, progress=None):
    """Replace the Linear weights of a canonical state dict by quantized
    entries (`quantizer` applied to each tensor). Returns (args, state).
    progress(done, total) is called per matrix."""
    transform = quantizer(mode, groupsize)
    matrices = [n for n in state if is_quantized_linear(n) or (n == "tok_embeddings.weight"
                                                               and args.tie_word_embeddings)]
    out = {}
    for name in list(state):
        out.update(transform(args, name, state[name]))
        if progress and name in matrices:
            progress(matrices.index(name) + 1, len(matrices))
    return untied(args, out), out


def quantized_weight_entries(name: str, w: torch.Tensor, mode: str, groupsize: int) -> dict[str, torch.Tensor]:
    """`name`'s quantized parts as state-dict entries, on w's device (scales and zeros in fp32)."""
    return {f"{name}_{s}": t.to(w.device) for s, t in quantize_weight(name, w, mode, groupsize).items()}


def quantize_weight(name: str, w: torch.Tensor, mode: str, groupsize: int) -> dict[str, torch.Tensor]:
    """The quantized parts of the Linear weight `name` in `mode`."""
    if mode == "fp8":
        return quantize_fp8(w)
    if mode == "q8_0" and w.shape[1] % 32 == 0:  # GGUF's Q8_0: a scale per 32 inputs
        return quantize_int8(w, 32)
    # The output layer stays at 8 bits even in int4 mode (as llama.cpp's 4-bit
    # files keep it at 6-8): at 4 bits it alone dominated the model's KL divergence.
    if mode in ("int8", "q8_0") or name == "output.weight":
        return quantize_int8(w)
    return quantize_int4(w, groupsize, w.dtype)


def quantize_embedding(state: dict, groupsize: int = 32) -> dict:
    """The embedding table as int8 with a scale per group of 32 in each row (the
    layout of GGUF's Q8_0). A decode step reads one row of it, so this saves
    memory (0.5 GB of a Llama-3 8B), not time. One scale per row instead cost
    SmolLM2 +0.06% perplexity on top of int8's matrices; groups of 32 cost
    nothing measurable."""
    name = "tok_embeddings.weight"
    if name in state and state[name].shape[1] % groupsize == 0:
        w = state.pop(name)
        state.update({f"{name}_{s}": t.to(w.device) for s, t in quantize_int8(w, groupsize).items()})
    return state


def quantized_entries(state: dict, name: str) -> dict[str, torch.Tensor] | None:
    """The quantized parts stored for Linear weight `name`, or None if it is dense."""
    found = format_entries(state, name, FORMATS)
    return found and found[1]


# --- the modules ----------------------------------------------------------------

class ScaledWeightOnlyLinear(WeightFormat):
    """int8 or fp8 weights with one scale per output channel."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype, bias=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.to(dtype))
        self.bias = bias

    def matmul(self, x):
        if x.shape[0] == 1 and x.device.type == "cpu" and self.weight.dtype == torch.int8:
            # (many tokens, prefill: converting the weight once and using the
            # dense matmul measured 3-30x faster than this kernel on the CPU)
            return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)
        if x.shape[0] > 1 and torch.compiler.is_compiling():  # (outside a trace the op's call
            return dequantized_matmul(x, self.weight) * self.scale  # would only import the compiler)
        return F.linear(x, self.weight.to(x.dtype)) * self.scale


@torch.library.custom_op("brisklm::dequantized_matmul", mutates_args=())
def dequantized_matmul(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """x @ codes^T, the codes widened to x's dtype first, in an op the compiler
    cannot see into: compiled prefill fused the widening into a matmul of its
    own that read every weight once per token."""
    return F.linear(x, codes.to(x.dtype))


dequantized_matmul.register_fake(lambda x, codes: x.new_empty(*x.shape[:-1], codes.shape[0]))


@torch.library.custom_op("brisklm::as_buffer", mutates_args=())
def as_buffer(x: torch.Tensor) -> torch.Tensor:
    """A copy of x that the compiler cannot see through: x is computed once,
    not again inside every loop that reads it."""
    return x.clone()


as_buffer.register_fake(lambda x: torch.empty_like(x))


class GroupedInt8Linear(WeightFormat):
    """int8 weights with a scale per group of inputs: GGUF Q8_0 blocks (groups
    of 32, fp16 scales) kept as they are. Three layouts (`prepare`):

    - "stored" (N, K) codes, (N, K/G) scales: what the Triton kernels read
      (GPUs, in fp16: Q8_0's own precision); this module alone widens it for
      a dense matmul.
    - "grouped" (CPUs): codes regrouped as (K/G, N, G), so that aten's int8
      matmul, whose scales are per output row, runs once per group for one
      token and a few (up to 32 rows: a speculative verify step).
    - "rows_last" (a compiled step on a CPU): (K/G, G, N), one expression
      that inductor compiles into one loop with the rows along the vector
      lanes (over (K/G, N, G) the sums of 32 inputs ran across the lanes,
      slower).

    Several tokens multiply the dequantized matrix, far faster than once per
    group."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias=None, dtype=torch.float32):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group = self.in_features // scale.shape[1]
        self.bias = bias
        self.scale_dtype = dtype  # the CPU layouts' scales: the activations'
        self.layout = "stored"
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    def prepare(self, device, compiled=False):
        layout = "stored" if device.type != "cpu" else "rows_last" if compiled else "grouped"
        if layout == self.layout:
            return
        if self.layout != "stored":  # back to (N, K) codes, (N, K/G) scales
            codes = self.groups.permute(2, 0, 1) if self.layout == "rows_last" else self.groups.transpose(0, 1)
            weight, scale = codes.reshape(self.out_features, -1), self.group_scales.t().contiguous()
            del self.groups, self.group_scales
            self.register_buffer("weight", weight)
            self.register_buffer("scale", scale)
        if layout != "stored":  # (buffers: what the model holds, and a decode step reads, is counted by them)
            groups = self.weight.view(self.out_features, -1, self.group).transpose(0, 1)  # (K/G, N, G)
            groups = (groups.transpose(1, 2) if layout == "rows_last" else groups).contiguous()
            group_scales = self.scale.t().to(self.scale_dtype).contiguous()  # (K/G, N)
            del self.weight, self.scale
            self.register_buffer("groups", groups)
            self.register_buffer("group_scales", group_scales)
        self.layout = layout

    def matmul(self, x):
        if self.layout == "rows_last" and x.shape[0] == 1:
            return self.rows_last_one_token(x)
        if self.layout == "grouped" and x.shape[0] <= 32:
            # one token, or a few (a speculative verify step): group by group still
            # beats widening the whole matrix, up to about 64 rows
            return self.group_by_group(x)
        # several (prefill): aten's int8 matmul costs a GEMV a row, one dense matmul does not
        return F.linear(x, self.dequantized(x.dtype))

    def dequantized(self, dtype) -> torch.Tensor:
        if self.layout != "stored":  # codes back to (N, K)
            codes = self.groups.permute(2, 0, 1) if self.layout == "rows_last" else self.groups.transpose(0, 1)
            return dequantize_grouped(codes.flatten(1), self.group_scales.t(), dtype)
        return dequantize_grouped(self.weight, self.scale, dtype)

    def rows_last_one_token(self, x):
        """One token x (1, K) times the (K/G, G, N) codes, as one expression
        that inductor compiles into a loop reading each code once. x enters as
        a buffer (as_buffer): inlined, the residual adds and the norm before
        it ran again for every 32 rows."""
        n_groups, g, n = self.groups.shape
        v = x.reshape(-1)
        if torch.compiler.is_compiling():
            # (as_buffer before any conversion: CPU flex attention, wo's input, takes no fused epilogue)
            partial = (self.groups * as_buffer(v).float().view(n_groups, g, 1)).sum(1)  # (K/G, N)
            return (partial * self.group_scales.float()).sum(0)[None]
        # eager (a compiled model's prefill, for its last position): slices of 1024 rows, whose
        # temporaries stay in cache (the whole expression at once was ~10x slower)
        vg = v.float().view(n_groups, 1, g)
        return torch.cat([(torch.bmm(vg, self.groups[:, :, i:i + 1024].float()).squeeze(1)
                           * self.group_scales[:, i:i + 1024].float()).sum(0) for i in range(0, n, 1024)])[None]

    def group_by_group(self, x):
        """x (M, K) times the (K/G, N, G) codes, summed over the groups in fp32."""
        n_groups, _, g = self.groups.shape
        xs = x.to(self.group_scales.dtype).view(-1, n_groups, g).transpose(0, 1).contiguous()  # one copy
        y = 0
        for i in range(n_groups):
            y = y + torch.ops.aten._weight_int8pack_mm(xs[i], self.groups[i], self.group_scales[i]).float()
        return y


class Int4WeightOnlyLinear(WeightFormat):
    """Groupwise int4. Stored, the codes are what the Triton kernels read
    (GPUs) and this module widens them for a dense matmul; `prepare` repacks
    them on CPUs for tinygemm's CPU kernel, which wants scales and zeros in
    one (K/group, N, 2) tensor (a layout that cannot go back)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features, dtype,
                 bias=None):
        super().__init__()
        self.bias = bias
        n, k_padded = packed.shape[0], packed.shape[1] * 2
        self.in_features, self.out_features = in_features, n
        self.padded = k_padded
        self.groupsize = k_padded // scale.shape[1]
        self.layout = "stored"
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scale", scale.to(dtype).contiguous())
        self.register_buffer("zero", zero.to(dtype).contiguous())

    def prepare(self, device, compiled=False):
        layout = "tinygemm" if device.type == "cpu" else "stored"
        if layout == self.layout:
            return
        if self.layout == "tinygemm":
            raise ValueError("int4 weights laid out for the CPU cannot move to another device: "
                             "build the model on the device it runs on")
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(self.packed), 1)
        sz = torch.stack([self.scale, self.zero], dim=-1).transpose(0, 1).contiguous()  # (K/g, N, 2)
        del self.packed, self.scale, self.zero
        self.register_buffer("weight", weight)
        self.register_buffer("scales_and_zeros", sz)
        self.layout = layout

    def dense_weight(self, dtype):
        """The (N, K) weights in `dtype`, for prefill (inductor fuses this into one kernel)."""
        codes = torch.stack([self.packed >> 4, self.packed & 15], dim=-1).reshape(self.out_features, -1, self.groupsize)
        w = (codes.to(dtype) - 8) * self.scale[..., None] + self.zero[..., None]
        return w.reshape(self.out_features, -1)[:, :self.in_features]

    def matmul(self, x):
        if self.layout == "stored":
            return F.linear(x, self.dense_weight(x.dtype))
        if self.padded != self.in_features:
            x = F.pad(x, (0, self.padded - self.in_features))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, self.groupsize, self.scales_and_zeros)


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 with a scale per group of each row."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype):
        super().__init__()
        self.dtype = dtype
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.float())

    def forward(self, idx):
        rows = dequantize_grouped(F.embedding(idx, self.weight), F.embedding(idx, self.scale))
        return rows.to(self.dtype)


def int8_linear(parts: dict[str, torch.Tensor], in_features: int, dtype, bias=None) -> WeightFormat:
    if parts["scale"].dim() == 2:  # a scale per group of inputs (GGUF Q8_0)
        return GroupedInt8Linear(parts["int8"], parts["scale"], bias, dtype)
    return ScaledWeightOnlyLinear(parts["int8"], parts["scale"], dtype, bias)


def int8_fits(parts: dict, shape: tuple) -> bool:
    (n, k), q, scale = shape, parts["int8"], parts["scale"]
    per_group = (scale.dim() == 2 and scale.shape[0] == n and k % scale.shape[1] == 0
                 and k // scale.shape[1] in GROUP_SIZES)  # GGUF Q8_0, the embedding
    return q.shape == (n, k) and (scale.shape == (n,) or per_group)


def int4_fits(parts: dict, shape: tuple) -> bool:
    (n, k), q, s, z = shape, parts["int4"], parts["scale"], parts["zero"]
    return (q.dim() == 2 and q.shape[0] == n and 2 * q.shape[1] >= k and s.shape == z.shape
            and s.dim() == 2 and s.shape[0] == n and (2 * q.shape[1]) % s.shape[1] == 0)


FORMATS = {  # the quantized formats by their codes' suffix: what build_model(..., FORMATS) reads
    "int8": Format(("int8", "scale"), int8_linear, int8_fits,
                   embedding=lambda p, dtype: Int8Embedding(p["int8"], p["scale"], dtype)),
    "fp8": Format(("fp8", "scale"), lambda p, k, dtype, bias: ScaledWeightOnlyLinear(p["fp8"], p["scale"], dtype, bias),
                  lambda p, shape: p["fp8"].shape == shape and p["scale"].shape == shape[:1]),
    "int4": Format(("int4", "scale", "zero"),
                   lambda p, k, dtype, bias: Int4WeightOnlyLinear(p["int4"], p["scale"].float(), p["zero"].float(),
                                                                  k, dtype, bias),
                   int4_fits),
}


def quantized_linear(parts: dict[str, torch.Tensor], in_features: int, dtype, bias=None) -> WeightFormat:
    """The module for one weight's quantized parts (as build_model makes it)."""
    kind = next(k for k in FORMATS if k in parts)
    return FORMATS[kind].linear(parts, in_features, dtype, bias)
