"""The decoder: a Llama-family transformer with a static KV cache.

One model covers Llama 1/2/3.x, Mistral, SmolLM2, Qwen2 (attention bias),
Qwen3 (q/k norms), SmolLM3 (some layers without RoPE), Phi-3/4 and Gemma 3
(scaled embeddings, norms also after attention and MLP, GeGLU, sliding-window
layers with their own RoPE base between global ones):
token embedding -> N x [RMSNorm, grouped-query attention with RoPE, RMSNorm,
gated MLP] -> RMSNorm -> output projection. References: the LLaMA papers
(Touvron et al. 2023), RoFormer (Su et al. 2021) for rotary embeddings,
GQA (Ainslie et al. 2023), and Hugging Face transformers' modeling_llama.py,
whose fp32 logits the tests match.

Weights use one canonical naming (see `canonical_names`); every checkpoint
reader maps its format onto it. q/k/v are one matrix (`wqkv`) and gate/up are
one matrix (`w13`): at batch size 1 every Linear is a GEMV that reads its
weight once, and one launch over a fused weight beats three small ones.

ModelArgs' field names mirror Hugging Face config.json so that a hub folder's
config loads with no translation table.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...}
    # Phi-4-mini: RoPE on the first partial_rotary_factor of each head's dims (see rotary_first)
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k, before RoPE
    no_rope_layers: list | None = None  # SmolLM3: per layer, 1 applies RoPE, 0 does not (None: all do)
    # Mistral-7B-v0.1: a query sees only the last sliding_window positions (itself included),
    # on every layer, or (Gemma 3) on those that layer_types names "sliding_attention".
    sliding_window: int | None = None
    layer_types: list | None = None
    rope_local_base_freq: float | None = None  # Gemma 3: the sliding layers' RoPE base (unscaled)
    hidden_act: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    # Gemma 3: embeddings times sqrt(hidden_size), RMSNorm weights w applied as
    # (norm_offset + w), a norm after attention and after the MLP too, and
    # attention scores scaled by query_pre_attn_scalar**-0.5 (None: head_dim**-0.5).
    embed_scale: float = 1.0
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): each layer's MLP is num_local_experts
    # experts of moe_intermediate_size (None: intermediate_size), num_experts_per_tok
    # of them chosen per token, their router weights renormalized (norm_topk_prob)
    # or not; 0 experts means a dense MLP.
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            kind = {"int": int, "float": (int, float), "bool": bool}.get(f.type.split(" ")[0])
            if kind and value is not None and (not isinstance(value, kind) or
                                               (kind is int and isinstance(value, bool))):
                raise ValueError(f"{f.name} must be {f.type.split(' ')[0]}, got {value!r}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_local_experts and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} is not in 1.."
                             f"{self.num_local_experts} (num_local_experts)")
        if self.no_rope_layers is not None and len(self.no_rope_layers) != self.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(self.no_rope_layers)} entries for "
                             f"{self.num_hidden_layers} layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        rotated = self.head_dim * self.partial_rotary_factor
        if not (0 < rotated <= self.head_dim and rotated == int(rotated) and rotated % 2 == 0
                and (self.head_dim - rotated) % 2 == 0):
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} rotates {rotated:g} of "
                             f"head_dim={self.head_dim} dims (an even count, leaving an even count, is needed)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)} are)")

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE turns (partial_rotary_factor of them)."""
        return round(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer (None: it sees every earlier position)."""
        sliding = self.layer_types is None or self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def local_rope(self, layer: int) -> bool:
        """Whether a layer takes the sliding layers' own RoPE base."""
        return self.rope_local_base_freq is not None and self.window(layer) is not None

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        """Build from a Hugging Face config.json dict (unknown keys ignored)."""
        config = dict(config)
        config.setdefault("hidden_act", config.get("hidden_activation"))
        config.setdefault("num_local_experts", config.get("num_experts"))  # (Qwen3-MoE's name)
        # transformers >= 5 nests rope_theta and the scaling in rope_parameters
        # (Gemma 3: one entry for the full and one for the sliding layers).
        rope = config.pop("rope_parameters", None) or {}
        if "full_attention" in rope:
            config.setdefault("rope_local_base_freq", (rope.get("sliding_attention") or {}).get("rope_theta"))
            rope = rope["full_attention"] or {}
        if "rope_theta" in rope and "rope_theta" not in config:
            config["rope_theta"] = rope["rope_theta"]
        if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        scaling = config.get("rope_scaling")
        if scaling is not None:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
            if scaling["rope_type"] == "su":  # (LongRoPE's first name)
                scaling["rope_type"] = "longrope"
            if "original_max_position_embeddings" in config:  # (Phi-3 keeps it beside the scaling)
                scaling.setdefault("original_max_position_embeddings", config["original_max_position_embeddings"])
            config["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
        # A window is used only with use_sliding_window (Qwen2's default is no: checkpoints.families),
        # and then on layers from max_window_layers on (as transformers reads it).
        first_layer = config.get("max_window_layers", 0)
        in_use = config.get("use_sliding_window", True)
        if not in_use or first_layer >= config.get("num_hidden_layers", 1):
            config.pop("sliding_window", None)
        elif first_layer > 0:
            raise ValueError("sliding windows on some layers only (use_sliding_window with "
                             "max_window_layers) are not supported")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    def to_dict(self) -> dict:
        return asdict(self)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def rope_attention_factor(args: ModelArgs) -> float:
    """LongRoPE's scale on cos and sin (1 for every other RoPE)."""
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or args.max_position_embeddings / original
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def rotary_first(args: ModelArgs) -> torch.Tensor | None:
    """The order in which a head's dims are stored where RoPE turns only some
    of them (partial_rotary_factor < 1), or None. RoPE's pairs are then
    (i, i + r/2) for i < r/2 of the first r dims, the rest untouched; stored
    as [rotated first half, untouched first half, rotated second half,
    untouched second half], the pairs become (i, i + head_dim/2) as for a
    whole head, whose rotation past r/2 is the identity (rope_tables). So
    one RoPE serves both, kernels included. The checkpoint readers put q's
    and k's rows (and their norms) in this order; attention scores are the
    same, since q and k are reordered alike."""
    d, r = args.head_dim, args.rotary_dim
    if r == d:
        return None
    return torch.cat([torch.arange(0, r // 2), torch.arange(r, r + (d - r) // 2),
                      torch.arange(r // 2, r), torch.arange(r + (d - r) // 2, d)])


def rope_frequencies(args: ModelArgs, local: bool = False, long: bool = False) -> torch.Tensor:
    """Inverse frequencies (r/2,) of the r dims RoPE turns (head_dim, or its
    partial_rotary_factor), fp32, with the model's scaling applied (local:
    the sliding layers' base, which Gemma 3 does not scale; long: LongRoPE's
    factors for a context past the original one)."""
    dim = args.rotary_dim
    theta = args.rope_local_base_freq if local else args.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = {} if local else args.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "longrope":  # (Phi-3: a factor per frequency, short or long)
        return inv_freq / torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band
        # between interpolated smoothly (Llama 3.1's context extension).
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    if kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def gain(self) -> torch.Tensor:
        """The factor after normalizing: w, or Gemma's (1 + w) in fp32 (1 + w
        rounded to bf16 would lose w's digits)."""
        return self.offset + self.weight.float() if self.offset else self.weight

    def forward(self, x):
        # Normalize in fp32 as the reference does, then scale in the model dtype
        # (Gemma's (1 + w): in fp32).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * self.gain()).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def apply_rope(x, cos, sin):
    """x: (B, H, T, D); cos/sin: (T, D/2). Half-split rotation ("rotate_half")."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def kv_bytes_per_position(args: ModelArgs, dtype, int8=False) -> int:
    """Bytes the KV cache stores per position (int8: codes plus one scale a head)."""
    elem = torch.finfo(dtype).bits // 8
    per_head = args.head_dim + elem if int8 else args.head_dim * elem
    return 2 * args.num_hidden_layers * args.num_key_value_heads * per_head


def cached_prefix(cached: list[int], ids: list[int], limit: int) -> int:
    """How many leading tokens of ids a cache holding `cached` has already, at most limit."""
    n, limit = 0, min(limit, len(cached), len(ids))
    while n < limit and cached[n] == ids[n]:
        n += 1
    return n


class KVCache(nn.Module):
    """Preallocated keys and values, (B, n_kv_heads, max_seq_length, head_dim) each.

    With int8=True they are stored as int8 with one scale per position and head
    (half the memory, for long contexts). The decode attention kernel reads the
    codes as they are; other paths (prefill, CPUs) read them dequantized."""

    def __init__(self, batch, n_kv_heads, max_seq_length, head_dim, dtype, device, int8=False):
        super().__init__()
        shape = (batch, n_kv_heads, max_seq_length, head_dim)
        self.dtype = dtype
        for name in ("k", "v"):
            self.register_buffer(name, torch.zeros(shape, dtype=torch.int8 if int8 else dtype, device=device),
                                 persistent=False)
            if int8:
                self.register_buffer(name + "_scale", torch.zeros(shape[:-1] + (1,), dtype=dtype, device=device),
                                     persistent=False)

    def write(self, input_pos, k, v):
        """Store k, v (B, Hkv, T, D) at positions input_pos (T,)."""
        # index_copy_ with a tensor of positions keeps shapes static for CUDA graphs.
        if self.k.dtype != torch.int8:
            self.k.index_copy_(2, input_pos, k)
            self.v.index_copy_(2, input_pos, v)
            return
        for name, new in (("k", k), ("v", v)):
            new = new.float()
            scale = new.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
            getattr(self, name).index_copy_(2, input_pos, torch.round(new / scale).to(torch.int8))
            getattr(self, name + "_scale").index_copy_(2, input_pos, scale.to(self.dtype))

    def update(self, input_pos, k, v, length: int | None = None):
        """Write k, v at input_pos; return the first `length` positions (None: all),
        dequantized if int8."""
        self.write(input_pos, k, v)
        if self.k.dtype != torch.int8:
            return self.k[:, :, :length], self.v[:, :, :length]
        return tuple(getattr(self, name)[:, :, :length].to(self.dtype) * getattr(self, name + "_scale")[:, :, :length]
                     for name in ("k", "v"))


class WeightFormat(nn.Module):
    """A Linear layer's weights in one format (dense here; int8, Q8_0, fp8 and
    int4 in quantize.py): y = x W^T (+ bias) for x (..., in_features).

    A format implements `matmul` for x as rows (M, in_features) and may lay
    its tensors out for the device it runs on in `prepare`: the model is
    built with the tensors as stored, and `Transformer.prepare` is called
    once it sits where it will run. Kernel routes are not chosen here
    (fusion.fuse_for_decode swaps those in)."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def forward(self, x):
        y = self.matmul(x.reshape(-1, self.in_features)).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, device: torch.device, compiled: bool = False):
        """Re-lay the tensors out for `device` (compiled: for a compiled step)."""

    def expert_forward(self, stacked: dict[str, torch.Tensor], x, e):
        """x times expert e's matrix, where `stacked` holds this module's
        tensors for every expert along dim 0 (an MoE layer's decode step; e a
        (1,) tensor on the device). Here: e's tensors indexed out, then forward."""
        return torch.func.functional_call(self, {name: t.index_select(0, e)[0] for name, t in stacked.items()}, (x,))

    def experts_forward(self, stacked: dict[str, torch.Tensor], x, counts: torch.Tensor | None = None):
        """x (M, in_features), or each expert's own rows (E, M, in_features),
        times every expert's matrix: (E, M, out_features), `stacked` as for
        expert_forward; counts (E,): the rows of x that are real for each
        expert (the others' outputs are unused). Here: one expert after
        another, every row."""
        experts = next(iter(stacked.values())).shape[0]
        return torch.stack([torch.func.functional_call(self, {name: t[e] for name, t in stacked.items()},
                                                       (x[e] if x.dim() == 3 else x,)) for e in range(experts)])


class Linear(WeightFormat, nn.Linear):
    """Dense weights (nn.Linear's parameters)."""

    def reset_parameters(self):
        """None: the weights come from a state dict (build_model builds the
        model on the meta device, where initializing imports the compiler)."""

    def matmul(self, x):
        return F.linear(x, self.weight)


@dataclass(frozen=True)
class Format:
    """A quantized weight format, as build_model finds it in a state dict: the
    entries `{name}_{suffix}` for each of `parts` (the codes' suffix first)."""
    parts: tuple[str, ...]
    linear: Callable  # (parts, in_features, dtype, bias) -> WeightFormat
    fits: Callable  # (parts, (N, K)) -> bool
    embedding: Callable | None = None  # (parts, dtype) -> an embedding module


def format_entries(state: dict, name: str, formats: dict[str, Format]) -> tuple[str, dict] | None:
    """(codes' suffix, parts) stored for weight `name` in one of `formats` (by
    the codes' suffix), or None."""
    for kind, fmt in formats.items():
        if f"{name}_{kind}" in state:
            return kind, {s: state[f"{name}_{s}"] for s in fmt.parts}
    return None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.rope = not args.no_rope_layers or bool(args.no_rope_layers[layer])
        self.n_heads, self.n_kv_heads, self.head_dim = (
            args.num_attention_heads, args.num_key_value_heads, args.head_dim)
        qkv_dim = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.wqkv = Linear(args.hidden_size, qkv_dim, bias=args.attention_bias)
        self.wo = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        self.kv_cache: KVCache | None = None
        self.window, self.local_rope = args.window(layer), args.local_rope(layer)
        self.scale = args.query_pre_attn_scalar ** -0.5 if args.query_pre_attn_scalar else None
        def head_norm():  # (Qwen3, Gemma 3: an RMSNorm over each head of q and of k)
            return RMSNorm(self.head_dim, args.rms_norm_eps, args.norm_offset) if args.qk_norm else nn.Identity()
        self.q_norm, self.k_norm = head_norm(), head_norm()

    def forward(self, x, cos, sin, mask, input_pos):
        return self.wo(self.attend(x, cos, sin, mask, input_pos))

    def attend(self, x, cos, sin, mask, input_pos):
        """Attention up to its output projection wo: (B, T, heads x head_dim)."""
        B, T, _ = x.shape
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qkv = self.wqkv(x)
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif isinstance(mask, BlockMask):  # (CPU inductor's flex template wants q computed, not a view)
            q = q * 1.0
        gqa = self.n_heads != self.n_kv_heads
        if isinstance(mask, BlockMask):  # compiled decode: skips the cache blocks not yet filled
            k, v = self.kv_cache.update(input_pos, k, v)  # (B, Hkv, S, D)
            y = flex_attention(q, k, v, block_mask=mask, scale=self.scale, enable_gqa=gqa)
        else:
            k, v = self.kv_cache.update(input_pos, k, v, mask.shape[-1])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return y.transpose(1, 2).reshape(B, T, q_dim)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(x W1) * x W3), with W1 (gate) and W3 (up) stacked in w13
    (GeGLU with gelu in place of silu)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.intermediate_size, self.act = args.intermediate_size, ACTIVATIONS[args.hidden_act]
        self.w13 = Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.w2 = Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x, real=None):  # (real: an MoE layer's padding rows, nothing to a dense one)
        gate, up = self.w13(x).split(self.intermediate_size, dim=-1)
        return self.w2(self.act(gate) * up)


def prepare_formats(root: nn.Module, device, compiled: bool = False):
    """`prepare` every weight format under root (a format's own modules are
    its business, and an MoE layer's experts the layer's)."""
    todo = list(root.children())
    while todo:
        module = todo.pop()
        if isinstance(module, (WeightFormat, MoEFeedForward)):
            module.prepare(torch.device(device), compiled)
        else:
            todo.extend(module.children())


class MoEFeedForward(nn.Module):
    """Mixture of experts (Mixtral, Qwen3-MoE): a router (`gate`) picks
    num_experts_per_tok of the SwiGLU `experts` for each token, and their
    outputs are summed, weighted by the router's softmax at the chosen ones
    (renormalized over them with norm_topk_prob).

    Each expert is a FeedForward whose weights are in any format. Where the
    host may read which experts were chosen (eager: a CPU, a GPU's long
    prefill), tokens are grouped by expert and each chosen expert runs once
    (`by_expert`). Inside a compiled step or a CUDA graph, nothing may go to
    the host: `prepare` has stacked every expert's tensors into one tensor
    per name, and each token's chosen experts are indexed on the device
    (`by_slot`), so a decode step reads only the chosen experts' weights;
    where the tokens choose as many experts as there are, each expert's
    tokens are gathered on the device into rows of its own, as many as
    there are tokens, of which the kernels read only the real ones
    (`by_expert_rows`: each chosen expert's weights read once, as a short
    prefill must anyway)."""

    DEVICE_ROWS = 64  # on CUDA, inputs of up to this many tokens never read the choice on the host

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.renormalize = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = Linear(args.hidden_size, args.num_local_experts, bias=False)
        expert = ModelArgs(**{**args.to_dict(), "num_local_experts": 0,
                              "intermediate_size": args.moe_intermediate_size or args.intermediate_size})
        self.experts = nn.ModuleList(FeedForward(expert) for _ in range(args.num_local_experts))
        self.stacked: dict[str, dict[str, torch.Tensor]] | None = None  # {"w13": {"weight": (E, N, K)}, ...}

    def route(self, x):
        """x (M, C) -> router weights (M, k) fp32 and the chosen experts (M, k)."""
        weights, chosen = self.gate(x).float().softmax(-1).topk(self.top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True) if self.renormalize else weights), chosen

    def forward(self, x, real=None):
        """x (B, T, C); real (B T,) bool, if given: which rows are tokens, the
        rest padding (a CUDA graph's), whose output is not used."""
        rows = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(rows)
        # (on CUDA a short input stays on the device even eager: the run before a graph's capture is alike)
        on_device = torch.compiler.is_compiling() or (x.is_cuda and rows.shape[0] <= self.DEVICE_ROWS)
        if not on_device:
            y = self.by_expert(rows, weights, chosen)
        elif rows.shape[0] * self.top_k < len(self.experts):
            y = self.by_slot(rows, weights, chosen)
        else:
            y = self.by_expert_rows(rows, weights, chosen, real)
        return y.to(x.dtype).reshape(x.shape)

    def by_expert_rows(self, x, weights, chosen, real=None):
        if self.stacked is None:
            self.stack()
        expert, (m, k) = self.experts[0], chosen.shape
        picks = chosen.flatten()  # (M k): token t's choices at t k .. t k + k - 1
        one_hot = F.one_hot(picks, len(self.experts))  # (M k, E)
        if real is not None:  # padding picks no expert: an expert only padding chose is not read
            one_hot = one_hot * real.repeat_interleave(k)[:, None]
        place = ((one_hot.cumsum(0) - 1) * one_hot).sum(1)  # each pick's row among its expert's
        place = torch.where(one_hot.any(1), place, m - 1)  # (padding's: the last row, past every count then)
        token = torch.arange(m * k, device=x.device) // k
        rows = torch.zeros(len(self.experts), m, dtype=torch.long, device=x.device).index_put_((picks, place), token)
        counts = one_hot.sum(0)  # (E,): rows past an expert's count hold any token, unused
        gate, up = expert.w13.experts_forward(self.stacked["w13"], x[rows], counts).split(expert.intermediate_size, -1)
        y = expert.w2.experts_forward(self.stacked["w2"], expert.act(gate) * up, counts)  # (E, M, C)
        return (y[picks, place].float() * weights.reshape(-1, 1)).view(m, k, -1).sum(1)

    def by_expert(self, x, weights, chosen):
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in chosen.unique().tolist():
            token, slot = (chosen == e).nonzero(as_tuple=True)
            rows = x[token]
            if x.is_cuda and len(token) < self.DEVICE_ROWS:  # rows padded to a power of two from 16, as the
                # prefill graphs' are: the GPU kernels built for those serve them, where a new count would build its own
                rows = F.pad(rows, (0, 0, 0, max(16, 1 << (len(token) - 1).bit_length()) - len(token)))
            y.index_add_(0, token, self.experts[e](rows)[:len(token)].float() * weights[token, slot, None])
        return y

    def by_slot(self, x, weights, chosen):
        if self.stacked is None:
            self.stack()
        expert, w13, w2 = self.experts[0], self.stacked["w13"], self.stacked["w2"]
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for m in range(x.shape[0]):
            for j in range(self.top_k):
                e = chosen[m, j:j + 1]  # (a tensor index: no host read)
                gate, up = expert.w13.expert_forward(w13, x[m:m + 1], e).split(expert.intermediate_size, dim=-1)
                y[m] += expert.w2.expert_forward(w2, expert.act(gate) * up, e)[0].float() * weights[m, j]
        return y

    def stack(self):
        """One (num_experts, ...) tensor per expert tensor name, by matrix
        (w13, w2) and the name within it; each expert's own becomes a view
        into it (the weights stay in memory once)."""
        names = [n for n, _ in self.experts[0].named_parameters()] + [n for n, _ in self.experts[0].named_buffers()]
        self.stacked = {}
        for name in names:
            path, attr = name.rsplit(".", 1)
            owners = [expert.get_submodule(path) for expert in self.experts]
            stacked = torch.stack([getattr(owner, attr) for owner in owners])
            for e, owner in enumerate(owners):
                if isinstance(getattr(owner, attr), nn.Parameter):
                    setattr(owner, attr, nn.Parameter(stacked[e], requires_grad=False))
                else:
                    setattr(owner, attr, stacked[e])
            matrix, within = name.split(".", 1)
            self.stacked.setdefault(matrix, {})[within] = stacked

    def prepare(self, device, compiled=False):
        """Lay each expert's formats out for the device, then stack them."""
        prepare_formats(self.experts, device, compiled)
        self.stacked = None
        self.stack()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        norm = lambda: RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)  # noqa: E731
        self.attention_norm = norm()
        self.attention = Attention(args, layer)
        self.ffn_norm = norm()
        self.feed_forward = MoEFeedForward(args) if args.num_local_experts else FeedForward(args)
        after = norm if args.sandwich_norms else nn.Identity  # (norms after attention and the MLP too)
        self.post_attention_norm, self.post_ffn_norm = after(), after()

    def forward(self, x, cos, sin, mask, input_pos, real=None):
        return self.finish(x, self.attend(x, cos, sin, mask, input_pos), real)

    def attend(self, x, cos, sin, mask, input_pos):
        """The layer's first part: its attention's output before wo."""
        return self.attention.attend(self.attention_norm(x), cos, sin, mask, input_pos)

    def finish(self, x, y, real=None):
        """The rest, from attend's y: wo, the MLP, the residual adds."""
        h = x + self.post_attention_norm(self.attention.wo(y))
        y = self.feed_forward(self.ffn_norm(h), real)
        return h + self.post_ffn_norm(y)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size,  # (given: not initialized)
                                           _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.num_hidden_layers))
        # the distinct sliding windows of the layers (None: full attention), a mask each
        self.windows = sorted({args.window(i) for i in range(args.num_hidden_layers)}, key=lambda w: w or 0)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)
        self.output = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.max_seq_length = 0
        self.kv_int8 = False
        # What fusion.fuse_for_decode swapped in, if anything: {"attention": T}
        # when the attention of up to T tokens reads the filled length on the device,
        # and the GEMVs' tuned blocks.
        self.decode_kernels: dict = {}
        self.tensor_parallel = None  # the process group, once tp.parallelize has split the model

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (a quantized embedding table says which it makes)."""
        embedding = self.tok_embeddings
        return getattr(embedding, "dtype", None) or embedding.weight.dtype

    def prepare(self, device=None, compiled: bool = False):
        """Lay every weight format out for `device` (by default where the model
        is; compiled: for a compiled decode step). Call it after moving the model."""
        prepare_formats(self, torch.device(device or self.device), compiled)
        return self

    def tie_weights(self):
        if self.args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def setup_caches(self, max_batch_size: int, max_seq_length: int, kv_int8: bool | None = None):
        """Allocate the KV cache (int8 with kv_int8; None keeps the current kind)
        and the RoPE tables for up to max_seq_length positions."""
        self.kv_int8 = self.kv_int8 if kv_int8 is None else kv_int8
        dtype, device = self.dtype, self.device
        a = self.args
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, a.num_key_value_heads,
                                               max_seq_length, a.head_dim, dtype, device, self.kv_int8)
        self.rope_tables = rope_tables(a, max_seq_length, device)  # {local: (cos, sin)}
        self.max_seq_length = max_seq_length

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, last: torch.Tensor | None = None,
                kv_len: int | None = None, block_mask: dict | None = None, depth: int | None = None,
                block=None):
        """idx: (B, T) token ids at positions input_pos (T,). Returns logits (B, T, V),
        or (B, 1, V) for one position along T only, the index `last` (shape (1,),
        a tensor so that a CUDA graph of a padded prompt takes it as an input).
        The rows after `last` are padding: an MoE layer gives them no expert,
        and their keys and values in the cache are not the model's.

        Attention reads only the filled part of the cache: eager callers pass
        kv_len (known on the host) and compiled decode steps a one-row
        block mask for each of `windows` ({window: BlockMask}, see
        decode_block_mask), whose flex-attention kernel skips the empty
        blocks; with neither, attention covers the whole cache, masked.
        (With decode_kernels, one token's attention reads the length on the
        device and ignores both.)

        depth runs the first `depth` layers only, then the final norm and the
        output layer: the target's own shallow draft (speculative.py). block,
        if given, runs the layers in calls that every layer shares (compiled
        once, steps.LayerCalls): block.start(layer, x, cos, sin, mask,
        input_pos) -> y, the first layer's attend; block.between(done, layer,
        x, y, cos, sin, mask, input_pos, real) -> (x, y), one layer's finish
        and the next one's attend; block.finish(layer, x, y, real, norm,
        output, last) -> the last layer's finish, then `head`."""
        ropes = {local: (cos[input_pos], sin[input_pos]) for local, (cos, sin) in self.rope_tables.items()}
        if block_mask is not None:
            masks = block_mask
        elif idx.shape[1] <= self.decode_kernels.get("attention", 0):  # the kernel needs no mask
            masks = dict.fromkeys(self.windows)
        else:  # causal: the query at position p sees keys 0..p (the last `window` of them)
            keys = torch.arange(kv_len or self.max_seq_length, device=idx.device)
            masks = {w: visible(input_pos[:, None], keys[None, :], w) for w in self.windows}  # (T, S)
        x = scale_embeddings(self.args, self.tok_embeddings(idx))  # (B, T, C)
        real = None
        if last is not None and self.args.num_local_experts:  # (B T,) which rows are tokens
            real = (torch.arange(idx.shape[1], device=idx.device) <= last).repeat(idx.shape[0])
        layers = self.layers if depth is None else self.layers[:depth]
        around = lambda layer: (*ropes[layer.attention.local_rope], masks[layer.attention.window], input_pos)  # noqa: E731
        if block is None:
            for layer in layers:
                x = layer(x, *around(layer), real)
            return head(x, self.norm, self.output, last)
        y = block.start(layers[0], x, *around(layers[0]))
        for done, layer in zip(layers, layers[1:]):
            x, y = block.between(done, layer, x, y, *around(layer), real)
        return block.finish(layers[-1], x, y, real, self.norm, self.output, last)


