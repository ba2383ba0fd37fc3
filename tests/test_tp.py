"""Tensor parallelism on CPU processes (torchrun, gloo): world sizes 2 and 4
give the single-process fp32 logits (<= 1e-5) and greedy tokens, for a dense
model (with q/k/v biases), an MoE model, and int8 and int4 weights; each rank
holds 1/N of every split weight; 3 ranks, which the heads do not divide,
fail in one line before any process starts. tests/tp_child.py is one rank."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(ROOT, "tests", "tp_child.py")
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def run(tmp_path, world, *flags):
    out = tmp_path / f"world{world}.json"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
                if world > 1 else [sys.executable])
    done = subprocess.run(launcher + [CHILD, str(out), *flags], env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run(tmp_path_factory.mktemp("tp"), 1)


def check(single, split, world):
    assert split.pop("unseeded samples agree", True), world  # (tp_child: each rank its own random numbers)
    for case, ours in split.items():
        alone = single[case]
        diff = max(abs(a - b) for ra, rb in zip(alone["logits"], ours["logits"]) for a, b in zip(ra, rb))
        assert diff <= 1e-5, (case, world, diff)
        assert ours["tokens"] == alone["tokens"], (case, world)
        assert len(set(ours["bytes"])) == 1  # every rank the same share


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_equals_one_process(tmp_path, single, world):
    split = run(tmp_path, world)
    check(single, split, world)
    # The split weights are 1/N a rank (the embedding, output layer, norms and
    # routers are replicated: a fixed part, the same at every N).
    for case in split:
        whole, share = single[case]["bytes"][0], split[case]["bytes"][0]
        replicated = (world * share - whole) / (world - 1)  # share = replicated + split / N
        assert 0 < replicated < whole / 2, (case, world, share, whole)


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_tensor_parallel_step_equals_one_process(tmp_path, single):
    """The all-reduces are functional collectives, traced into the compiled step."""
    check(single, run(tmp_path, 2, "--compile"), 2)


def brisk(*args):
    return subprocess.run([sys.executable, "-m", "brisklm", *args], env=ENV, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_brisk_generate_tp_runs_torchrun_and_prints_what_one_process_prints():
    flags = ["generate", "--preset", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--max_new_tokens", "12",
             "--temperature", "0"]
    alone, split = brisk(*flags), brisk(*flags, "--tp", "2")
    assert alone.returncode == 0 and split.returncode == 0, split.stderr[-2000:]
    assert split.stdout == alone.stdout and split.stdout.strip()  # (rank 0 alone prints)
    assert "rank 0 of 2" in split.stderr and "rank 1" not in split.stderr


def test_a_world_size_that_does_not_divide_the_heads_is_one_line_before_launching():
    done = brisk("generate", "--preset", "tiny-moe", "--device", "cpu", "--tp", "3")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ("error: tiny-moe: num_attention_heads=4 does not divide by the "
                                   "tensor-parallel world size 3")


LOAD_CHILD = r"""
import json, os, sys
import torch
import torch.distributed as dist
import brisklm
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")  # (as brisk's CLI does under torchrun)
from brisklm.checkpoints import hf
whole = []  # the tensors read whole (the rest: each rank's share, read as such)
read = hf._TensorFiles.get
hf._TensorFiles.get = lambda self, name: whole.append(name) or read(self, name)
out, cases = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests"))
from test_tp import load_and_run
results = {}
for name, (folder, quantize) in cases.items():  # (one launch for every case: torchrun's start is the cost)
    whole.clear()
    results[name] = {**load_and_run(folder, quantize), "whole": list(whole)}
    world = dist.get_world_size() if dist.is_initialized() else 1
if world == 1 or dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(results, f)
if world > 1:  # (then an exit without the interpreter's teardown, as brisk's CLI ends: there gloo's
    dist.barrier()  # threads once aborted a rank, "terminate called without an active exception")
    os._exit(0)
