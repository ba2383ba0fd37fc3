"""Generation: the cached decode loop equals recomputing from scratch; stops, streaming, chat."""
import functools
import pytest
import torch

from brisklm.generate import Generator, weight_bytes_per_token
from brisklm.steps import PREFILL_BUCKETS, SHORT_REDUCTION_BLOCK, OnePassReductions, prefill_shape
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.sampling import SamplingParams

TINY = ModelArgs(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
GREEDY = SamplingParams()


def tiny_model(seed=0, args=TINY):
    return build_model(args, random_state_dict(args, torch.float32, seed=seed, std=0.3))


def reference_greedy(model, ids, n):
    """Greedy decoding by re-running the whole sequence at every step."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            model.setup_caches(1, 64)
            logits = model(torch.tensor([ids]), torch.arange(len(ids)))
            out.append(int(logits[0, -1].argmax()))
            ids.append(out[-1])
    return out


def test_cached_decoding_equals_recomputation():
    model = tiny_model()
    expected = reference_greedy(model, [1, 2, 3], 20)
    got = list(Generator(model, 64).tokens([1, 2, 3], 20, GREEDY))
    assert got == expected


def test_generation_stops_after_a_stop_token():
    model = tiny_model()
    free = list(Generator(model, 64).tokens([1, 2, 3], 20, GREEDY))
    stop = free[5]
    got = list(Generator(model, 64).tokens([1, 2, 3], 20, GREEDY, stop_ids=[stop]))
    assert got == free[:free.index(stop) + 1]


def test_a_prompt_extending_the_cache_prefills_only_the_new_part():
    model = tiny_model()
    gen = Generator(model, 64)
    first = list(gen.tokens([5, 6, 7], 6, GREEDY))
    follow = [5, 6, 7] + first + [9, 10]
    reused = list(gen.tokens(follow, 8, GREEDY))
    assert gen.stats.reused_tokens == 3 + len(first) - 1  # the last sampled token was never fed
    gen.reset()
    fresh = list(gen.tokens(follow, 8, GREEDY))
    assert gen.stats.reused_tokens == 0
    assert reused == fresh


def test_prefill_shapes_pad_to_a_bucket_and_round_the_keys_up():
    assert prefill_shape(0, 5, 8192) == (16, 16)
    assert prefill_shape(0, 17, 8192) == (32, 32)
    assert prefill_shape(300, 20, 8192) == (32, 512)  # a chat turn after 300 cached tokens
    assert prefill_shape(8000, 20, 8192) == (32, 8192)  # keys capped by the cache
    assert prefill_shape(8170, 20, 8192) is None  # the padding would run past the cache
    assert prefill_shape(0, PREFILL_BUCKETS[-1] + 1, 8192) is None  # a long prompt runs as it is


@pytest.mark.parametrize("args", [TINY, ModelArgs(**{**TINY.to_dict(), "sliding_window": 5})],
                         ids=["full", "window"])
def test_a_padded_prefill_generates_what_the_unpadded_one_does(args):
    """The padding a CUDA graph's prefill uses (Generator.prefill), run here
    without a graph: same tokens, also for a chat's later turns, whose keys
    follow cached ones and whose padding overwrote positions decode reuses."""
    model = tiny_model(args=args)
    plain, padded = Generator(model, 64), Generator(tiny_model(args=args), 64)
    padded.steps.graphed_prefill = padded.steps._prefill  # (on CUDA: replayed(forward))
    prompt = [3, 1, 4, 1, 5]
    for turn in range(3):
        a, b = list(plain.tokens(prompt, 7, GREEDY)), list(padded.tokens(prompt, 7, GREEDY))
        assert a == b, turn
        start = padded.stats.reused_tokens
        assert start == plain.stats.reused_tokens and prefill_shape(start, len(prompt) - start, 64)  # (padded)
        prompt = prompt + a + [7, 2]


def test_the_same_request_again_prefills_its_prompt_forward_again(smollm2_gguf):
    """A request whose prompt the cache holds whole runs the last prompt
    forward again (not its last token alone, whose one row rounds otherwise):
    in bf16 the bundled model then answers the same question the same way
    (before, 4 of 6 chat questions differed after 20-40 tokens, these two
    among them); a longer prompt still reuses the whole cache."""
    import brisklm
    llm = brisklm.load(smollm2_gguf, device="cpu", dtype="bfloat16")
    for question in ("Explain what a hash table is.", "How do vaccines work?"):
        messages = [{"role": "user", "content": question}]
        first = llm.chat(messages, max_new_tokens=60, temperature=0)
        reused = llm.stats.reused_tokens  # (the second question: the chat template's opening, cached)
        assert llm.chat(messages, max_new_tokens=60, temperature=0) == first
        assert llm.stats.reused_tokens == reused  # (the same prompt forward, both times)
    follow = llm.chat_ids(messages) + llm.tokenizer.encode(first, add_bos=False)
    list(llm.generator.tokens(follow + [11], 2, SamplingParams()))
    assert llm.stats.reused_tokens > len(follow) - 10


def test_a_diverging_prompt_reuses_only_the_common_prefix():
    model = tiny_model()
    gen = Generator(model, 64)
    list(gen.tokens([5, 6, 7, 8], 4, GREEDY))
    got = list(gen.tokens([5, 6, 9], 6, GREEDY))
    assert gen.stats.reused_tokens == 2
    assert got == reference_greedy(model, [5, 6, 9], 6)


def test_prompt_plus_new_tokens_must_fit_the_cache():
    gen = Generator(tiny_model(), 16)
    with pytest.raises(ValueError, match="KV cache of 16"):
        list(gen.tokens(list(range(10)), 10, GREEDY))


@pytest.mark.parametrize("length, window", [(1000, None), (1024, None), (2048, 300), (1500, 128)])
def test_the_causal_block_mask_equals_the_mask_evaluated_everywhere(length, window):
    from torch.nn.attention.flex_attention import create_block_mask
    from brisklm.model import causal_block_mask, visible
    dense = create_block_mask(lambda b, h, q, k: visible(q, k, window), None, None, length, length, device="cpu")
    made = causal_block_mask(length, "cpu", window)
    assert torch.equal(made.to_dense(), dense.to_dense())
    assert torch.equal(made.kv_num_blocks + made.full_kv_num_blocks, dense.kv_num_blocks + dense.full_kv_num_blocks)


def test_seeded_sampling_is_reproducible():
    model = tiny_model()
    params = SamplingParams(temperature=1.0, top_k=20)
    a = list(Generator(model, 64).tokens([1, 2], 15, params, seed=7))
    b = list(Generator(model, 64).tokens([1, 2], 15, params, seed=7))
    assert a == b
    assert list(Generator(model, 64).tokens([1, 2], 15, params, seed=8)) != a  # the noise is used


def test_weight_bytes_count_one_embedding_row_unless_tied():
    untied = tiny_model()
    matrices = sum(p.numel() for n, p in untied.named_parameters() if n != "tok_embeddings.weight")
    assert weight_bytes_per_token(untied) == (matrices + TINY.hidden_size) * 4
    tied_args = ModelArgs(**{**TINY.to_dict(), "tie_word_embeddings": True})
    tied = tiny_model(args=tied_args)
    assert weight_bytes_per_token(tied) == sum(p.numel() for p in tied.parameters()) * 4


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_decode_step_equals_eager():
    model = tiny_model()
    eager = list(Generator(model, 64).tokens([1, 2, 3], 12, GREEDY))
    compiled = list(Generator(model, 64, compile=True).tokens([1, 2, 3], 12, GREEDY))
    assert compiled == eager


@pytest.mark.compile
def test_compiled_q8_0_decode_step_equals_eager():
    """Q8_0 matrices (mode q8_0) in a bf16 model on a CPU: the compiled step
    reads them rows-last (GroupedInt8Linear's layout for it), wo straight after
    flex attention (which took no fused conversion of its output)."""
    from brisklm.quantize import FORMATS, quantize_state_dict
    args = ModelArgs(**{**TINY.to_dict(), "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16})  # every matrix in groups of 32
    args, state = quantize_state_dict(args, random_state_dict(args, torch.float32, std=0.1), "q8_0", 32)
    model = build_model(args, {n: t.bfloat16() if t.is_floating_point() else t for n, t in state.items()}, FORMATS)
    eager = list(Generator(model, 64).tokens([1, 2, 3], 12, GREEDY))
    compiled = list(Generator(model, 64, compile=True).tokens([1, 2, 3], 12, GREEDY))
    assert model.layers[0].attention.wo.layout == "rows_last"
    assert compiled == eager


@pytest.mark.compile
def test_sliding_window_decoding_equals_recomputation_eager_and_compiled():
    args = ModelArgs(**{**TINY.to_dict(), "sliding_window": 4})
    model = tiny_model(args=args)
    expected = reference_greedy(model, [1, 2, 3, 4, 5, 6], 12)  # the dense mask
    eager = list(Generator(model, 64).tokens([1, 2, 3, 4, 5, 6], 12, GREEDY))
    compiled = list(Generator(model, 64, compile=True).tokens([1, 2, 3, 4, 5, 6], 12, GREEDY))  # flex
    assert eager == expected and compiled == expected
    assert expected != reference_greedy(tiny_model(), [1, 2, 3, 4, 5, 6], 12)  # the window matters


def decode_logits(model, ids, steps, kv_int8):
    """Logits of a prefill of ids and `steps` greedy decode steps, one cache."""
    model.setup_caches(1, 64, kv_int8)
    out, pos = [], len(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(pos), kv_len=pos)[0, -1]
        for _ in range(steps):
            out.append(logits)
            token = torch.tensor([[int(logits.argmax())]])
            logits = model(token, torch.tensor([pos]), kv_len=pos + 1)[0, -1]
            pos += 1
    return torch.stack(out)


def test_int8_kv_cache_halves_the_cache_and_stays_close():
    """int8 keys and values with a scale per position and head: each stored
    value is within half a step (1/254 of its vector's largest magnitude)."""
    model = tiny_model()
    full = decode_logits(model, [1, 2, 3, 4, 5], 10, kv_int8=False)
    full_bytes = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "kv_cache" in n)
    int8 = decode_logits(model, [1, 2, 3, 4, 5], 10, kv_int8=True)
    int8_bytes = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "kv_cache" in n)
    cache = model.layers[0].attention.kv_cache
    # fp32 model, head_dim 8: (8 codes + a 4-byte scale) against 8 x 4 bytes
    assert cache.k.dtype == torch.int8 and int8_bytes == full_bytes * 12 // 32
    assert ((int8 - full).norm() / full.norm()) < 3e-2  # random std-0.3 weights amplify; a wrong cache gives ~1
    # the stored codes reproduce the keys written
    k = torch.randn(1, 2, 1, 8) * 3
    c = type(cache)(1, 2, 4, 8, torch.float32, "cpu", int8=True)
    got, _ = c.update(torch.tensor([2]), k, k, length=3)
    assert ((got[:, :, 2:3] - k).abs() <= k.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()


@pytest.mark.compile
def test_int8_kv_cache_compiled_equals_eager():
    model = tiny_model()
    eager = list(Generator(model, 64, kv_int8=True).tokens([1, 2, 3], 10, GREEDY))
    compiled = list(Generator(model, 64, compile=True, kv_int8=True).tokens([1, 2, 3], 10, GREEDY))
    assert compiled == eager


# --- text level, on the real SmolLM2 -------------------------------------------

def test_default_model_knows_the_capital_of_france(smol_llm):
    assert "Paris" in smol_llm.generate("The capital of France is", max_new_tokens=8, temperature=0)


def test_stream_pieces_join_to_generate(smol_llm):
    text = smol_llm.generate("Once upon a time", max_new_tokens=24, temperature=0)
    pieces = list(smol_llm.stream("Once upon a time", max_new_tokens=24, temperature=0))
    assert len(pieces) > 1 and "".join(pieces) == text


def test_stop_string_ends_the_text_before_it(smol_llm):
    full = smol_llm.generate("The capital of France is", max_new_tokens=24, temperature=0)
    word = full.split()[1]
    cut = smol_llm.generate("The capital of France is", max_new_tokens=24, temperature=0, stop=[word])
    assert cut == full[:full.index(word)]


def test_chat_stops_at_end_of_turn_and_reuses_the_cache(smol_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = smol_llm.chat(messages, max_new_tokens=64, temperature=0)
    assert "Paris" in reply and "<|im_end|>" not in reply
    assert smol_llm.stats.new_tokens < 64  # ended by <|im_end|>, not by the limit
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "And of Italy?"}]
    second = smol_llm.chat(messages, max_new_tokens=32, temperature=0)
    assert second and smol_llm.stats.reused_tokens > 20


@pytest.mark.slow
def test_int8_kv_cache_on_the_real_model(smollm2_gguf):
    """SmolLM2 with an int8 KV cache: next-token distributions within a small KL
    of the full cache over a 40-token text, and the same answer."""
    import brisklm
    llm = brisklm.load(smollm2_gguf, device="cpu", dtype="float32", max_seq_length=128, kv_int8=True)
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:40]
    full = decode_logits(llm.model, ids, 8, kv_int8=False).log_softmax(-1)
    int8 = decode_logits(llm.model, ids, 8, kv_int8=True).log_softmax(-1)
    kl = (full.exp() * (full - int8)).sum(-1).mean()
    assert kl < 1e-3
    llm.generator.model.setup_caches(1, 128, True)  # the generator's own cache again
    llm.generator.cached = []
    assert "Paris" in llm.generate("The capital of France is", max_new_tokens=8, temperature=0)