def head(x: torch.Tensor, norm: nn.Module, output: nn.Module, last: torch.Tensor | None = None) -> torch.Tensor:
    """The logits (fp32) of the last layer's x, or of its row `last` only."""
    if last is not None:
        x = x.index_select(1, last)
    return output(norm(x)).float()


def scale_embeddings(args: ModelArgs, x: torch.Tensor) -> torch.Tensor:
    """Embedding rows times embed_scale (Gemma's sqrt(hidden), rounded to the
    model's dtype first, as the reference rounds it)."""
    return x if args.embed_scale == 1.0 else x * torch.tensor(args.embed_scale, dtype=x.dtype)


def rope_tables(args: ModelArgs, length: int, device=None) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
    """cos and sin (length, head_dim/2) for positions 0..length-1: {False: the
    model's, True: its sliding layers' own (Gemma 3), if any}. LongRoPE takes
    its long factors where `length` outgrows the original context (as
    llama.cpp decides by its context; transformers by the positions seen)."""
    t = torch.arange(length, dtype=torch.float32)
    long = length > (args.rope_scaling or {}).get("original_max_position_embeddings", length)
    tables = {}
    for local in (False, True) if args.rope_local_base_freq is not None else (False,):
        angles = torch.outer(t, rope_frequencies(args, local, long))  # (S, r/2)
        scale = 1.0 if local else rope_attention_factor(args)
        untouched = (length, args.head_dim // 2 - angles.shape[1])  # (partial rotary: the identity, unscaled)
        tables[local] = (torch.cat([angles.cos() * scale, torch.ones(untouched)], 1).to(device),
                         torch.cat([angles.sin() * scale, torch.zeros(untouched)], 1).to(device))
    return tables


def visible(q_pos, k_pos, window: int | None = None):
    """Whether the query at q_pos attends to the key at k_pos: causal, and with
    a sliding window only the last `window` positions (the query's included)."""
    seen = k_pos <= q_pos
    return seen & (q_pos - k_pos < window) if window else seen


def causal_block_mask(max_seq_length: int, device, window: int | None = None, block: int = 128) -> BlockMask:
    """The causal (sliding-window) mask over the whole cache, in blocks (made once per cache).

    Made from the blocks' bounds: create_block_mask evaluates the mask at every
    (query, key) pair, S^2 of them (26 s and 1 GB at S = 32768 on a CPU)."""
    S, n = max_seq_length, -(-max_seq_length // block)
    q, k = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    q_first, q_last = q * block, ((q + 1) * block - 1).clamp(max=S - 1)
    k_first, k_last = k * block, ((k + 1) * block - 1).clamp(max=S - 1)
    some = k_first <= q_last  # some pair of the two blocks is visible
    every = (k_last <= q_first) & ((k + 1) * block <= S)  # every pair is
    if window:
        some &= q_first - k_last < window
        every &= q_last - k_first < window

    def listed(chosen):  # (1, 1, n) counts, (1, 1, n, n) indices with the chosen blocks first
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)
        return chosen.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*listed(some & ~every), *listed(every), BLOCK_SIZE=block,
                                    mask_mod=lambda b, h, q_idx, kv_idx: visible(q_idx, kv_idx, window),
                                    seq_lengths=(S, S))


