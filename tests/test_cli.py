"""The `brisk` command end to end, in subprocesses (forked_brisk's: each a
fresh `python -m brisklm` but for the imports), on the bundled SmolLM2."""
import os
import subprocess
import sys

import pytest
import torch

import forked_brisk
from brisklm.checkpoints import load
from brisklm.checkpoints.native import save_native
from brisklm.model import build_model
from brisklm.quantize import FORMATS


def brisk(*args, env=None, input=None, timeout=300):
    return forked_brisk.run(args, env={**os.environ, **(env or {})}, input=input, timeout=timeout,
                            stdin=subprocess.DEVNULL if input is None else None)


@pytest.mark.slow
def test_generate_with_the_default_model_says_paris(smollm2_gguf):
    # The default model comes from the cache the fixture filled (or an explicit path).
    done = brisk("generate", "--checkpoint_path", smollm2_gguf, "--prompt", "The capital of France is",
                 "--max_new_tokens", "8", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The capital of France is") and "Paris" in done.stdout
    assert "tokens/s" in done.stderr and "bandwidth achieved" in done.stderr.lower()
    assert "Loading" in done.stderr


@pytest.mark.slow
def test_generate_without_checkpoint_uses_the_cached_default_model(smollm2_gguf, tmp_path):
    cache = os.path.dirname(smollm2_gguf)
    if os.path.basename(smollm2_gguf) != "SmolLM2-135M-Instruct.Q4_1.gguf":
        pytest.skip("default model not in a brisk cache folder")
    done = brisk("generate", "--prompt", "The capital of France is", "--max_new_tokens", "8",
                 "--temperature", "0", "--quiet", env={"BRISKLM_CACHE": cache})
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


@pytest.mark.slow
def test_generate_chat_applies_the_template_and_stops_at_end_of_turn(smollm2_gguf):
    done = brisk("generate", "--checkpoint_path", smollm2_gguf, "--chat", "--prompt",
                 "What is the capital of France?", "--max_new_tokens", "60", "--temperature", "0",
                 "--quiet", "--dtype", "float32")  # fp32: "The" leads "L" by 0.08 logits, within bf16 noise
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout and "<|im_end|>" not in done.stdout


@pytest.mark.slow
def test_chat_keeps_the_conversation(smollm2_gguf):
    done = brisk("chat", "--checkpoint_path", smollm2_gguf, "--temperature", "0", "--dtype", "float32",
                 "--max_new_tokens", "40", input="What is the capital of France?\nAnd of Italy?\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    stats = [line for line in done.stderr.splitlines() if "prompt tokens from the cache" in line]
    assert len(stats) == 2 and not stats[1].startswith("[0/") and " 0/" not in stats[1]


@pytest.mark.slow
def test_generate_preset_runs_random_weights():
    greedy = ("generate", "--preset", "smollm2-135m", "--max_new_tokens", "4", "--device", "cpu", "--temperature", "0")
    done = brisk(*greedy)
    assert done.returncode == 0, done.stderr
    assert "Sample 1: 4 tokens" in done.stderr
    # the output is the token ids (no tokenizer): the same greedy ids from the same seeded weights
    ids = done.stdout.split()
    assert len(ids) == 4 and all(0 <= int(i) < 49152 for i in ids)
    again = brisk(*greedy, "--quiet")
    assert again.returncode == 0 and again.stdout.split() == ids, again.stderr


@pytest.mark.slow
def test_convert_keeps_the_gguf_blocks_and_reloads_identically(smollm2_gguf, tmp_path):
    out = tmp_path / "native"
    done = brisk("convert", "--checkpoint_path", smollm2_gguf, "--output", str(out), "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    original, native = load(smollm2_gguf, keep_gguf_blocks="all"), load(str(out))
    assert native.args == original.args
    assert native.state_dict.keys() == original.state_dict.keys()
    for name, t in original.state_dict.items():
        assert torch.equal(native.state_dict[name], t), name
    # The Q4_1 matrices stay int4 (120 of them), the tied Q8_0 embedding int8, stored once:
    assert sum(k.endswith("_int4") for k in native.state_dict) == 120
    assert native.state_dict["output.weight_int8"] is native.state_dict["tok_embeddings.weight_int8"]
    written = sum(f.stat().st_size for f in out.iterdir())
    assert written < 1.25 * os.path.getsize(smollm2_gguf)  # fp32 scales and zeros: GGUF keeps fp16 d and m
    text = "Hi<|im_end|> ½ ① 東京 code:\n\tx = 1"
    assert native.tokenizer.encode(text) == original.tokenizer.encode(text)
    assert native.tokenizer.eos_ids == original.tokenizer.eos_ids
    assert native.tokenizer.chat_template == original.tokenizer.chat_template
    assert native.tokenizer.add_bos == original.tokenizer.add_bos


def test_native_round_trip_of_a_hf_folder_keeps_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    ckpt = load(str(tmp_path / "hf"))
    save_native(str(tmp_path / "native"), ckpt.args, ckpt.state_dict, ckpt.tokenizer)
    again = load(str(tmp_path / "native"))
    a, b = build_model(ckpt.args, ckpt.state_dict, FORMATS), build_model(again.args, again.state_dict, FORMATS)
    ids = torch.tensor([[1, 2, 3, 4]])
    for m in (a, b):
        m.setup_caches(1, 8)
    with torch.no_grad():
        assert torch.equal(a(ids, torch.arange(4)), b(ids, torch.arange(4)))


@pytest.mark.slow
def test_offline_download_of_the_default_model_fails_with_a_clear_message(tmp_path):
    offline = {"BRISKLM_CACHE": str(tmp_path), "PIP_CONFIG_FILE": os.devnull,
               "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0",
               "PIP_TIMEOUT": "2", "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}
    done = brisk("download", env=offline, timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot download the default model") and "offline" in last
    assert "Traceback" not in done.stderr
    assert os.listdir(tmp_path) == []  # nothing half-written is left behind


@pytest.mark.slow
def test_quantize_writes_a_checkpoint_that_generates(smollm2_gguf, tmp_path):
    out = tmp_path / "int8"
    done = brisk("quantize", "--checkpoint_path", smollm2_gguf, "--mode", "int8", "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert json_load(out / "brisk.json")["quantization"]["mode"] == "int8"
    done = brisk("generate", "--checkpoint_path", str(out), "--prompt", "The capital of France is",
                 "--max_new_tokens", "8", "--temperature", "0", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


@pytest.mark.slow
def test_quantize_gguf_keeps_the_blocks(smollm2_gguf, tmp_path):
    out = tmp_path / "kept"
    done = brisk("quantize", "--checkpoint_path", smollm2_gguf, "--mode", "gguf", "--output", str(out))
    assert done.returncode == 0, done.stderr
    kept = load(smollm2_gguf, keep_gguf_blocks="output", dtype=torch.bfloat16)
    again = load(str(out), dtype=torch.bfloat16)
    for name, t in kept.state_dict.items():
        assert torch.equal(again.state_dict[name], t), name


@pytest.mark.slow
def test_eval_reports_perplexity_and_kl(smollm2_gguf):
    done = brisk("eval", "--perplexity", "--checkpoint_path", smollm2_gguf, "--quantize", "int8",
                 "--reference", "--max_tokens", "256", "--window", "128")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("perplexity ") and "mean KL divergence" in done.stdout


@pytest.mark.slow
def test_eval_with_an_unreadable_text_fails_before_loading(smollm2_gguf, tmp_path):
    missing = tmp_path / "missing.txt"
    done = brisk("eval", "--perplexity", "--checkpoint_path", smollm2_gguf, "--text", str(missing))
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {missing}: cannot read text ([Errno 2] No such file or directory: " \
                                  f"'{missing}')"


def json_load(path):
    import json
    return json.loads(path.read_text())


def test_serve_without_the_server_extra_says_how_to_get_it(monkeypatch, capsys):
    from brisklm import cli
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "brisklm.server", raising=False)
    assert cli.main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install -e '.[server]'" in err and "fastapi" in err


def test_flags_take_either_spelling_and_version_answers():
    """--max-new-tokens as --max_new_tokens (as ollama's and llama.cpp's users
    type them); --version says the package's version."""
    from brisklm import __version__
    from brisklm.cli import build_parser
    args = build_parser().parse_args(["generate", "--max-new-tokens", "5", "--top-p", "0.5", "--checkpoint-path", "m"])
    assert (args.max_new_tokens, args.top_p, args.checkpoint_path) == (5, 0.5, "m")
    assert build_parser().parse_args(["serve", "--api-key", "k"]).api_key == "k"
    done = brisk("--version", timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"brisk-lm {__version__}"


def test_every_load_flag_reaches_the_load_options():
    """The commands that load a model hand their flags to load() through one
    LoadOptions (LoadOptions.from_args): each flag that names a field
    arrives, and none of the fields the commands set is left out."""
    import dataclasses

    from brisklm.cli import build_parser
    from brisklm.loading import LoadOptions
    flags = ["--device", "cpu", "--dtype", "float32", "--quantize", "int4", "--groupsize", "32", "--kv_int8",
             "--max_seq_length", "512", "--allow_long_context", "--compile", "--compile_prefill",
             "--compile_options", '{"max_autotune": false}', "--no_fused_kernels"]
    want = dict(device="cpu", dtype="float32", quantize="int4", groupsize=32, kv_int8=True, max_seq_length=512,
                allow_long_context=True, compile=True, compile_prefill=True,
                compile_options={"max_autotune": False}, fused_kernels=False)
    speculation = ["--speculate", "draft", "--draft_tokens", "3", "--draft_quantize", "int8", "--draft_preset",
                   "smollm2-135m"]
    for command, extra in (("generate", speculation), ("chat", speculation), ("serve", speculation),
                           ("bench", []), ("eval", [])):
        args = build_parser().parse_args([command, *flags, *extra])
        options = dataclasses.asdict(LoadOptions.from_args(args, quiet=False))
        assert {k: options[k] for k in want} == want, command
        if extra:
            assert (options["speculate"], options["draft_tokens"], options["draft_quantize"],
                    options["draft_preset"]) == ("draft", 3, "int8", "smollm2-135m"), command
        assert options["quiet"] is False


@pytest.mark.slow
def test_convert_and_quantize_do_what_they_say(smollm2_gguf, tmp_path):
    """convert --dequantize writes a dense folder; an existing output is refused
    without --force; an int4 folder quantized to int8 holds int8 (not its int4
    codes), with a note on its growth that names the true cause; the weights
    file is as readable as the rest of the folder."""
    dense, int4, int8 = tmp_path / "dense", tmp_path / "int4", tmp_path / "int8"
    done = brisk("convert", "--checkpoint_path", smollm2_gguf, "--output", str(dense), "--dequantize")
    assert done.returncode == 0, done.stderr
    held = load(str(dense)).state_dict
    assert not any(k.endswith(("_int4", "_int8", "_scale")) for k in held) and "tok_embeddings.weight" in held
    modes = {f.name: f.stat().st_mode & 0o777 for f in dense.iterdir()}
    assert modes["model.safetensors"] == modes["brisk.json"], modes
    again = brisk("convert", "--checkpoint_path", smollm2_gguf, "--output", str(dense))
    assert again.returncode == 2 and again.stderr.strip() == f"error: {dense}: already exists; --force writes over it"
    assert brisk("quantize", "--checkpoint_path", str(dense), "--mode", "int4", "--output", str(int4)).returncode == 0
    done = brisk("quantize", "--checkpoint_path", str(int4), "--mode", "int8", "--output", str(int8))
    assert done.returncode == 0, done.stderr
    keys = load(str(int8)).state_dict.keys()
    assert not any(k.endswith("_int4") for k in keys) and sum(k.endswith("_int8") for k in keys) >= 120
    assert "the source's matrices are quantized already (re-quantizing them to int8" in done.stderr
    assert "GGUF" not in done.stderr.split("Note:")[1]  # (a native source: no GGUF advice)
    done = brisk("quantize", "--checkpoint_path", str(int4), "--mode", "int8", "--output", str(int8), "--force")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_generate_reads_its_prompt_from_stdin_or_a_file_and_prints_json(smollm2_gguf, tmp_path):
    """A pipe on stdin is the prompt (not a hidden default); --prompt_file too;
    --json prints one object; seeded samples differ from each other."""
    import json
    greedy = ("--checkpoint_path", smollm2_gguf, "--max_new_tokens", "4", "--temperature", "0", "--json")
    piped = json.loads(brisk("generate", *greedy, input="The capital of France is\n").stdout)
    assert piped["samples"][0]["prompt_tokens"] == 5 and "Paris" in piped["samples"][0]["text"]
    (tmp_path / "prompt.txt").write_text("The capital of France is", encoding="utf-8")
    from_file = json.loads(brisk("generate", *greedy, "--prompt_file", str(tmp_path / "prompt.txt")).stdout)
    assert from_file["samples"][0]["text"] == piped["samples"][0]["text"]
    done = brisk("generate", "--checkpoint_path", smollm2_gguf, "--max_new_tokens", "12", "--json",
                 "--num_samples", "3", "--seed", "7", "--temperature", "1.0")
    samples = json.loads(done.stdout)["samples"]
    assert [s["seed"] for s in samples] == [7, 8, 9] and len({s["text"] for s in samples}) > 1
    assert all(s["new_tokens"] > 2 and s["decode_tokens_per_s"] > 0 for s in samples if s["new_tokens"] > 2)
    missing = brisk("generate", "--prompt_file", str(tmp_path / "nothing.txt"))
    assert missing.returncode == 2 and "nothing.txt" in missing.stderr and "Traceback" not in missing.stderr


def test_help_shows_defaults_and_every_flag_says_what_it_does():
    import argparse

    from brisklm.cli import build_parser
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    silent = [f"{name} {a.option_strings[0]}" for name, sub in commands.items() for a in sub._actions
              if a.option_strings and not a.help and not isinstance(a, argparse._HelpAction)]
    assert silent == []
    text = commands["generate"].format_help()
    assert "(default: 0.8)" in text and "(default: 200)" in text
    assert parser.parse_args(["bench", "--max-new-tokens", "7"]).new_tokens == 7  # (one name for new tokens)
