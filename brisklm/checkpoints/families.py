"""The model families the readers know, one entry each: their names in a
Hugging Face config.json and a GGUF file, what their files leave implicit,
and their tensor names where they differ from Llama's.

The model itself knows features, not families (ModelArgs: q/k norms, norms
after attention and the MLP, layers without RoPE, sliding windows, experts);
an entry here says which features a family has. A Llama-like family is one
more entry (and a test against transformers)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import BriskError


@dataclass(frozen=True)
class Family:
    name: str
    hf: tuple[str, ...] = ()  # config.json's "architectures" classes, then its "model_type" values
    model_types: tuple[str, ...] = ()
    gguf: str | None = None  # a GGUF file's general.architecture
    fixed: dict = field(default_factory=dict)  # ModelArgs fields the family always has
    hf_defaults: dict = field(default_factory=dict)  # config.json fields its files may leave out
    hf_more: Callable[[dict, str], dict] | None = None  # (config, path) -> more of what config.json implies
    gguf_more: Callable[[dict, Callable], dict] | None = None  # (args, get) -> what llama.cpp fixes, not stores
    gguf_names: dict = field(default_factory=dict)  # GGUF per-layer names -> HF ones, beyond Llama's
    permuted_qk: bool = False  # llama.cpp's converter permuted q/k rows for its interleaved RoPE

    def hf_config(self, config: dict, path: str) -> dict:
        """config.json with what the family leaves implicit filled in."""
        config = {**self.hf_defaults, **config, **self.fixed}
        return self.hf_more(config, path) if self.hf_more else config

    def gguf_args(self, args: dict, get) -> dict:
        """The ModelArgs fields read from a GGUF file's metadata, with what the family fixes."""
        args = {**args, **self.fixed}
        return {**args, **self.gguf_more(args, get)} if self.gguf_more else args


def gemma3_config(config: dict, path: str) -> dict:
    """Gemma 3's choices that its config.json may leave out (its older keys
    sliding_window_pattern and rope_local_base_freq included)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise BriskError(f"{path}: {key} is not supported yet")
    n, every = config.get("num_hidden_layers", 26), config.get("sliding_window_pattern", 6)
    config.setdefault("layer_types", ["sliding_attention" if (i + 1) % every else "full_attention"
                                      for i in range(n)])
    config.setdefault("rope_local_base_freq", 1e4)
    config.setdefault("hidden_activation", "gelu_pytorch_tanh")
    return dict(config, embed_scale=config.get("hidden_size", 2304) ** 0.5,
                tie_word_embeddings=config.get("tie_word_embeddings", True))


def gemma3_args(args: dict, get) -> dict:
    """What llama.cpp fixes for Gemma 3 rather than stores: every sixth layer
    global (unless the file lists the pattern), the sliding layers' RoPE base
    10000, and attention scaled by head_dim**-0.5, or by (hidden / heads)**-0.5
    for the 62-layer 27B model (its query_pre_attn_scalar)."""
    n = args["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern", 6, required=False)
    sliding = ([bool(p) for p in pattern] if isinstance(pattern, (list, tuple))
               else [bool((i + 1) % pattern) for i in range(n)])
    return dict(sliding_window=get("attention.sliding_window"), rope_local_base_freq=10000.0,
                layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
                query_pre_attn_scalar=args["hidden_size"] // args["num_attention_heads"] if n == 62
                else args["head_dim"], hidden_act="gelu_pytorch_tanh", embed_scale=args["hidden_size"] ** 0.5)


def qwen3_moe_config(config: dict, path: str) -> dict:
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise BriskError(f"{path}: dense layers among the experts' (decoder_sparse_step, mlp_only_layers) "
                         f"are not supported yet")
    return config


def smollm3_args(args: dict, get) -> dict:
    """llama.cpp fixes SmolLM3's layers without RoPE: every fourth."""
    return {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(args["num_hidden_layers"])]}


FAMILIES = [
    # (a GGUF 'llama' file is also Mistral's, SmolLM2's or Mixtral's)
    Family("llama", ("LlamaForCausalLM",), ("llama",), gguf="llama", permuted_qk=True),
    Family("mistral", ("MistralForCausalLM",), ("mistral",)),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",)),
    Family("ministral", ("MinistralForCausalLM",), ("ministral",)),  # (its layer_types: sliding and full layers)
    # Qwen2: bias on q/k/v; a window listed in its config is used only where use_sliding_window says so
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), gguf="qwen2", fixed={"attention_bias": True},
           hf_defaults={"use_sliding_window": False}),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), gguf="qwen3", fixed={"qk_norm": True}),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), gguf="qwen3moe", fixed={"qk_norm": True},
           hf_defaults={"norm_topk_prob": False}, hf_more=qwen3_moe_config),
    Family("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), gguf="smollm3", permuted_qk=True,
           gguf_more=smollm3_args),
    # Phi-3 / Phi-4: q/k/v in one tensor, and gate/up (Hugging Face stores them so too)
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), gguf="phi3",
           gguf_names={"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}),
    # Gemma 3: q/k norms, a norm after attention and after the MLP too (llama.cpp's ffn_norm is the
    # one before the MLP), (1 + w) norms, scaled embeddings, sliding layers with their own RoPE base
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), gguf="gemma3",
           fixed={"qk_norm": True, "sandwich_norms": True, "norm_offset": 1.0},
           hf_defaults={"rope_theta": 1e6, "query_pre_attn_scalar": 256}, hf_more=gemma3_config,
           gguf_more=gemma3_args,
           gguf_names={"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                       "post_attention_norm.weight": "post_attention_layernorm.weight",
                       "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}),
]


def from_hf(config: dict, path: str) -> Family:
    """The family of a config.json, by its first architecture class (else its model_type)."""
    arch = (config.get("architectures") or [None])[0]
    model_type = config.get("model_type")
    for family in FAMILIES:
        if arch in family.hf if arch else model_type in family.model_types:
            return family
    raise BriskError(f"{path}: unsupported architecture {arch or model_type!r} "
                     f"(supported: {', '.join(c for f in FAMILIES for c in f.hf)})")


def from_gguf(arch: str | None, path: str) -> Family:
    """The family of a GGUF file's general.architecture."""
    for family in FAMILIES:
        if family.gguf is not None and family.gguf == arch:
            return family
    raise BriskError(f"{path}: unsupported architecture {arch!r} in general.architecture "
                     f"(supported: {', '.join(f.gguf for f in FAMILIES if f.gguf)})")