@pytest.mark.compile
@pytest.mark.slow
def test_after_warm_up_no_sampling_setting_or_prompt_length_compiles_again():
    """The CPU's compiled step, warmed up (greedy and sampled): greedy, four
    sampling settings, a new prompt length and a seed are served with no new
    compile (Dynamo's count of the graphs it traced), and greedy gives the
    tokens the eager step gives."""
    from torch._dynamo.utils import counters
    from brisklm.api import LLM
    llm = LLM(tiny_model(), None, max_seq_length=64, compile=True)
    llm.warm_up()
    llm.wait_compiled()  # (compiled on another thread meanwhile)
    traced = counters["stats"]["unique_graphs"]
    assert traced >= 2  # (greedy and sampled)
    want = list(Generator(tiny_model(), 64).tokens([1, 2, 3], 8, GREEDY))
    assert list(llm.stream_ids([1, 2, 3], 8, stop_ids=())) == want
    for sampling in (dict(temperature=0.7), dict(temperature=0.9, top_p=0.95), dict(temperature=1.0, top_k=40),
                     dict(temperature=0.8, min_p=0.05)):
        assert len(list(llm.stream_ids([1, 2, 3], 6, stop_ids=(), seed=5, **sampling))) == 6
    assert len(list(llm.stream_ids(list(range(1, 30)), 6, stop_ids=(), temperature=0.5, seed=2**40))) == 6
    assert list(llm.stream_ids([1, 2, 3], 8, stop_ids=())) == want
    assert counters["stats"]["unique_graphs"] == traced


