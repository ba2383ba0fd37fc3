"""Our GGUF reader and our Hugging Face reader give identical tensors for the same weights.

The GGUF file is written at test time with the `gguf` library, laid out as
llama.cpp's converter lays out a Llama model (q/k rows permuted for
interleaved RoPE, shapes reversed, GGUF tensor names).
"""
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from brisklm.checkpoints import load  # noqa: E402
from brisklm.model import build_model  # noqa: E402
from brisklm.quantize import FORMATS  # noqa: E402

CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, rope_theta=10000.0)


def llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path, np_dtype=np.float32, tied=False, arch="llama"):
    """llama.cpp's layout: q/k rows permuted for architecture llama only; q/k
    norms (qwen3) as attn_q_norm / attn_k_norm."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = getattr(c, "rope_parameters", None) or {}  # (transformers >= 5 nests rope_theta there)
    if arch != "gemma3":  # (one entry per layer kind, below)
        w.add_rope_freq_base(float(getattr(c, "rope_theta", None) or rope.get("rope_theta", 10000.0)))
    if getattr(c, "head_dim", None):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([chr(0x100 + i) for i in range(c.vocab_size)])
    w.add_token_types([1] * c.vocab_size)
    w.add_token_merges([])
    w.add_eos_token_id(2)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        per_layer.update({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})
    if arch == "gemma3":  # llama.cpp: norms stored as 1 + w; the window, the pattern, the rope scaling
        per_layer.update({"post_attention_layernorm": "post_attention_norm",
                          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"})
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":  # fused q/k/v and gate/up; LongRoPE's factors as tensors
        for key in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            per_layer.pop(key)
        per_layer.update({"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"})
        scaling = c.rope_parameters
        head_dim = c.hidden_size // c.num_attention_heads
        w.add_rope_dimension_count(int(head_dim * scaling.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        for kind in ("long", "short"):
            sd[f"rope_factors_{kind}"] = np.array(scaling[f"{kind}_factor"], dtype=np.float32)
            names[f"rope_factors_{kind}"] = f"rope_factors_{kind}.weight"
    experts = getattr(c, "num_local_experts", 0) or 0
    if experts:  # llama.cpp's MoE layout: the router, and each projection's experts in one tensor
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        inner = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(inner)
            w.add_expert_weights_norm(bool(c.norm_topk_prob))
        for key in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            per_layer.pop(key)
        per_layer["mlp.gate"] = "ffn_gate_inp"
        for i in range(c.num_hidden_layers):  # (transformers holds them as gate_up_proj, down_proj)
            p = f"model.layers.{i}."
            gate_up = sd[p + "mlp.experts.gate_up_proj"]
            stacked = {"ffn_gate_exps": gate_up[:, :inner], "ffn_up_exps": gate_up[:, inner:],
                       "ffn_down_exps": sd[p + "mlp.experts.down_proj"]}
            for gg, t in stacked.items():
                sd[p + gg], names[p + gg] = t, f"blk.{i}.{gg}.weight"
    for i in range(c.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf, gg in names.items():
        t = sd[hf] + (1 if arch == "gemma3" and hf.endswith("norm.weight") else 0)
        if arch not in ("llama", "smollm3"):  # (whose converter permutes q and k)
            pass
        elif gg.endswith("attn_q.weight"):
            t = llama_cpp_permute(t, c.num_attention_heads)
        elif gg.endswith("attn_k.weight"):
            t = llama_cpp_permute(t, c.num_key_value_heads)
        w.add_tensor(gg, np.ascontiguousarray(t.astype(np.float32 if t.ndim == 1 else np_dtype)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_logits_match(ckpt, model, tokens: int, cache: int):
    """Our model built from ckpt gives transformers' fp32 logits (<= 1e-4) on seeded random ids."""
    ours = build_model(ckpt.args, ckpt.state_dict, FORMATS)
    ours.setup_caches(1, cache)
    ids = torch.randint(0, 97, (1, tokens), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(ids, torch.arange(tokens)) - model(ids).logits).abs().max() <= 1e-4


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def hf_model(request, tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=request.param)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "hf")
    return model, request.param


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16], ids=["F32", "F16"])
def test_gguf_and_hf_readers_give_identical_tensors(tmp_path, hf_model, np_dtype):
    model, tied = hf_model
    if np_dtype == np.float16:  # both sides hold the same fp16-rounded values
        model.half().save_pretrained(tmp_path / "hf")
    write_gguf(model, tmp_path / "m.gguf", np_dtype, tied)
    from_hf = load(str(tmp_path / "hf"), dtype=torch.float32)
    from_gguf = load(str(tmp_path / "m.gguf"), dtype=torch.float32)
    assert from_gguf.args == from_hf.args
    assert from_gguf.state_dict.keys() == from_hf.state_dict.keys()
    for name, t in from_hf.state_dict.items():
        assert torch.equal(from_gguf.state_dict[name], t), name


