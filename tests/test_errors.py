"""Bad input produces the documented error, never a traceback.

The contract (brisklm/errors.py, brisklm/cli.py): every problem with user input
raises `BriskError` whose message is one line naming the file (or field/value)
at fault and the problem. From the CLI it prints exactly one line starting
with `error: ` on stderr and exits with status 2, without a Python traceback.
No pickle is ever loaded unsafely.

Every input is built here, at test time, from tiny models: a Hugging Face
folder written by transformers, a GGUF file written by gguf.GGUFWriter and a
native folder written by `save_native`. Each test damages one copy in one way.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import brisklm  # noqa: E402
import forked_brisk  # noqa: E402
from brisklm.checkpoints import load  # noqa: E402
from brisklm.checkpoints.native import save_native  # noqa: E402
from brisklm.errors import BriskError  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tiny model every checkpoint below holds.
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 97, 64, 96, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
CONTEXT = 1024  # the HF folder's max_position_embeddings


# --- helpers -----------------------------------------------------------------

def brisk_error(excinfo, *fragments) -> str:
    """The message of a raised BriskError, checked to be one line holding every fragment."""
    message = str(excinfo.value)
    assert "\n" not in message, f"message is not one line: {message!r}"
    for fragment in fragments:
        assert str(fragment) in message, f"{fragment!r} not in {message!r}"
    return message


def copy_of(folder, tmp_path) -> str:
    """A private copy of a pristine checkpoint folder, for a test to damage."""
    target = os.path.join(tmp_path, "ckpt")
    shutil.copytree(folder, target)
    return target


def edit_json(path, edit):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    edit(data)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def edit_safetensors(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def truncate(path, fraction=0.5):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:int(len(data) * fraction)])


def write_gguf(path, arch="llama", omit_fields=(), omit_tensors=(), vocabulary=True) -> str:
    """A small valid GGUF file (F32 tensors), less the fields and tensors named."""
    writer = gguf.GGUFWriter(str(path), arch)
    fields = {
        "context_length": lambda: writer.add_context_length(128),
        "embedding_length": lambda: writer.add_embedding_length(HIDDEN),
        "feed_forward_length": lambda: writer.add_feed_forward_length(FFN),
        "block_count": lambda: writer.add_block_count(LAYERS),
        "attention.head_count": lambda: writer.add_head_count(HEADS),
        "attention.head_count_kv": lambda: writer.add_head_count_kv(KV_HEADS),
        "attention.layer_norm_rms_epsilon": lambda: writer.add_layer_norm_rms_eps(1e-5),
    }
    for key, add in fields.items():
        if key not in omit_fields:
            add()
    if vocabulary:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([chr(33 + i) for i in range(VOCAB)])
        writer.add_token_types([1] * VOCAB)
        writer.add_token_merges([])
        writer.add_eos_token_id(0)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)})
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name not in omit_tensors:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def run_cli(tmp_path, *args) -> subprocess.CompletedProcess:
    """`python -m brisklm ARGS` with a private cache and no way to download anything."""
    env = dict(os.environ, BRISKLM_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1",
               PIP_NO_INDEX="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return forked_brisk.run(args, cwd=REPO, env=env, timeout=120)


def assert_cli_error(result: subprocess.CompletedProcess, *fragments) -> str:
    """rc 2, no traceback, exactly one `error: ` line on stderr and it is the last."""
    stderr = result.stderr
    assert "Traceback" not in stderr, stderr
    assert result.returncode == 2, (result.returncode, stderr)
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), stderr
    assert sum(line.startswith("error:") for line in lines) == 1, stderr
    for fragment in fragments:
        assert str(fragment) in lines[-1], f"{fragment!r} not in {lines[-1]!r}"
    return lines[-1]


# --- pristine tiny checkpoints (built once, copied by the tests that damage them) ---

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    """A tiny Llama saved by transformers, with a one-character-per-token tokenizer."""
    from tokenizers import Tokenizer, models
    folder = str(tmp_path_factory.mktemp("hf"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=CONTEXT)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {chr(32 + i): i for i in range(95)}  # printable ASCII
    vocab.update({"<unk>": 95, "</s>": 96})
    Tokenizer(models.BPE(vocab, [], unk_token="<unk>")).save(os.path.join(folder, "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def native_folder(hf_folder, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("native"))
    ckpt = load(hf_folder)
    save_native(folder, ckpt.args, ckpt.state_dict, ckpt.tokenizer)
    return folder


@pytest.fixture(scope="module")
def llm(hf_folder):
    return brisklm.load(hf_folder, device="cpu", dtype="float32", max_seq_length=16)


@pytest.mark.parametrize("kind", ["hf", "gguf", "native"])
def test_the_undamaged_tiny_checkpoints_load(kind, hf_folder, native_folder, tmp_path):
    # The control: every failure below comes from the one damage done, not the fixture.
    path = {"hf": lambda: hf_folder, "native": lambda: native_folder,
            "gguf": lambda: write_gguf(tmp_path / "ok.gguf")}[kind]()
    ckpt = load(path)
    assert ckpt.args.vocab_size == VOCAB and ckpt.args.num_hidden_layers == LAYERS


# --- paths -------------------------------------------------------------------

def test_missing_path_is_named(tmp_path):
    path = str(tmp_path / "no-such-model")
    with pytest.raises(BriskError) as e:
        load(path)
    brisk_error(e, path, "no such file or folder")


def test_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "README.md").write_text("not a model")
    with pytest.raises(BriskError) as e:
        load(str(tmp_path))
    brisk_error(e, str(tmp_path), "not a checkpoint folder")


def test_file_that_is_neither_gguf_nor_folder_is_refused(tmp_path):
    path = tmp_path / "random.bin"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(BriskError) as e:
        load(str(path))
    brisk_error(e, str(path), "unrecognised checkpoint format")


# --- Hugging Face folders ----------------------------------------------------

def test_hf_config_that_is_not_json_is_named(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    config = os.path.join(folder, "config.json")
    with open(config, "w") as f:
        f.write("{this is not json")
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, config, "cannot read config")


def test_hf_config_that_is_json_but_not_an_object_is_named(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    config = os.path.join(folder, "config.json")
    with open(config, "w") as f:
        f.write("[1, 2, 3]")
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, config)


def test_hf_unknown_architecture_is_named(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    config = os.path.join(folder, "config.json")
    edit_json(config, lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, config, "unsupported architecture", "GPT2LMHeadModel")


def test_hf_config_field_of_the_wrong_type_is_named(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    config = os.path.join(folder, "config.json")
    edit_json(config, lambda c: c.update(hidden_size="64"))
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, config, "hidden_size")


def test_hf_sliding_window_on_some_layers_only_is_refused(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    config = os.path.join(folder, "config.json")
    edit_json(config, lambda c: c.update(sliding_window=8, use_sliding_window=True, max_window_layers=1))
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, config, "sliding windows on some layers only")
    # as transformers reads Qwen2: a window that is off, or on no layer, is dropped;
    # one on every layer (from layer 0) is kept
    edit_json(config, lambda c: c.update(use_sliding_window=False))
    assert load(folder).args.sliding_window is None
    edit_json(config, lambda c: c.update(use_sliding_window=True, max_window_layers=c["num_hidden_layers"]))
    assert load(folder).args.sliding_window is None
    edit_json(config, lambda c: c.update(max_window_layers=0))
    assert load(folder).args.sliding_window == 8


def test_hf_missing_tensor_is_named(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    edit_safetensors(os.path.join(folder, "model.safetensors"),
                     lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, folder, "missing tensor", "model.layers.1.mlp.up_proj.weight")


def test_hf_tensor_of_the_wrong_shape_is_named_with_both_shapes(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"  # expected (KV_HEADS * HEAD_DIM, HIDDEN)
    edit_safetensors(os.path.join(folder, "model.safetensors"),
                     lambda t: t.update({name: torch.zeros(16, HIDDEN)}))
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, folder, name, "(16, 64)", f"({KV_HEADS * HEAD_DIM}, {HIDDEN})")


def test_hf_truncated_safetensors_is_corrupt_or_truncated(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    weights = os.path.join(folder, "model.safetensors")
    truncate(weights)
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, weights, "corrupt or truncated")


class _CreatesMarker:
    """Unpickling this calls open(marker, "w"): any code run at load time leaves the file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _hf_folder_with_pickle_bin(hf_folder, tmp_path, writer):
    folder = os.path.join(tmp_path, "bin")
    os.makedirs(folder)
    shutil.copy(os.path.join(hf_folder, "config.json"), folder)
    marker = tmp_path / "PAYLOAD_RAN"
    weights = os.path.join(folder, "pytorch_model.bin")
    payload = {"model.embed_tokens.weight": _CreatesMarker(marker)}
    if writer == "torch.save":
        torch.save(payload, weights)
    else:  # a bare pickle stream, as torch.save wrote before its zip format
        with open(weights, "wb") as f:
            pickle.dump(payload, f)
    return folder, weights, marker


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_pytorch_bin_with_a_pickled_object_is_refused_without_running_it(hf_folder, tmp_path,
                                                                         writer):
    folder, weights, marker = _hf_folder_with_pickle_bin(hf_folder, tmp_path, writer)
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, weights)
    assert not marker.exists(), "the pickled object's code ran"
    # The payload is live: an unsafe load does run it (so the check above means something).
    if writer == "torch.save":
        torch.load(weights, weights_only=False)
    else:
        with open(weights, "rb") as f:
            pickle.load(f)
    assert marker.exists()


