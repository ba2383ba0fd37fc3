"""What a new user meets in the first hour: a machine without triton, prompts
longer than the cache, a chat that outgrows it, formats that keep their
blocks, bad values caught before the model loads, progress in logs."""
import os
import subprocess
import sys

import pytest

import forked_brisk

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_TRITON = "import sys; sys.modules['triton'] = None  # as on a CPU wheel: `import triton` fails\n"


def python(code, timeout=300, input=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          input=input, cwd=REPO)


def brisk(*args, timeout=300, input=None):
    """`brisk ARGS` where `import triton` fails (forked from a process that blocked it before importing brisklm)."""
    return forked_brisk.run(args, cwd=REPO, input=input, timeout=timeout, without_triton=True)


def one_error_line(done):
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and lines[-1].startswith("error: "), done.stderr
    return lines[-1]


@pytest.mark.slow
def test_brisklm_imports_and_generates_without_triton():
    done = python(BLOCK_TRITON + """
import torch, brisklm
from brisklm.kernels import attention, gemv
from brisklm.generate import Generator
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.sampling import SamplingParams
assert gemv.triton is None and not attention.supported(torch.device("cpu"), 1, 1, 64)
args = ModelArgs(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2)
model = build_model(args, random_state_dict(args, torch.float32, seed=0, std=0.3))
print(list(Generator(model, 32).tokens([1, 2, 3], 5, SamplingParams())))
""")
    assert done.returncode == 0, done.stderr
    ids = eval(done.stdout)
    assert len(ids) == 5 and all(0 <= i < 61 for i in ids)


@pytest.mark.slow
def test_the_cli_runs_without_triton():
    done = brisk("generate", "--preset", "smollm2-135m", "--device", "cpu", "--max_new_tokens", "3",
                 "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert "Sample 1: 3 tokens" in done.stderr
    assert "Compiling" not in done.stderr  # CPUs run uncompiled by default


def test_the_steps_are_compiled_by_default_on_cuda_only():
    import torch
    import brisklm
    from brisklm.loading import default_compile
    from brisklm.cli import build_parser
    assert default_compile("cuda") and default_compile(torch.device("cuda:1")) and not default_compile("cpu")
    # The CLI leaves the choice to load() unless told: both follow default_compile.
    parse = lambda *flags: build_parser().parse_args(["generate", *flags])  # noqa: E731
    assert parse().compile is None and parse().compile_prefill is None
    assert parse("--compile").compile is True and parse("--no_compile").compile is False
    gen = brisklm.load(preset="smollm2-135m", device="cpu", max_seq_length=64).generator
    assert not gen.steps.compiled and not gen.steps.graphed


@pytest.mark.slow
def test_a_prompt_too_long_for_the_cache_names_the_option_and_the_model_context(smollm2_gguf):
    done = brisk("generate", "--checkpoint_path", smollm2_gguf, "--max_seq_length", "16",
                 "--prompt", "The capital of France is " * 10, "--max_new_tokens", "4")
    line = one_error_line(done)
    assert "KV cache of 16 tokens" in line and "--max_seq_length" in line and "context of 8192" in line


@pytest.mark.slow
def test_a_cache_past_the_model_context_is_refused_in_one_line(smollm2_gguf):
    line = one_error_line(brisk("generate", "--checkpoint_path", smollm2_gguf, "--max_seq_length", "9000"))
    assert "context of 8192 tokens" in line and "--allow_long_context" in line


@pytest.mark.slow
@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--top_p", "1.5"), ("--top_p", "0"),
                                         ("--min_p", "2"), ("--top_k", "0")])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_sampling_values_fail_before_the_model_loads(command, flag, value, tmp_path):
    # The checkpoint does not exist: an error about it would mean the model was loaded first.
    done = brisk(command, "--checkpoint_path", str(tmp_path / "missing.gguf"), flag, value)
    line = one_error_line(done)
    assert flag[2:] in line and "missing.gguf" not in line


@pytest.mark.slow
def test_a_usage_mistake_prints_one_line():
    done = brisk("generate", "--max_new_tokens", "many")
    line = one_error_line(done)
    assert "--max_new_tokens" in line and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_chat_survives_an_oversized_message_and_drops_the_oldest_turns(smollm2_gguf):
    questions = ["word " * 300, "What is the capital of France?", "And of Italy?", "And of Spain?",
                 "And of Germany?", "What is the capital of France?"]
    done = brisk("chat", "--checkpoint_path", smollm2_gguf, "--max_seq_length", "128", "--dtype", "float32",
                 "--quantize", "none", "--temperature", "0", "--max_new_tokens", "24",
                 "--system", "Answer in one short sentence.", input="\n".join(questions + ["/exit"]) + "\n")
    assert done.returncode == 0, done.stderr
    assert "was not sent" in done.stderr and "KV cache of 128" in done.stderr
    replies = [line for line in done.stderr.splitlines() if line.startswith("[") and "tokens/s" in line]
    assert len(replies) == 5  # every message after the oversized one was answered
    assert done.stderr.count("outgrew the KV cache") == 1 and "system message kept" in done.stderr
    assert done.stdout.count("Paris") == 2  # first asked, and asked again after turns were dropped
    assert "Rome" in done.stdout and "Berlin" in done.stdout


@pytest.mark.slow
def test_quantize_says_why_its_output_outgrows_a_4_bit_source(smollm2_gguf, tmp_path):
    out = tmp_path / "int8"
    done = brisk("quantize", "--checkpoint_path", smollm2_gguf, "--mode", "int8", "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert "is larger than its source" in done.stderr and "quantized already (re-quantizing them to int8" in done.stderr
    # stderr is a pipe here: the long steps still print a start and an end with the time taken
    for line in ("Reading", "quantizing to int8 tensor by tensor and writing", "Read, quantized and written in"):
        assert line in done.stderr, line


@pytest.mark.slow
def test_the_readme_python_example_runs(smollm2_gguf):
    if os.path.basename(smollm2_gguf) != "SmolLM2-135M-Instruct.Q4_1.gguf":
        pytest.skip("default model not in a brisk cache folder")
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    block = readme.split("From Python:\n\n", 1)[1].split("\n\n", 1)[0]
    code = "\n".join(line[4:] for line in block.splitlines())
    env = {**os.environ, "BRISKLM_CACHE": os.path.dirname(smollm2_gguf)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and "Paris" in done.stdout.splitlines()[0]


def test_the_kernels_are_taken_on_nvidia_gpus_only(monkeypatch):
    import torch
    from brisklm.kernels import attention, gemv
    if gemv.triton is None:
        pytest.skip("triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    assert gemv.available(cuda) and attention.supported(cuda, 1, 1, 64)
    monkeypatch.setattr(torch.version, "hip", "6.4")  # a ROCm build names its GPUs "cuda" too
    assert not gemv.available(cuda) and not attention.supported(cuda, 1, 1, 64)
    for other in ("cpu", "mps"):
        assert not gemv.available(torch.device(other))
