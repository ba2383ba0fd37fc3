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