def decode_block_mask(block_mask: BlockMask, input_pos: torch.Tensor) -> BlockMask:
    """The row of block_mask for one query at position input_pos (shape (1,)).

    Tensor indexing keeps it a static-shape operation inside a CUDA graph; the
    mask function is shifted so that query index 0 means position input_pos."""
    row = block_mask[:, :, input_pos // block_mask.BLOCK_SIZE[0]]
    base = block_mask.mask_mod
    row.mask_mod = lambda b, h, q_idx, kv_idx: base(b, h, q_idx + input_pos[0], kv_idx)
    row.seq_lengths = (1, block_mask.seq_lengths[1])
    return row


def rows_block_mask(max_seq_length: int, input_pos: torch.Tensor, window: int | None = None,
                    block: int = 128) -> BlockMask:
    """The cache blocks that T queries at the consecutive positions input_pos
    (T,) can see, from the first query's window start (0 without a window) to
    the last query's block, made on the device (a static-shape operation in a
    CUDA graph). Every listed block is checked by the mask function: a block
    wholly visible to the last query may be partly visible to the first."""
    n = -(-max_seq_length // block)
    first, last = input_pos[0], input_pos[-1]
    low = (first - window + 1).clamp(min=0) // block if window else torch.zeros_like(first)
    count = (last // block - low + 1).to(torch.int32).view(1, 1, 1)
    indices = (low + torch.arange(n, device=input_pos.device)).clamp(max=n - 1).to(torch.int32).view(1, 1, 1, n)
    # (no block is listed as wholly visible, but the empty list is given: inductor's CPU
    # flex attention fails to compile without one)
    return BlockMask.from_kv_blocks(count, indices, torch.zeros_like(count), torch.zeros_like(indices), BLOCK_SIZE=block,
                                    mask_mod=lambda b, h, q_idx, kv_idx: visible(q_idx + first, kv_idx, window),
                                    seq_lengths=(input_pos.shape[0], max_seq_length), compute_q_blocks=False)


def layer_part(name: str) -> str:
    """A layer tensor's name within its layer, an expert's as the dense MLP's
    ("layers.3.feed_forward.experts.5.w2.weight" -> "feed_forward.w2.weight");
    "" outside the layers."""
    local = name.split(".", 2)[2] if name.startswith("layers.") else ""
    if local.startswith("feed_forward.experts."):
        local = "feed_forward." + local.split(".", 3)[3]
    return local


def canonical_names(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every weight a checkpoint must provide, with its shape."""
    a = args
    qkv = (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
    names = {"tok_embeddings.weight": (a.vocab_size, a.hidden_size), "norm.weight": (a.hidden_size,)}
    if not a.tie_word_embeddings:
        names["output.weight"] = (a.vocab_size, a.hidden_size)
    for i in range(a.num_hidden_layers):
        p = f"layers.{i}."
        names[p + "attention_norm.weight"] = (a.hidden_size,)
        names[p + "attention.wqkv.weight"] = (qkv, a.hidden_size)
        if a.attention_bias:
            names[p + "attention.wqkv.bias"] = (qkv,)
        if a.qk_norm:
            names[p + "attention.q_norm.weight"] = names[p + "attention.k_norm.weight"] = (a.head_dim,)
        names[p + "attention.wo.weight"] = (a.hidden_size, a.num_attention_heads * a.head_dim)
        names[p + "ffn_norm.weight"] = (a.hidden_size,)
        if a.sandwich_norms:
            names[p + "post_attention_norm.weight"] = names[p + "post_ffn_norm.weight"] = (a.hidden_size,)
        mlps, inner = [p + "feed_forward."], a.intermediate_size
        if a.num_local_experts:
            names[p + "feed_forward.gate.weight"] = (a.num_local_experts, a.hidden_size)
            mlps, inner = [f"{p}feed_forward.experts.{e}." for e in range(a.num_local_experts)], \
                a.moe_intermediate_size or a.intermediate_size
        for mlp in mlps:
            names[mlp + "w13.weight"] = (2 * inner, a.hidden_size)
            names[mlp + "w2.weight"] = (a.hidden_size, inner)
    return names


def build_model(args: ModelArgs, state_dict: dict[str, torch.Tensor],
                formats: dict[str, Format] | None = None) -> Transformer:
    """Make a Transformer whose parameters are the given tensors (no copy).

    The module is created on the meta device and the tensors assigned, so the
    weights exist once, wherever the reader put them. A weight stored in one
    of `formats` (quantize.FORMATS: `W_int8`, `W_int4`, ... entries) becomes
    that format's module; so does a quantized embedding table. The tensors
    stay as stored: `Transformer.prepare` lays them out for a device."""
    formats = formats or {}
    expected = canonical_names(args)
    stored = {}
    for name, shape in expected.items():
        if name in state_dict:
            if tuple(state_dict[name].shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(state_dict[name].shape)}, "
                                 f"expected {shape}")
            continue
        found = format_entries(state_dict, name, formats)
        if found is None:
            missing = [n for n in expected if n not in state_dict and format_entries(state_dict, n, formats) is None]
            hint = " (stored quantized: build_model needs the formats, quantize.FORMATS)" \
                if not formats and any(k.startswith(name + "_") for k in state_dict) else ""
            raise ValueError(f"missing tensor {name!r} ({len(missing)} missing){hint}")
        if not formats[found[0]].fits(found[1], shape):
            raise ValueError(f"quantized tensor {name!r} does not fit shape {shape}")
        stored[name] = found
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict({n: state_dict[n] for n in expected if n in state_dict},
                          strict=False, assign=True)
    model.tie_weights()
    dtype = model.norm.weight.dtype
    for name, (kind, parts) in stored.items():
        if name == "tok_embeddings.weight":
            model.tok_embeddings = formats[kind].embedding(parts, dtype)
            continue
        path, _ = name.rsplit(".", 1)  # "layers.3.attention.wqkv"
        parent_path, attr = path.rsplit(".", 1) if "." in path else ("", path)
        parent = model.get_submodule(parent_path)
        bias = state_dict.get(path + ".bias")
        setattr(parent, attr, formats[kind].linear(parts, expected[name][1], dtype, bias))
    return model.eval().requires_grad_(False)


def random_state_dict(args: ModelArgs, dtype=torch.bfloat16, device="cpu", seed=0, std=0.02, transform=None):
    """Random weights in the model's real shapes: normal(0, std) matrices, norms at 1.

    For benchmarks where no checkpoint is at hand (never zeros: a GEMV over
    zeros can run faster than one over real data). transform(args, name,
    tensor) -> entries replaces each tensor as it is made (as
    checkpoints.load's does: quantized one tensor at a time)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in canonical_names(args).items():
        if name.endswith("norm.weight"):  # (scale 1)
            t = torch.full(shape, 1.0 - args.norm_offset, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
        state.update(transform(args, name, t) if transform else {name: t})
        del t
    return state
