"""`brisk bench` on the CPU: the harness runs end to end and its arithmetic is right."""
import json
import sys

import pytest
import torch

import forked_brisk
from brisklm.bench import LLAMA_CONFIG, _to_hf_state_dict, dense_weights, hf_peer_figures, kv_bytes_per_position, prefill_flops
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.presets import preset

TINY = ModelArgs(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2)


@pytest.mark.slow
def test_bench_reports_every_figure(smollm2_gguf, tmp_path):
    out = tmp_path / "bench.json"
    done = forked_brisk.run(
        ["bench", "--checkpoint_path", smollm2_gguf, "--device", "cpu",
         "--prefill", "32", "--context", "64", "--samples", "2", "--new_tokens", "4", "--max_seq_length", "400",
         "--speculate", "ngram",
         "--json", str(out), "--markdown", str(tmp_path / "bench.md")], timeout=300)
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    assert r["read_ceiling_gb_s"] > 0 and r["matmul_tflops"] > 0
    d = r["decode"]
    assert d["min"] <= d["tokens_per_s"] <= d["max"] and d["tokens_per_s"] > 0
    assert 0 < d["fraction_of_ceiling"] <= 1.5  # noisy CPU; above 1 would mean a wrong count
    assert [t["tokens"] for t in r["ttft"]] == [5, 32]
    assert r["long_context"][0]["prompt_tokens"] == 64
    assert r["max_seq_length"] == 400  # asked for; the longest request needs 64 + 4 + 8
    sp = r["speculative"]  # the input-grounded prompt, with and without prompt lookup
    assert sp["same_tokens"] and sp["prompt_tokens"] > 250 and sp["speculative"]["tokens_per_step"] >= 1
    assert sp["plain"]["tokens_per_s"] > 0 and sp["speedup"] > 0
    assert "| fraction of the read ceiling |" in (tmp_path / "bench.md").read_text()


def test_kv_bytes_of_llama_3_1_8b():
    # 32 layers x (k + v) x 8 heads x 128 dims x 2 bytes = 128 KiB per position.
    assert kv_bytes_per_position(preset("llama-3.1-8b"), torch.bfloat16) == 131072


def test_prefill_flops_count_two_per_weight_per_token():
    args = preset("llama-3.1-8b")
    weights = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    attention = 2 * 2 * 32 * 32 * 128 * 1024 * 1024 / 2
    assert prefill_flops(args, 1024) == 2 * weights * 1024 + attention + 2 * 4096 * 128256


def test_the_peer_gets_the_same_weights():
    transformers = pytest.importorskip("transformers")
    state = random_state_dict(TINY, torch.float32, std=0.3)
    ours = build_model(TINY, state)
    ours.setup_caches(1, 16)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY.to_dict().items() if k in LLAMA_CONFIG and v is not None})
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.load_state_dict(_to_hf_state_dict(TINY, state))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert (ours(ids, torch.arange(5)) - ref(ids).logits).abs().max() <= 1e-4


@pytest.mark.slow
def test_the_peer_runs_on_the_bundled_model_whose_blocks_we_keep_quantized(smollm2_gguf):
    """The default model keeps its Q4_1 blocks as int4; transformers gets the
    same weights dense (and a config it accepts: no None fields)."""
    pytest.importorskip("transformers")
    import brisklm
    llm = brisklm.load(smollm2_gguf, device="cpu", warm_up=False)
    state = dense_weights(llm)
    dense = brisklm.load(smollm2_gguf, device="cpu", quantize="none", warm_up=False).model.state_dict()
    assert set(dense) - set(state) <= {"output.weight"}  # (tied: the embedding's)
    assert all(torch.equal(state[k], dense[k]) for k in state)
    figures = hf_peer_figures(llm, prompt_len=4, new_tokens=2, samples=1, static=False)
    assert figures["tokens_per_s"] > 0


@pytest.mark.slow
def test_bench_speculates_with_a_draft_preset(tmp_path):
    """--speculate draft with --draft_preset: the draft is that shape with random
    weights (here the target's own shape, so its drafts are the target's
    tokens); the decode figures stay plain decoding's."""
    out = tmp_path / "bench.json"
    done = forked_brisk.run(
        ["bench", "--preset", "tiny-moe", "--device", "cpu", "--prefill", "",
         "--context", "", "--samples", "2", "--new_tokens", "16", "--speculate", "draft",
         "--draft_preset", "tiny-moe", "--json", str(out)], timeout=300)
    assert done.returncode == 0, done.stderr
    sp = json.loads(out.read_text())["speculative"]
    assert sp["kind"] == "draft" and sp["same_tokens"] and sp["speculative"]["tokens_per_step"] > 1


def bench_result(quantize, tokens_per_s, peer=None):
    """The figures of a `brisk bench --json` result that --plot draws."""
    r = {"model": "smollm2-135m", "device": "cpu", "torch": torch.__version__, "date": "2026-12-04",
         "quantize": quantize, "read_ceiling_gb_s": 10.0,
         "decode": {"tokens_per_s": tokens_per_s, "bytes_per_token": 1e8, "fraction_of_ceiling": tokens_per_s / 100}}
    return {**r, "peer_hf": {"tokens_per_s": peer}} if peer else r


def test_bench_plots_saved_results_side_by_side_as_png_or_svg(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from brisklm.cli import main
    files = []
    for i, r in enumerate([bench_result("none", 28.0, peer=22.0), bench_result("int8", 43.0)]):
        files.append(str(tmp_path / f"{i}.json"))
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    assert main(["bench", "--plot", str(tmp_path / "out.png"), "--from", *files]) == 0
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["bench", "--plot", str(tmp_path / "out.svg"), "--from", *files]) == 0
    svg = (tmp_path / "out.svg").read_text()
    for label in ("read ceiling", "transformers", "28 (28%)", "43 (43%)", "int8"):  # (the ceiling: 100 tok/s)
        assert label in svg, label


@pytest.mark.parametrize("argv, message", [
    (["--plot", "out.pdf"], "--plot out.pdf: name a .png or .svg file"),
    (["--from", "r.json"], "--from draws saved results: give --plot FILE too"),
    (["--plot", "out.png", "--from", "absent.json"], "--from absent.json: cannot read it as JSON"),
    (["--plot", "out.png", "--from", "list.json"], "--from list.json: not a `brisk bench --json` result"),
])
def test_bench_plot_mistakes_are_one_line_before_the_benchmark_runs(argv, message, tmp_path, monkeypatch, capsys):
    from brisklm import bench
    from brisklm.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "list.json").write_text("[]")
    monkeypatch.setattr(bench, "run", lambda opts: pytest.fail("the benchmark ran"))
    assert main(["bench", "--preset", "smollm2-135m", *argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines


def test_bench_plot_without_matplotlib_names_the_extra_before_running(monkeypatch, capsys):
    from brisklm import bench
    from brisklm.cli import main
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib fails, as where it is not installed)
    monkeypatch.setattr(bench, "run", lambda opts: pytest.fail("the benchmark ran"))
    assert main(["bench", "--preset", "smollm2-135m", "--plot", "out.png"]) == 2
    assert capsys.readouterr().err == 'error: --plot needs matplotlib: pip install -e ".[plot]"\n'