"""
def load_and_run(folder: str, quantize: str) -> dict:
    """brisklm.load's model of folder: its fp32 logits of six ids and 8 greedy
    tokens after them (in LOAD_CHILD, each rank's; it holds 4 / world heads)."""
    import torch.distributed as dist
    import brisklm
    llm = brisklm.load(folder, device="cpu", dtype=torch.float32, compile=False, quantize=quantize)
    world = dist.get_world_size() if dist.is_initialized() else 1
    assert llm.model.layers[0].attention.n_heads == 4 // world  # (this rank's heads only)
    llm.model.setup_caches(1, 32)
    with torch.no_grad():
        logits = llm.model(torch.tensor([[3, 14, 15, 9, 26, 5]]), torch.arange(6), kv_len=6)[0]
    return {"logits": logits.tolist(),
            "tokens": list(llm.generator.tokens([3, 14, 15, 9, 26, 5], 8, brisklm.sampling.SamplingParams()))}


SHARE_CASES = [("llama", "none"), ("mixtral", "none"), ("phi4mini", "none"), ("llama", "int8"),
               ("llama-gguf", "none")]


def hf_model(case: str):
    """A tiny random transformers model of the case's family (-gguf: without q/k/v biases)."""
    import transformers
    base = dict(vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    gguf = case.endswith("-gguf")  # (llama.cpp's q/k row order undone head by head on each rank's share)
    case = case.removesuffix("-gguf")
    config = {"llama": lambda: transformers.LlamaConfig(**base, attention_bias=not gguf),
              "mixtral": lambda: transformers.MixtralConfig(**base, num_local_experts=4, num_experts_per_tok=2),
              "phi4mini": lambda: transformers.Phi3Config(**base, partial_rotary_factor=0.5, pad_token_id=0)}[case]()
    torch.manual_seed(0)
    return getattr(transformers, {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                                  "phi4mini": "Phi3ForCausalLM"}[case])(config)


@pytest.fixture(scope="module")
def shares(tmp_path_factory):
    """Every SHARE_CASES checkpoint, written, then loaded by both ranks of one
    torchrun launch: the folders and what rank 0 read and computed, by case."""
    tmp = tmp_path_factory.mktemp("shares")
    folders = {}
    for case, quantize in SHARE_CASES:
        folder = tmp / case
        if not folder.exists():
            model = hf_model(case)
            if case.endswith("-gguf"):
                import numpy as np
                from test_gguf_loader import write_gguf
                write_gguf(model, folder, np_dtype=np.float16)
            else:
                model.save_pretrained(folder)
        folders[f"{case}-{quantize}"] = [str(folder), quantize]
    (tmp / "child.py").write_text(LOAD_CHILD)
    out = tmp / "out.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp / "child.py"), str(out), json.dumps(folders)],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return folders, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case,quantize", SHARE_CASES)
def test_each_rank_reads_only_its_share_of_a_safetensors_folder(shares, case, quantize):
    """Under torchrun, loading.load reads each split tensor's share from the
    safetensors files (safe_open's slices), not the whole tensor; the model
    gives the single process's logits and tokens. Unquantized, every split
    tensor is read in part; quantized to int8 as it loads, the row-split ones
    (o_proj, down_proj) are read whole, since a row's int8 scale needs the row."""
    folders, results = shares
    folder, _ = folders[f"{case}-{quantize}"]
    split = results[f"{case}-{quantize}"]
    alone = load_and_run(folder, quantize)  # one process, for reference
    diff = max(abs(a - b) for ra, rb in zip(alone["logits"], split["logits"]) for a, b in zip(ra, rb))
    assert diff <= 1e-5 and split["tokens"] == alone["tokens"], diff
    parts = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", ".w1.", ".w2.", ".w3.")
    whole = {n for n in split["whole"] if any(p in n for p in parts)}
    if case.endswith("-gguf"):  # (whose reads this test does not watch)
        return
    if quantize == "none" and case != "phi4mini":
        assert not whole, sorted(whole)
    elif case == "phi4mini":  # (q, k, v stored fused in one tensor, gate and up too: read whole)
        assert whole == {f"model.layers.{i}.{p}.weight" for i in range(2)
                         for p in ("self_attn.qkv_proj", "mlp.gate_up_proj")}, sorted(whole)
    else:
        assert whole and all("o_proj" in n or "down_proj" in n for n in whole), sorted(whole)


@pytest.mark.slow
def test_brisk_chat_tp_reads_the_terminal_once_and_replies_as_one_process(smollm2_gguf):
    """Rank 0 reads each line and every rank takes the same turn: the replies
    are the single process's (SmolLM2's 9 heads and 3 KV heads over 3 ranks)."""
    flags = ["chat", "--checkpoint_path", smollm2_gguf, "--device", "cpu", "--dtype", "float32", "--temperature",
             "0", "--max_new_tokens", "12", "--no_compile"]  # (the single process too: no compile beside it)
    talk = "What is the capital of France?\nAnd of Italy?\n/exit\n"
    alone = subprocess.run([sys.executable, "-m", "brisklm", *flags], env=ENV, input=talk, capture_output=True,
                           text=True, timeout=600)
    split = subprocess.run([sys.executable, "-m", "brisklm", *flags, "--tp", "3"], env=ENV, input=talk,
                           capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0 and split.returncode == 0, split.stderr[-2000:]
    assert split.stdout == alone.stdout and "Paris" in split.stdout
    assert "rank 0 of 3" in split.stderr


def test_brisk_serve_under_torchrun_is_one_line():
    done = subprocess.run([sys.executable, "-m", "brisklm", "serve", "--preset", "tiny-moe", "--device", "cpu"],
                          env={**ENV, "WORLD_SIZE": "2"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "error: brisk serve does not run tensor-parallel yet (generate, chat and bench do)"


@pytest.mark.slow
def test_a_tensor_parallel_profile_holds_the_all_reduces_tp_scaling_counts(tmp_path):
    """`brisk generate --tp 2 --profile` writes the first rank's trace, in
    which benchmarks/tp_scaling.py finds the all-reduce time (gloo's spans on
    CPUs: two a layer a token)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from tp_scaling import collective_ms
    trace = tmp_path / "trace.json"
    done = brisk("generate", "--preset", "tiny-moe", "--device", "cpu", "--max_new_tokens", "6", "--tp", "2",
                 "--profile", str(trace))
    assert done.returncode == 0, done.stderr[-2000:]
    assert collective_ms(str(trace)) > 0
    with open(trace) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e.get("name") == "gloo:all_reduce"]
    assert len(spans) >= 2 * 2 * 6, len(spans)  # (tiny-moe: 2 layers)
