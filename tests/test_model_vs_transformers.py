"""fp32 logits of our model equal Hugging Face transformers' on the same weights.

Tiny random configurations are built with transformers at test time and saved
as Hugging Face folders; we load them through our own reader. Tolerance: max
abs difference <= 1e-4 on logits of order 1.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from brisklm.checkpoints import load  # noqa: E402
from brisklm.model import build_model  # noqa: E402
from brisklm.quantize import FORMATS  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
            rms_norm_eps=1e-5)

CASES = {
    "llama-mha-tied": ("LlamaConfig", "LlamaForCausalLM",
                       dict(BASE, tie_word_embeddings=True, rope_theta=10000.0)),
    "llama-gqa-llama3-rope": ("LlamaConfig", "LlamaForCausalLM",
                              dict(BASE, num_key_value_heads=2, rope_theta=500000.0,
                                   rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama-linear-rope-headdim": ("LlamaConfig", "LlamaForCausalLM",
                                  dict(BASE, num_key_value_heads=1, head_dim=32,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral-gqa": ("MistralConfig", "MistralForCausalLM",
                    dict(BASE, num_key_value_heads=2, rope_theta=1e6, sliding_window=None)),
    "mistral-sliding-window": ("MistralConfig", "MistralForCausalLM",  # binds from the 7th token
                               dict(BASE, num_key_value_heads=2, rope_theta=1e6, sliding_window=6)),
    "ministral-sliding-and-full-layers": ("MinistralConfig", "MinistralForCausalLM",  # one entry in families.py
                                          dict(BASE, num_key_value_heads=2, head_dim=16, rope_theta=1e6, sliding_window=6,
                                               layer_types=["sliding_attention", "full_attention"],
                                               tie_word_embeddings=False)),
    "qwen2-sliding-window-every-layer": ("Qwen2Config", "Qwen2ForCausalLM",
                                         dict(BASE, num_key_value_heads=2, use_sliding_window=True,
                                              sliding_window=6, max_window_layers=0)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(BASE, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3-qk-norm-headdim": ("Qwen3Config", "Qwen3ForCausalLM",  # head_dim not hidden / heads
                              dict(BASE, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
                                   tie_word_embeddings=False)),
    "phi3-fused-qkv-and-gate-up": ("Phi3Config", "Phi3ForCausalLM",  # stored fused in the checkpoint
                                   dict(BASE, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2, tie_word_embeddings=False)),
    "smollm3-a-layer-without-rope": ("SmolLM3Config", "SmolLM3ForCausalLM",
                                     dict(BASE, num_key_value_heads=2, no_rope_layers=[1, 0], rope_theta=5e6,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                          tie_word_embeddings=True)),
    "gemma3-sliding-and-global-layers": ("Gemma3TextConfig", "Gemma3ForCausalLM",  # (1 + w) norms, GeGLU,
                                         dict(BASE, num_hidden_layers=3, num_key_value_heads=2, head_dim=32,
                                              query_pre_attn_scalar=24, sliding_window=6,
                                              layer_types=["sliding_attention", "full_attention",
                                                           "sliding_attention"],
                                              rope_parameters={
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                  "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                     "rope_theta": 1e6}},
                                              pad_token_id=0, bos_token_id=2, eos_token_id=1)),
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM",  # LongRoPE's short factors and attention factor
                      dict(BASE, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           tie_word_embeddings=False, max_position_embeddings=256,
                           original_max_position_embeddings=64,
                           rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                                         "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0]})),
    "phi3-partial-rotary-longrope": ("Phi3Config", "Phi3ForCausalLM",  # Phi-4-mini: RoPE on 12 of 16 dims
                                     dict(BASE, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2, tie_word_embeddings=True, max_position_embeddings=256,
                                          original_max_position_embeddings=64, partial_rotary_factor=0.75,
                                          rope_scaling={"rope_type": "longrope",
                                                        "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
                                                        "long_factor": [1.0, 3.0, 6.0, 12.0, 24.0, 32.0]})),
    "mixtral-4-experts-top2": ("MixtralConfig", "MixtralForCausalLM",  # the router's weights renormalized
                               dict(BASE, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                    rope_theta=1e6, sliding_window=None, tie_word_embeddings=False)),
    "qwen3-moe-not-renormalized": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",  # expert size of its own
                                   dict(BASE, num_key_value_heads=2, head_dim=32, num_experts=5,
                                        num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False,
                                        tie_word_embeddings=False)),
}


def make_folder(tmp_path, case):
    config_cls, model_cls, kwargs = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random norms and biases too, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref = make_folder(tmp_path, case)
    ckpt = load(str(tmp_path), dtype=torch.float32)
    ours = build_model(ckpt.args, ckpt.state_dict, FORMATS)
    ours.setup_caches(1, 64)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        # Prefill the first 16 tokens, then decode the rest one at a time.
        got = [ours(ids[:, :16], torch.arange(16))]
        for t in range(16, 24):
            got.append(ours(ids[:, t:t + 1], torch.tensor([t])))
    got = torch.cat(got, dim=1)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_a_rope_scaling_or_partial_rotary_not_supported_is_one_line_naming_it(tmp_path):
    from brisklm.errors import BriskError
    for case, change, word in (("phi3-fused-qkv-and-gate-up", {"partial_rotary_factor": 0.3}, "partial_rotary"),
                               ("llama-mha-tied", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn")):
        make_folder(tmp_path, case)
        config = json.loads((tmp_path / "config.json").read_text())
        config.update(change)
        config.pop("rope_parameters", None)
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(BriskError, match=word) as e:
            load(str(tmp_path), dtype=torch.float32)
        assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_decode_with_exact_kv_len_matches_full_cache(tmp_path):
    make_folder(tmp_path, "llama-gqa-llama3-rope")
    ckpt = load(str(tmp_path), dtype=torch.float32)
    model = build_model(ckpt.args, ckpt.state_dict, FORMATS)
    model.setup_caches(1, 64)
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids[:, :9], torch.arange(9))
        full = model(ids[:, 9:], torch.tensor([9]))
        sliced = model(ids[:, 9:], torch.tensor([9]), kv_len=10)
    assert torch.allclose(full, sliced, atol=1e-5)


def test_gemma3_config_in_the_older_keys_loads_the_same_model(tmp_path):
    """Hub configs written before transformers 5 give rope_theta,
    rope_local_base_freq, rope_scaling and sliding_window_pattern (no
    layer_types): the same layers and logits as the nested form."""
    ref = make_folder(tmp_path, "gemma3-sliding-and-global-layers")
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        config.pop(key)
    config.update(sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = load(str(tmp_path), dtype=torch.float32)
    assert ckpt.args.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    ours = build_model(ckpt.args, ckpt.state_dict, FORMATS)
    ours.setup_caches(1, 64)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids, torch.arange(20)) - ref(ids).logits).abs().max().item() <= 1e-4


def greedy_reference(ref, prompt, steps):
    """transformers' own greedy continuation (no cache: every step recomputed)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, ref(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["gemma3-sliding-and-global-layers", "qwen3-qk-norm-headdim",
                                  "smollm3-a-layer-without-rope", "phi3-fused-qkv-and-gate-up",
                                  "phi3-partial-rotary-longrope", "mixtral-4-experts-top2",
                                  "qwen3-moe-not-renormalized"])