def test_gguf_model_matches_transformers_logits(tmp_path, hf_model):
    model, tied = hf_model
    write_gguf(model, tmp_path / "m.gguf", tied=tied)
    ckpt = load(str(tmp_path / "m.gguf"), dtype=torch.float32)
    assert_logits_match(ckpt, model, tokens=12, cache=32)


def test_qwen3_gguf_matches_transformers_logits(tmp_path):
    """Qwen3 (q/k norms, head_dim not hidden / heads) written in llama.cpp's
    qwen3 layout: logits equal transformers' to 1e-4, the same as its HF folder."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**CONFIG, "rope_theta": 1e6}, head_dim=32,
                                      tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    write_gguf(model, tmp_path / "q3.gguf", arch="qwen3")
    ckpt = load(str(tmp_path / "q3.gguf"), dtype=torch.float32)
    assert ckpt.args.qk_norm and ckpt.args.head_dim == 32 and not ckpt.args.attention_bias
    assert_logits_match(ckpt, model, tokens=12, cache=32)


def write_q8_0_copy(tmp_path, model, tied, suffixes=("ffn_down.weight",)):
    """The model's GGUF rewritten with the named tensors quantized to Q8_0 by the
    gguf library -> (path, {tensor name: the values it dequantizes to})."""
    write_gguf(model, tmp_path / "m.gguf", tied=tied)
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    expected = {}
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name.endswith(suffixes):
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            expected[t.name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(tmp_path / "q.gguf"), expected


def test_gemma3_gguf_matches_transformers_logits(tmp_path):
    """Gemma 3 in llama.cpp's gemma3 layout (norms stored as 1 + w, four a
    layer, sliding and global layers with the pattern listed, linear RoPE
    scaling on the global ones): logits equal transformers' to 1e-4."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        **{**CONFIG, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=32, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
        pad_token_id=0, bos_token_id=2, eos_token_id=1)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    write_gguf(model, tmp_path / "g3.gguf", tied=True, arch="gemma3")
    ckpt = load(str(tmp_path / "g3.gguf"), dtype=torch.float32)
    assert ckpt.args.layer_types == config.layer_types and ckpt.args.sandwich_norms
    assert_logits_match(ckpt, model, tokens=20, cache=32)


def test_smollm3_gguf_every_fourth_layer_without_rope_matches_transformers_logits(tmp_path):
    torch.manual_seed(0)
    config = transformers.SmolLM3Config(**{**CONFIG, "num_hidden_layers": 4}, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2, tie_word_embeddings=True)
    assert config.no_rope_layers == [1, 1, 1, 0]
    model = transformers.SmolLM3ForCausalLM(config).eval()
    write_gguf(model, tmp_path / "s3.gguf", tied=True, arch="smollm3")
    ckpt = load(str(tmp_path / "s3.gguf"), dtype=torch.float32)
    assert ckpt.args.no_rope_layers == [1, 1, 1, 0]
    assert_logits_match(ckpt, model, tokens=20, cache=32)