@pytest.mark.compile
@pytest.mark.slow
def test_one_compiled_block_serves_every_layer():
    """The block-compiled step (CUDA's default, steps.py): the compiled
    calls, each traced once (the first layer's start, one layer's finish and
    the next one's start, the last one's finish), run every layer and give
    the plain forward's logits, for one token and for a verify step's rows."""
    from torch._dynamo.utils import counters
    from brisklm.steps import LayerCalls
    model = tiny_model(args=ModelArgs(**{**TINY.to_dict(), "num_hidden_layers": 4}))
    model.setup_caches(1, 32)
    block = LayerCalls(functools.partial(torch.compile, fullgraph=True, dynamic=False))
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for ids in ([3, 1, 4, 1, 5], [9]):
            start = 0 if len(ids) > 1 else 5
            pos = torch.arange(start, start + len(ids))
            want = model(torch.tensor([ids]), pos, kv_len=start + len(ids))
            got = model(torch.tensor([ids]), pos, kv_len=start + len(ids), block=block)
            assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert counters["stats"]["unique_graphs"] - before == 6  # (three calls a shape, not one a layer)


def test_the_layer_calls_give_the_plain_forward_in_every_family():
    """The block-compiled steps' loop (each call finishes one layer and
    starts the next, steps.LayerCalls), run uncompiled: the plain forward's
    logits for Gemma 3's alternating windows and RoPE bases, sandwich norms
    and q/k norms, SmolLM3's layers without RoPE, an MoE layer's padding
    rows, and a self-draft's first layers."""
    from brisklm.steps import LayerCalls
    gemma = dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"] * 2, rope_local_base_freq=1e4,
                 hidden_act="gelu_pytorch_tanh", norm_offset=1.0, sandwich_norms=True, qk_norm=True,
                 query_pre_attn_scalar=24)
    for extra in ({}, gemma, dict(no_rope_layers=[1, 0, 1, 0]), dict(num_local_experts=4, num_experts_per_tok=2)):
        model = tiny_model(args=ModelArgs(**{**TINY.to_dict(), "num_hidden_layers": 4, **extra})).prepare()
        model.setup_caches(1, 32)
        ids, pos, last = torch.tensor([[3, 1, 4, 1, 5, 9, 2]]), torch.arange(7), torch.tensor([4])
        with torch.no_grad():
            for kw in (dict(kv_len=7), dict(kv_len=7, last=last), dict(kv_len=7, depth=2)):
                want = model(ids, pos, **kw)
                got = model(ids, pos, block=LayerCalls(), **kw)
                assert torch.equal(got, want), (extra, kw)