def test_pytorch_bin_refusal_is_plain_text(hf_folder, tmp_path):
    folder, weights, marker = _hf_folder_with_pickle_bin(hf_folder, tmp_path, "torch.save")
    with pytest.raises(BriskError) as e:
        load(folder)
    message = brisk_error(e, weights)
    assert message.isprintable(), repr(message)
    assert "corrupt or truncated" not in message


# --- GGUF files --------------------------------------------------------------

def test_gguf_truncated_file_is_corrupt_or_truncated(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    truncate(path)
    with pytest.raises(BriskError) as e:
        load(path)
    brisk_error(e, path, "corrupt or truncated")


def test_gguf_unknown_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", arch="gpt2")
    with pytest.raises(BriskError) as e:
        load(path)
    brisk_error(e, path, "unsupported architecture", "'gpt2'", "general.architecture")


def test_gguf_missing_metadata_field_is_named(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", omit_fields=("block_count",))
    with pytest.raises(BriskError) as e:
        load(path)
    brisk_error(e, path, "missing metadata field", "llama.block_count")


def test_gguf_missing_tensor_is_reported(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", omit_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(BriskError) as e:
        load(path)
    brisk_error(e, path, "missing tensor")


def test_gguf_missing_tensor_is_named_as_in_the_file(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", omit_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(BriskError) as e:
        load(path)
    brisk_error(e, path, "missing tensor", "blk.1.ffn_up.weight")


def test_gguf_without_vocabulary_names_what_is_missing(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", vocabulary=False)
    with pytest.raises(BriskError) as e:
        load(path)
    message = brisk_error(e, path)
    assert "tokenizer.ggml.tokens" in message or "vocab_size" in message, message


# --- native folders ----------------------------------------------------------

def test_native_unsupported_version_is_named(native_folder, tmp_path):
    folder = copy_of(native_folder, tmp_path)
    meta = os.path.join(folder, "brisk.json")
    edit_json(meta, lambda info: info.update(version=99))
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, meta, "unsupported format version", "99")


def test_native_missing_tensor_is_named(native_folder, tmp_path):
    folder = copy_of(native_folder, tmp_path)
    weights = os.path.join(folder, "model.safetensors")
    edit_safetensors(weights, lambda t: t.pop("layers.1.feed_forward.w13.weight"))
    with pytest.raises(BriskError) as e:
        load(folder)
    brisk_error(e, weights, "missing tensor", "layers.1.feed_forward.w13.weight")


# --- generation --------------------------------------------------------------

def test_prompt_longer_than_the_cache_names_the_option_that_raises_it(llm):
    with pytest.raises(BriskError) as e:
        llm.generate("x" * 40, max_new_tokens=1)
    brisk_error(e, "40 tokens", "KV cache of 16 tokens", "--max_seq_length", f"context of {CONTEXT} tokens")


def test_the_default_cache_covers_the_model_context(hf_folder):
    assert brisklm.load(hf_folder, device="cpu").generator.max_seq_length == CONTEXT


def test_a_cache_past_the_model_context_is_refused_unless_allowed(hf_folder):
    with pytest.raises(BriskError) as e:
        brisklm.load(hf_folder, device="cpu", max_seq_length=CONTEXT + 1)
    brisk_error(e, f"max_seq_length {CONTEXT + 1}", f"context of {CONTEXT} tokens", "--allow_long_context")
    llm = brisklm.load(hf_folder, device="cpu", max_seq_length=CONTEXT + 1, allow_long_context=True)
    assert llm.generator.max_seq_length == CONTEXT + 1


def test_a_default_cache_is_capped_by_free_memory(hf_folder, monkeypatch, capsys):
    from brisklm import memory
    per_position = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # bf16 keys and values
    before = iter([10**12])  # the memory plan, before loading: room for the weights
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: next(before, 2 * 256 * per_position))
    llm = brisklm.load(hf_folder, device="cpu", quiet=False)
    assert llm.generator.max_seq_length == 256
    assert "capped at 256 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("value", [-1.0, float("nan")])
def test_negative_or_nan_temperature_is_a_brisk_error(llm, value):
    with pytest.raises(BriskError) as e:
        llm.generate("hi", max_new_tokens=2, temperature=value)
    brisk_error(e, "temperature", str(value))


def test_top_p_above_one_is_a_brisk_error(llm):
    with pytest.raises(BriskError) as e:
        llm.generate("hi", max_new_tokens=2, temperature=1.0, top_p=1.5)
    brisk_error(e, "top_p", "1.5")


def test_token_id_outside_the_vocabulary_is_a_brisk_error(llm):
    with pytest.raises(BriskError) as e:
        list(llm.stream_ids([VOCAB + 3], max_new_tokens=1))
    brisk_error(e, str(VOCAB + 3))


@pytest.mark.parametrize("length", [0, -3])
def test_non_positive_max_seq_length_is_a_brisk_error(hf_folder, length):
    with pytest.raises(BriskError) as e:
        brisklm.load(hf_folder, device="cpu", max_seq_length=length)
    brisk_error(e, "max_seq_length", str(length))


def test_max_seq_length_too_large_for_memory_is_a_brisk_error(hf_folder):
    with pytest.raises(BriskError) as e:
        brisklm.load(hf_folder, device="cpu", max_seq_length=10**10,
                     allow_long_context=True)  # a KV cache of terabytes, refused before loading
    message = brisk_error(e, "a KV cache of 10000000000 tokens", "do not fit", "free on cpu", "--kv_int8")
    assert f"--max_seq_length {CONTEXT} would" in message  # what fits, up to the model's context


def test_unknown_device_is_a_brisk_error(hf_folder):
    with pytest.raises(BriskError) as e:
        brisklm.load(hf_folder, device="no-such-device")
    brisk_error(e, "no-such-device")


# --- the command line --------------------------------------------------------

@pytest.mark.slow
def test_cli_missing_checkpoint_prints_one_error_line(tmp_path):
    path = str(tmp_path / "no-such-model")
    result = run_cli(tmp_path, "generate", "--checkpoint_path", path)
    assert_cli_error(result, path, "no such file or folder")


@pytest.mark.slow
def test_cli_corrupt_gguf_prints_one_error_line(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    truncate(path)
    result = run_cli(tmp_path, "generate", "--checkpoint_path", path)
    assert_cli_error(result, path, "corrupt or truncated")


@pytest.mark.slow
def test_cli_unknown_preset_prints_one_error_line(tmp_path):
    result = run_cli(tmp_path, "generate", "--preset", "no-such-preset")
    assert_cli_error(result, "no-such-preset")


@pytest.mark.slow
def test_cli_bench_on_an_unusable_device_prints_one_error_line(tmp_path):
    result = run_cli(tmp_path, "bench", "--preset", "smollm2-135m", "--device", "no-such-device")
    assert_cli_error(result, "no-such-device", "not usable")


@pytest.mark.compile
@pytest.mark.slow
def test_cli_unknown_compile_option_prints_one_error_line(tmp_path):
    result = run_cli(tmp_path, "generate", "--preset", "smollm2-135m", "--compile", "--prompt", "hi",
                     "--compile_options", '{"no_such_option": 1}')
    assert_cli_error(result, "no_such_option")


@pytest.mark.slow
@pytest.mark.parametrize("command", [["generate", "--num_samples"], ["bench", "--samples"],
                                     ["eval", "--perplexity", "--window"], ["eval", "--perplexity", "--max_tokens"]])
def test_cli_zero_samples_is_refused(tmp_path, command):
    result = run_cli(tmp_path, *command, "0", "--preset", "smollm2-135m", "--device", "cpu")
    assert "Traceback" not in result.stderr and result.returncode == 2, result.stderr
    assert "must be >= 1, got 0" in result.stderr


@pytest.mark.slow
def test_cli_quantize_to_an_unwritable_folder_prints_one_error_line(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    result = run_cli(tmp_path, "quantize", "--checkpoint_path", path, "--mode", "int8",
                     "--output", "/proc/no-such-folder/out")
    assert_cli_error(result, "/proc/no-such-folder/out", "cannot create")


@pytest.mark.slow
def test_cli_chat_without_a_tokenizer_is_refused_before_the_first_message(tmp_path):
    result = run_cli(tmp_path, "chat", "--preset", "smollm2-135m", "--device", "cpu")
    assert_cli_error(result, "smollm2-135m", "no tokenizer")


@pytest.mark.slow
def test_cli_bench_unknown_preset_is_refused_before_measuring(tmp_path):
    result = run_cli(tmp_path, "bench", "--preset", "no-such-model", "--device", "cpu")
    assert_cli_error(result, "no-such-model")
    assert "Measuring" not in result.stderr


@pytest.mark.slow
def test_cli_unknown_dtype_prints_one_error_line(tmp_path):
    result = run_cli(tmp_path, "generate", "--dtype", "int3", "--preset", "smollm2-135m")
    assert_cli_error(result, "int3")


@pytest.mark.slow
def test_cli_negative_temperature_prints_one_error_line(hf_folder, tmp_path):
    result = run_cli(tmp_path, "generate", "--checkpoint_path", hf_folder, "--device", "cpu",
                     "--temperature", "-1", "--max_new_tokens", "2")
    assert_cli_error(result, "temperature")


def test_a_mistyped_keyword_names_the_method_called_and_the_keyword_meant(llm):
    with pytest.raises(TypeError, match=r"LLM\.generate\(\) .*'max_tokens'; did you mean 'max_new_tokens'\?"):
        llm.generate("hi", max_tokens=3)
    with pytest.raises(TypeError, match=r"LLM\.chat\(\) .*'temprature'; did you mean 'temperature'\?"):
        llm.chat([{"role": "user", "content": "hi"}], temprature=0.5)
    with pytest.raises(TypeError, match=r"LLM\.stream\(\) .*'colour' \(it takes max_new_tokens, stop, temperature"):
        llm.stream("hi", colour=1)


def test_load_names_a_mistyped_keyword_and_refuses_draft_options_without_a_draft_model(hf_folder):
    """Both before anything is read."""
    with pytest.raises(TypeError, match=r"load\(\) .*'quantise'; did you mean 'quantize'\?"):
        brisklm.load(hf_folder, quantise="int8")
    with pytest.raises(BriskError) as e:
        brisklm.load("no/such/folder", device="cpu", draft_quantize="int4")
    brisk_error(e, "draft_quantize", "speculate='draft'")