def test_phi3_gguf_with_longrope_matches_transformers_logits(tmp_path):
    """Phi-3 in llama.cpp's phi3 layout (attn_qkv, gate and up in ffn_up,
    rope_factors_long / rope_factors_short): logits equal transformers' to 1e-4."""
    torch.manual_seed(0)
    config = transformers.Phi3Config(**{**CONFIG, "max_position_embeddings": 256}, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2, tie_word_embeddings=False, original_max_position_embeddings=64,
                                     rope_scaling={"rope_type": "longrope",
                                                   "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                                                   "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0]})
    model = transformers.Phi3ForCausalLM(config).eval()
    write_gguf(model, tmp_path / "phi3.gguf", arch="phi3")
    ckpt = load(str(tmp_path / "phi3.gguf"), dtype=torch.float32)
    assert ckpt.args.rope_scaling["rope_type"] == "longrope"
    assert_logits_match(ckpt, model, tokens=20, cache=64)  # (within the original context: the short factors)


def test_phi4_mini_gguf_with_partial_rotary_matches_transformers_logits(tmp_path):
    """Phi-4-mini's RoPE on the first 3/4 of each head's dims (rope.dimension_count
    12 of 16), LongRoPE, a tied output layer: logits equal transformers' to 1e-4,
    from the GGUF and from the native folder `brisk convert` writes of it (which
    keeps q's and k's dims in the order the model turns them)."""
    from brisklm.checkpoints.native import save_native
    torch.manual_seed(0)
    config = transformers.Phi3Config(**{**CONFIG, "max_position_embeddings": 256}, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2, tie_word_embeddings=True, original_max_position_embeddings=64,
                                     partial_rotary_factor=0.75,
                                     rope_scaling={"rope_type": "longrope",
                                                   "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
                                                   "long_factor": [1.0, 3.0, 6.0, 12.0, 24.0, 32.0]})
    model = transformers.Phi3ForCausalLM(config).eval()
    write_gguf(model, tmp_path / "phi4mini.gguf", arch="phi3", tied=True)
    ckpt = load(str(tmp_path / "phi4mini.gguf"), dtype=torch.float32)
    assert ckpt.args.partial_rotary_factor == 0.75
    assert_logits_match(ckpt, model, tokens=20, cache=64)
    save_native(str(tmp_path / "native"), ckpt.args, ckpt.state_dict, ckpt.tokenizer)
    assert_logits_match(load(str(tmp_path / "native"), dtype=torch.float32), model, tokens=20, cache=64)


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"], ids=["mixtral", "qwen3moe"])
def test_moe_gguf_in_llama_cpp_stacked_expert_layout_matches_transformers(tmp_path, arch):
    """Mixtral (architecture llama with expert_count) and Qwen3-MoE written as
    llama.cpp writes them (ffn_gate_inp, and ffn_gate_exps / ffn_up_exps /
    ffn_down_exps holding every expert): logits equal transformers' to 1e-4."""
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.MixtralConfig(**CONFIG, num_local_experts=4, num_experts_per_tok=2,
                                            tie_word_embeddings=False)
        model = transformers.MixtralForCausalLM(config).eval()
    else:
        config = transformers.Qwen3MoeConfig(**CONFIG, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=48, norm_topk_prob=True, tie_word_embeddings=False)
        model = transformers.Qwen3MoeForCausalLM(config).eval()
    write_gguf(model, tmp_path / "moe.gguf", arch=arch)
    ckpt = load(str(tmp_path / "moe.gguf"), dtype=torch.float32)
    assert ckpt.args.num_local_experts == 4 and ckpt.args.num_experts_per_tok == 2
    assert_logits_match(ckpt, model, tokens=12, cache=32)


def test_quantized_gguf_tensors_are_dequantized_by_the_gguf_library(tmp_path, hf_model):
    """Q8_0 blocks read back as gguf.quants.dequantize gives them (no hand-written decoder)."""
    model, tied = hf_model
    path, expected = write_q8_0_copy(tmp_path, model, tied)
    ckpt = load(path, dtype=torch.float32)
    for name, values in expected.items():
        layer = name.split(".")[1]
        got = ckpt.state_dict[f"layers.{layer}.feed_forward.w2.weight"]
        assert torch.equal(got, torch.from_numpy(values))