def test_prefill_shapes_lists_every_graph_a_prompt_can_need():
    """The shapes warm_up captures are exactly those prefill_shape can give."""
    from brisklm.steps import prefill_shapes
    for length, kernel_tokens in ((64, 0), (100, 0), (300, 16)):
        want = {prefill_shape(s, n, length, kernel_tokens) for n in range(1, 300) for s in range(length)} - {None}
        assert set(prefill_shapes(length, kernel_tokens)) == want
    assert prefill_shape(0, 5, 8192, kernel_tokens=16) == (16, None)  # the kernel reads the length itself


def test_short_reductions_are_compiled_with_a_fixed_block(monkeypatch):
    """The decode step's compiler choices fix reductions of under 256 values
    (gemv.pack_x's groups) at SHORT_REDUCTION_BLOCK: inductor's timed pick
    among three block sizes varied between compiles (1.5 against ~5 us for the
    same int4 pack kernel on an H200). Others keep inductor's own choice."""
    import sympy
    from types import SimpleNamespace

    choices = OnePassReductions()

    def fixed(x, r, reduction=True, **kwargs):
        features = SimpleNamespace(is_reduction=lambda: reduction)
        tiling = {"x": sympy.sympify(x), "r0_": sympy.sympify(r)}
        return choices.triton_kernel_kwargs(None, features, [tiling], kwargs).get("fixed_config")

    for x, r in ((32, 128), (112, 128), (128, 32), (1, 126)):  # int4 packs of 4096 and 14336; argmax's last stage
        assert fixed(x, r).config == SHORT_REDUCTION_BLOCK, (x, r)
    assert fixed(1, 4096) is None  # an RMSNorm of 4096 values
    assert fixed(126, 1024) is None  # argmax's first stage
    assert fixed(4096, 128) is None  # many rows: inductor's choice
    assert fixed(32, 128, reduction=False) is None  # pointwise
    assert fixed("s0", 128) is None  # dynamic sizes (prefill)
    assert fixed(32, 128, mix_order_reduction=True) is None
    # The compiler's cache is keyed by the block: another block compiles anew.
    key = choices.uuid()
    monkeypatch.setitem(SHORT_REDUCTION_BLOCK, "XBLOCK", 2 * SHORT_REDUCTION_BLOCK["XBLOCK"])
    assert choices.uuid() != key
    # So are the few-rows kernels' blocks: they set the shape of the partial sums a cached graph
    # expects (a verify step cached under the old blocks failed on an H100 after a change of them).
    from brisklm.kernels import matmul
    key = choices.uuid()
    monkeypatch.setitem(matmul.CONFIG, matmul.ROW_SCALED, (64, 128, 4, 3, True, 528))
    assert choices.uuid() != key
    key = choices.uuid()
    monkeypatch.setattr(matmul, "WORDS", ())
    assert choices.uuid() != key




