"""Named model shapes, as data: the real configurations of well-known models.

Used with random weights (`brisk generate --preset NAME`, `brisk bench`) where
no checkpoint is at hand. Values follow each model's published config.json.
"""
from __future__ import annotations

from .model import ModelArgs

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=4096),
    "llama-2-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=40, num_attention_heads=40, max_position_embeddings=4096),
    "llama-2-70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        max_position_embeddings=4096),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                         max_position_embeddings=131072),
    "llama-3.1-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                          max_position_embeddings=131072),
    "llama-3.1-405b": dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                           num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                           rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                           max_position_embeddings=131072),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
                         max_position_embeddings=131072),
    "mistral-7b": dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=1000000.0, max_position_embeddings=32768),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=True,
                       max_position_embeddings=32768),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, max_position_embeddings=40960),
    "phi-4": dict(vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=10, rope_theta=250000.0,
                  max_position_embeddings=16384),
    # (its LongRoPE factors left out: they change RoPE's values, not the step's work)
    "phi-4-mini": dict(vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                       num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
                       tie_word_embeddings=True, max_position_embeddings=131072),
    "smollm3-3b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                       rms_norm_eps=1e-6, rope_theta=5000000.0, tie_word_embeddings=True,
                       no_rope_layers=[0 if (i + 1) % 4 == 0 else 1 for i in range(36)],
                       max_position_embeddings=65536),
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=1000000.0,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768),
    "tiny-moe": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     max_position_embeddings=256),
    "gemma-3-12b": dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6,
                        rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                        rope_local_base_freq=10000.0, sliding_window=1024,
                        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                     for i in range(48)],
                        hidden_act="gelu_pytorch_tanh", embed_scale=3840 ** 0.5, norm_offset=1.0,
                        sandwich_norms=True, qk_norm=True, query_pre_attn_scalar=256,
                        tie_word_embeddings=True, max_position_embeddings=131072),
}


def preset(name: str) -> ModelArgs:
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return ModelArgs(**PRESETS[key])
