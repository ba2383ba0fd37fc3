"""The GPU checks (benchmarks/*_check.py and the kernels' correctness
passes), as tests marked `gpu`: skipped without CUDA, run on the device with

    python -m pytest -m gpu tests/test_gpu.py

Each runs its script in a child process (its own CUDA context and compiler
state) and fails when the script reports a check outside its bound."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout


def test_compiled_and_graphed_steps_give_the_eager_tokens(smollm2_gguf):
    assert "| check | result |" in run_script("gpu_check.py", "--gguf", smollm2_gguf)


def test_quantized_decode_logits_on_the_gpu_match_the_dequantized_weights():
    assert "all within bound" in run_script("gpu_quant_check.py", "--layers", "4")


def test_decode_attention_kernel_matches_fp64():
    assert "worst relative error" in run_script("attention_check.py")


def test_gemvs_match_fp64_at_every_preset_shape():
    assert "correctness" in run_script("gemv_sweep.py", "--kinds", "")


def test_few_rows_matmul_matches_fp64_at_the_8b_shapes():
    assert "worst relative error" in run_script("few_rows.py", "--tokens", "2,17,64")


def test_no_request_compiles_or_captures_after_the_start(tmp_path):
    """The latency sequence (every sampling filter, a seed, stop ids, prompt
    lengths 1 to 8000) on the default path: nothing raises, and no request
    compiles or captures a graph once the step compiling on another thread
    has been switched to (waits not checked: a benchmark's business)."""
    import json
    out = tmp_path / "latency.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "latency.py"), "--preset",
                           "smollm2-135m", "--json", str(out)], env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=1800)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["compiles_after_start"] == 0, result["requests"]
    assert all(r["graphs_captured"] == 0 for r in result["requests"]), result["requests"]
    assert result["compiled"], "the step compiled on another thread was never switched to"


def test_every_way_of_running_a_step_gives_the_same_tokens():
    """Block-compiled, uncompiled and op-by-op steps, and the prefill graphs
    captured between turns as brisk chat does (steps_check.py)."""
    assert "all the same" in run_script("steps_check.py")


def test_the_cuda_context_starts_beside_the_load_and_a_missing_gpu_is_one_error():
    """loading.usable_device(meanwhile=True): the context is created on a
    thread (device_ready waits for it); a GPU index past the machine's is
    refused at once, as a user error."""
    code = ("import torch\n"
            "from brisklm.errors import BriskError\n"
            "from brisklm.loading import device_ready, usable_device\n"
            "usable_device('cuda', meanwhile=True)\n"
            "device_ready('cuda')\n"
            "assert torch.cuda.is_initialized() and torch.ones(2, device='cuda').sum().item() == 2\n"
            "missing = f'cuda:{torch.cuda.device_count()}'\n"
            "try:\n"
            "    usable_device(missing, meanwhile=True)\n"
            "except BriskError as e:\n"
            "    assert 'not usable' in str(e), e\n"
            "else:\n"
            "    raise AssertionError(missing)\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
