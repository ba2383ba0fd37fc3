"""Generation: the cached decode loop equals recomputing from scratch; stops, streaming, chat."""
import pytest
import torch

from brisklm.generate import (PREFILL_BUCKETS, SHORT_REDUCTION_BLOCK, Generator, OnePassReductions, prefill_shape,
                              weight_bytes_per_token)
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
    padded.graphed_prefill = padded._prefill  # (on CUDA: replayed(self._prefill))
    prompt = [3, 1, 4, 1, 5]
    for turn in range(3):
        a, b = list(plain.tokens(prompt, 7, GREEDY)), list(padded.tokens(prompt, 7, GREEDY))
        assert a == b, turn
        start = padded.stats.reused_tokens
        assert start == plain.stats.reused_tokens and prefill_shape(start, len(prompt) - start, 64)  # (padded)
        prompt = prompt + a + [7, 2]


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
    from brisklm.quantize import quantize_state_dict
    args = ModelArgs(**{**TINY.to_dict(), "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16})  # every matrix in groups of 32
    args, state = quantize_state_dict(args, random_state_dict(args, torch.float32, std=0.1), "q8_0", 32)
    model = build_model(args, {n: t.bfloat16() if t.is_floating_point() else t for n, t in state.items()})
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


PRECOMPILE_CHILD = r"""
import torch
from torch._dynamo.utils import counters
import brisklm.generate as g
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.sampling import SamplingParams
args = ModelArgs(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
model = build_model(args, random_state_dict(args, torch.float32, seed=0, std=0.3))
# no flex attention: the path CUDA takes (its attention kernel reads the length; here
# the plain attention covers the whole cache, masked)
model.decode_kernels = {"attention": True}
gen = g.Generator(model, 64, compile=True, compile_prefill=True)
print("tokens", list(gen.tokens([1, 2, 3], 10, SamplingParams())),
      list(gen.tokens([4, 5, 6, 7, 8], 5, SamplingParams())))  # another prompt length: no new trace
print("hits", counters["dynamo_cache"]["dynamo_cache_hit"])
print("traced", counters["stats"]["unique_graphs"])
"""


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_decode_step_is_loaded_back_without_tracing(tmp_path):
    """The second process loads the decode step and the dynamic-length prefill
    that the first traced and compiled (Dynamo's output included), traces
    nothing, and decodes the same tokens."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", PRECOMPILE_CHILD], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (dict(line.split(" ", 1) for line in run.stdout.splitlines()) for run in runs)
    assert first["hits"] == "0" and second["hits"] == "2" and second["traced"] == "0"
    assert first["tokens"] == second["tokens"]
    saved, = (tmp_path / "brisklm").glob("decode-*.bin")
    saved.write_bytes(b"not a cache")  # a damaged file costs nothing but time
    third = subprocess.run([sys.executable, "-c", PRECOMPILE_CHILD], env=env, capture_output=True, text=True,
                           timeout=600)
    assert third.returncode == 0, third.stderr[-2000:]
    assert dict(line.split(" ", 1) for line in third.stdout.splitlines())["tokens"] == first["tokens"]
    # saving fails (torch's precompile is experimental): a marker, and the step compiled as usual
    failing = "import torch\ntorch.compiler.save_cache_artifacts = lambda: 1 / 0\n" + PRECOMPILE_CHILD
    fourth = subprocess.run([sys.executable, "-c", failing], env=dict(env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "b")),
                            capture_output=True, text=True, timeout=600)
    assert fourth.returncode == 0, fourth.stderr[-2000:]
    assert dict(line.split(" ", 1) for line in fourth.stdout.splitlines())["tokens"] == first["tokens"]
    assert len(list((tmp_path / "b" / "brisklm").glob("decode-*.bin.broken"))) == 1


STALE_CHILD = """
import os, sys, torch
from brisklm.precompile import precompiled

@torch.compiler.assume_constant_result  # as the GEMV table: a constant of the graph, not guarded
def factor():
    return float(os.environ["FACTOR"])

def step(x):
    return x * factor()

fn = precompiled(step, {}, os.path.join(sys.argv[1], "step-" + os.environ["FACTOR"] + ".bin"))
print(fn(torch.ones(3)).tolist())
"""


@pytest.mark.compile
@pytest.mark.slow
def test_a_step_traced_under_other_constants_is_not_loaded_back(tmp_path):
    """torch's caching precompile keys what it saves by the function's name and
    line only; a step compiled under another table must not come back from it,
    while the step saved under the same table still does."""
    import os
    import subprocess
    import sys

    def run(factor, **more):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), FACTOR=factor, **more)
        done = subprocess.run([sys.executable, "-c", STALE_CHILD, str(tmp_path)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert run("2") == "[2.0, 2.0, 2.0]"
    assert run("3") == "[3.0, 3.0, 3.0]"
    assert run("2") == "[2.0, 2.0, 2.0]"  # loaded back from its own file
    assert run("5", BRISKLM_PRECOMPILE="0") == "[5.0, 5.0, 5.0]"  # opted out: nothing saved
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-2.bin", "step-3.bin"]


@pytest.mark.compile
@pytest.mark.slow
def test_a_step_saved_by_other_source_code_is_not_loaded_back(tmp_path, monkeypatch):
    """A saved step was traced through our Python code, which it skips when
    loaded: its file is keyed by a digest of the package's source, so another
    version of the code (an edit, an upgrade) compiles and saves its own."""
    import os
    import shutil
    import subprocess
    import sys

    import brisklm

    def digest(root):
        code = "from brisklm.precompile import source_digest; print(source_digest())"
        done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(root)), cwd=root,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    package = os.path.dirname(brisklm.__file__)
    for copy in ("a", "b"):
        shutil.copytree(package, tmp_path / copy / "brisklm", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "b" / "brisklm" / "model.py", "a") as f:
        f.write("\n# an edit\n")
    assert digest(tmp_path / "a") == digest(tmp_path / "a")
    assert digest(tmp_path / "a") != digest(tmp_path / "b")
    from brisklm import precompile
    args = ModelArgs(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
    model = build_model(args, random_state_dict(args, torch.float32))
    model.setup_caches(1, 16)
    path = precompile.artifacts_path(model, {})
    monkeypatch.setattr(precompile, "source_digest", lambda: "another version")
    assert precompile.artifacts_path(model, {}) != path


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


DYNAMIC_FALLBACK_CHILD = """
import contextlib, os, sys, torch
from brisklm.precompile import precompiled

def step(x):
    return x * 2 + 1

fn = precompiled(step, {}, os.path.join(sys.argv[1], "step.bin"), dynamic=True)
print(fn(torch.ones(3)).tolist())
patch = torch._dynamo.config.patch

def failing(*args, **kwargs):  # as torch 2.11 failed on an H200: inside Dynamo, under caching_precompile
    if kwargs.get("caching_precompile"):
        raise AssertionError("")
    return patch(*args, **kwargs)

vars(torch._dynamo.config)["patch"] = failing  # (a config module refuses setattr)
print(fn(torch.ones(5)).tolist())
print(fn(torch.ones(7)).tolist())
"""


@pytest.mark.compile
@pytest.mark.slow
def test_a_recompile_that_fails_under_precompile_falls_back_to_a_plain_compile(tmp_path):
    """A step compiled for several lengths (dynamic) recompiles under
    caching_precompile for a new one; where that fails, the step is
    compiled as usual, and a marker keeps the next start off precompile."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", DYNAMIC_FALLBACK_CHILD, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:3] == [str([3.0] * 3), str([3.0] * 5), str([3.0] * 7)]
    assert (tmp_path / "step.bin.broken").exists()