def test_a_long_prompt_prefilled_in_chunks_generates_what_one_pass_does():
    """A prompt longer than the largest bucket runs in chunks of it through the
    padded (on CUDA: graphed) prefill; run here without graphs: the same
    tokens as one pass, also after cached tokens."""
    plain, chunked = Generator(tiny_model(), 600), Generator(tiny_model(), 600)
    chunked.steps.graphed_prefill = chunked.steps._prefill
    prompt = [(7 * i) % 61 for i in range(300)]
    for turn in range(2):
        a, b = list(plain.tokens(prompt, 6, GREEDY)), list(chunked.tokens(prompt, 6, GREEDY))
        assert a == b, turn
        prompt = prompt + a + [(3 * i) % 61 for i in range(270)]


@pytest.mark.compile
@pytest.mark.slow
def test_one_compiled_block_serves_a_padded_moe_prompt():
    """A prompt of 17-64 tokens on a GPU replays the block-compiled steps
    padded to its bucket (32 or 64 rows, which the attention kernel takes
    whole): through the block compiled for each bucket, an MoE model's
    experts gathered by rows on the device with the padding after `last`
    marked, the last token's logits are the unpadded prompt's."""
    from brisklm.steps import LayerCalls
    args = ModelArgs(**{**TINY.to_dict(), "num_local_experts": 4, "num_experts_per_tok": 2})
    model = tiny_model(args=args).prepare()  # (the experts stacked, as a loaded model's are)
    model.setup_caches(1, 128)
    block = LayerCalls(functools.partial(torch.compile, fullgraph=True, dynamic=False))
    with torch.no_grad():
        for n, bucket in ((20, 32), (33, 64)):
            ids = [(7 * i) % 60 + 1 for i in range(n)]
            want = model(torch.tensor([ids]), torch.arange(n), kv_len=n)[:, -1]
            padded = torch.tensor([ids + [0] * (bucket - n)])
            got = model(padded, torch.arange(bucket), kv_len=bucket, last=torch.tensor([n - 1]), block=block)
            assert torch.allclose(got[:, -1], want, atol=1e-5, rtol=0), (n, (got[:, -1] - want).abs().max())