def test_q8_0_matrices_are_kept_as_grouped_int8_where_our_gemv_runs(tmp_path, hf_model, monkeypatch):
    """Where the Triton GEMV runs (CUDA), Q8_0 matrices stay int8 with their
    fp16 scale per 32 inputs: exactly the values the gguf library decodes, q/k
    rows un-permuted like the dense ones. (On CPUs only the output layer is
    kept; the kernel itself is checked in test_kernels.py. The model below runs
    on the CPU: its int8 matrices group by group through aten's int8 matmul.)"""
    from brisklm import loading
    from brisklm.kernels import gemv
    from brisklm.quantize import GroupedInt8Linear, dequantize, quantized_entries
    model, tied = hf_model
    path, _ = write_q8_0_copy(tmp_path, model, tied, ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                       "ffn_down.weight"))
    dense = load(path, dtype=torch.float32)
    assert loading.gguf_blocks_to_keep("cpu") == "output"  # the policy here: Q8_0 layers dequantized
    assert not quantized_entries(load(path, dtype=torch.float32, keep_gguf_blocks="output").state_dict,
                                 "layers.0.feed_forward.w2.weight")
    import brisklm.kernels
    monkeypatch.setattr(brisklm.kernels, "may_run", lambda device: True)
    monkeypatch.setattr(gemv, "available", lambda device: True)
    assert loading.gguf_blocks_to_keep("cpu") == "all"  # where the GEMVs run: kept
    monkeypatch.undo()
    kept = load(path, dtype=torch.float32, keep_gguf_blocks="all")
    for name in ("layers.1.attention.wqkv.weight", "layers.0.feed_forward.w2.weight"):
        parts = quantized_entries(kept.state_dict, name)
        assert parts["int8"].dtype == torch.int8 and parts["scale"].shape[1] == parts["int8"].shape[1] // 32
        assert torch.equal(dequantize(parts), dense.state_dict[name])
    ours = build_model(kept.args, kept.state_dict, FORMATS)
    assert isinstance(ours.layers[0].feed_forward.w2, GroupedInt8Linear)
    ref = build_model(dense.args, dense.state_dict, FORMATS)
    ids = torch.tensor([[1, 7, 42, 3]])
    for m in (ours, ref):
        m.setup_caches(1, 16)
    with torch.no_grad():
        assert torch.allclose(ours(ids, torch.arange(4)), ref(ids, torch.arange(4)), rtol=1e-5, atol=1e-5)


def test_quantize_gguf_writes_every_q8_0_matrix_as_stored(tmp_path, hf_model):
    """`brisk quantize --mode gguf` keeps every Q8_0 matrix as int8 with its
    scales, on a CPU too (where loading the GGUF itself dequantizes the layers'
    Q8_0 matrices for speed): the checkpoint reloads to the same values and
    logits as the file read dense."""
    from brisklm.cli import main
    from brisklm.quantize import GroupedInt8Linear, dequantize, quantized_entries
    model, tied = hf_model
    path, _ = write_q8_0_copy(tmp_path, model, tied, ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                       "ffn_down.weight"))
    out = tmp_path / "native"
    assert main(["quantize", "--checkpoint_path", path, "--mode", "gguf", "--dtype", "float32",
                 "--output", str(out)]) == 0
    dense = load(path, dtype=torch.float32)
    again = load(str(out), dtype=torch.float32)
    for name in ("layers.0.attention.wqkv.weight", "layers.1.feed_forward.w2.weight"):
        parts = quantized_entries(again.state_dict, name)
        assert parts["int8"].dtype == torch.int8 and parts["scale"].shape[1] == parts["int8"].shape[1] // 32
        assert torch.equal(dequantize(parts), dense.state_dict[name])
    ours, ref = build_model(again.args, again.state_dict, FORMATS), build_model(dense.args, dense.state_dict, FORMATS)
    assert isinstance(ours.layers[1].feed_forward.w2, GroupedInt8Linear)
    ids = torch.tensor([[1, 7, 42, 3]])
    for m in (ours, ref):
        m.setup_caches(1, 16)
    with torch.no_grad():
        assert torch.allclose(ours(ids, torch.arange(4)), ref(ids, torch.arange(4)), rtol=1e-5, atol=1e-5)
