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


def run_python(*args: str, timeout: int = 1800) -> str:
    """A child Python's stdout (args after the interpreter), asserting that it succeeded."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout


def run_script(name: str, *args: str) -> str:
    return run_python(os.path.join(ROOT, "benchmarks", name), *args)


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
    run_python("-c", code, timeout=300)


def test_a_sampled_verifys_acceptance_replayed_from_a_cuda_graph_keeps_its_distribution():
    """speculative.sampled_choices captured in a CUDA graph (steps.replayed,
    as warm_speculative captures it) and replayed 40,000 times on fixed
    logits: each draft kept with probability min(1, p/q), and each row's
    token drawn from its residual (p - q)+ (q: one-hot for prompt lookup,
    or a drafting model's proposals, here dearer than p at the drafts),
    within 5 standard errors: every replay draws afresh."""
    code = ("import torch\n"
            "from brisklm.sampling import SamplingParams, logits_to_probs\n"
            "from brisklm.speculative import sampled_choices\n"
            "from brisklm.steps import replayed\n"
            "torch.manual_seed(0)\n"
            "logits, ids, n = torch.randn(3, 12, device='cuda'), torch.tensor([5, 7], device='cuda'), 40000\n"
            "settings = SamplingParams(temperature=1.0).on('cuda')\n"
            "p = logits_to_probs(logits, settings)\n"
            "for q in (None, torch.softmax(torch.randn(2, 12, device='cuda') + 3 * torch.nn.functional.one_hot(ids, 12), -1)):\n"
            "    choose = replayed(sampled_choices)\n"
            "    out = torch.stack([choose(logits, ids, q, settings).clone() for _ in range(n)]).cpu()\n"
            "    qd = torch.ones(2) if q is None else q.cpu()[[0, 1], ids.cpu()]\n"
            "    want_keep = (p.cpu()[[0, 1], ids.cpu()] / qd).clamp(max=1)\n"
            "    got_keep = out[:, :2].double().mean(0)\n"
            "    err = (want_keep * (1 - want_keep) / n).sqrt()\n"
            "    assert ((got_keep - want_keep).abs() <= 5 * err + 1e-9).all(), (got_keep, want_keep)\n"
            "    one_hot = torch.zeros(2, 12).scatter_(1, ids.cpu()[:, None], 1.0)\n"
            "    residual = (p.cpu()[:2] - (one_hot if q is None else q.cpu())).clamp(min=0)\n"
            "    for row, want in enumerate([*(residual / residual.sum(-1, keepdim=True)), p.cpu()[2]]):\n"
            "        got = torch.bincount(out[:, 3 + row], minlength=12).double() / n\n"
            "        err = (want.double() * (1 - want.double()) / n).sqrt()\n"
            "        assert ((got - want).abs() <= 5 * err + 1e-9).all(), (row, got, want)\n"
            "    assert out[:, 2].eq(0).all() and len(choose.graphs) == 1\n"
            "print('ok')\n")
    assert "ok" in run_python("-c", code, timeout=300)