def test_greedy_tokens_over_32_steps_equal_transformers(tmp_path, case):
    from brisklm.generate import Generator
    from brisklm.sampling import SamplingParams
    ref = make_folder(tmp_path, case)
    ckpt = load(str(tmp_path), dtype=torch.float32)
    got = list(Generator(build_model(ckpt.args, ckpt.state_dict, FORMATS), 64).tokens([5, 7, 11, 13], 32, SamplingParams()))
    assert got == greedy_reference(ref, [5, 7, 11, 13], 32)


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("case, modes", [("gemma3-sliding-and-global-layers", ["none"]),
                                         ("mixtral-4-experts-top2", ["none", "int8", "int4"])])
def test_compiled_step_gives_the_eager_tokens_in_every_weight_format(tmp_path, case, modes):
    """The compiled decode step gives the eager tokens: Gemma 3's (flex
    attention, one block mask per window, two RoPE tables), Mixtral's in
    fp32, int8 and int4 (each token's experts indexed on the device in each
    format's tensors, where the eager step groups tokens by expert on the
    host; its attention's Linears are the formats' compiled matmuls too)."""
    from brisklm.generate import Generator
    from brisklm.quantize import quantize_state_dict
    from brisklm.sampling import SamplingParams
    make_folder(tmp_path, case)
    ckpt = load(str(tmp_path), dtype=torch.float32)
    for mode, groupsize in ((m, 32 if m == "int4" else 0) for m in modes):
        args, state = ((ckpt.args, ckpt.state_dict) if mode == "none" else
                       quantize_state_dict(ckpt.args, dict(ckpt.state_dict), mode, groupsize))
        runs = [list(Generator(build_model(args, state, FORMATS), 64, compile=compiled).tokens(
            [5, 7, 11, 13], 24, SamplingParams())) for compiled in (False, True)]
        assert runs[0] == runs[1], mode


@pytest.mark.slow
@pytest.mark.compile
def test_a_layer_without_rope_compiles_on_a_cpu_whole_and_as_a_block(tmp_path):
    """SmolLM3's layer without RoPE passes flex attention a query that is only
    a view (inductor's CPU template failed on it): the whole step (--compile)
    and the block compiled beside requests (brisk chat, serve) give eager's tokens."""
    from brisklm.api import LLM
    make_folder(tmp_path, "smollm3-a-layer-without-rope")
    ckpt = load(str(tmp_path), dtype=torch.float32)
    prompt = [5, 7, 11, 13, 5, 7]
    want = list(LLM(build_model(ckpt.args, ckpt.state_dict, FORMATS), None, max_seq_length=64).stream_ids(prompt, 16, stop_ids=()))
    for wait in (True, False):
        llm = LLM(build_model(ckpt.args, ckpt.state_dict, FORMATS), None, max_seq_length=64, compile=True)
        llm.warm_up(wait=wait, sampled=False, constrained=False)  # (the greedy step alone)
        llm.wait_compiled()
        assert llm.generator.steps.to_compile == ("whole" if wait else "block")
        assert list(llm.stream_ids(prompt, 16, stop_ids=())) == want


def test_longrope_takes_its_long_factors_when_the_cache_outgrows_the_original_context(tmp_path):
    """With a KV cache past original_max_position_embeddings (64 here) every
    position takes the long factors, as transformers does for a sequence past
    it (and llama.cpp for such a context): logits of an 80-token forward equal."""
    ref = make_folder(tmp_path, "phi3-longrope")
    ckpt = load(str(tmp_path), dtype=torch.float32)
    ours = build_model(ckpt.args, ckpt.state_dict, FORMATS)
    ours.setup_caches(1, 128)
    ids = torch.randint(0, 97, (1, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (ours(ids, torch.arange(80)) - ref(ids).logits).abs().max().item() <= 1e-4
        ours.setup_caches(1, 64)  # (the short factors: another model past position 64)
        assert (ours(ids[:, :64], torch.arange(64)) - ref(ids[:, :64]).logits).abs().max().item() <= 1e-4
