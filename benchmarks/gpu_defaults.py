"""The path a user gets on a GPU: defaults (no flags) against --no_compile,
and transformers eager and static-compiled on the same weights, one process
per variant (fresh memory, compiled state and caches), one table at the end.

    PYTHONPATH=. python3 benchmarks/gpu_defaults.py --gguf SmolLM2.gguf [--only smollm2,bf16] [--json out.json]

For each model (the SmolLM2 GGUF; the Llama-3.1-8B preset in bf16, int8 and
int4 g128): the first-run cost (load plus the first two tokens, which compile
or capture the decode step, in a process whose caches start as the machine's
are), decode tokens/s after a 5-token prompt (median of 3 runs of 200 greedy
tokens) with its fraction of the read ceiling measured in the same process,
and the time to first token for prompts of 5, 35, 64 and 200 tokens (median
of 3, after one run at that length). It checks that a prefill replayed from a
CUDA graph (padded) gives the greedy tokens the plain prefill gives, and
uncompiled, that the replayed decode step gives those of the op-by-op one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPTS = (5, 35, 64, 200)
MODELS = {"smollm2": {}, "bf16": {"preset": "llama-3.1-8b"},
          "int8": {"preset": "llama-3.1-8b", "quantize": "int8"},
          "int4": {"preset": "llama-3.1-8b", "quantize": "int4", "groupsize": 128}}
PEERS = ("smollm2", "bf16")  # transformers runs the dense weights


def measure(model: str, mode: str, gguf: str, device: str = "cuda") -> dict:
    """One variant, in this process. mode: default, no_compile, warm (default, second process), hf, hf_eager."""
    import torch

    import brisklm
    from brisklm.bench import _prompt, hf_peer_figures, kv_bytes_per_position, read_ceiling_gb_s
    kw = dict(MODELS[model], device=device)
    path = gguf if model == "smollm2" else None
    if mode.startswith("hf"):
        kw["quantize"] = "none"  # transformers reads dense weights
    if mode == "no_compile":
        kw["compile"] = False
    t0 = time.perf_counter()
    llm = brisklm.load(path, **kw)
    llm.wait_compiled()  # (timed: the compiled step, not the one that serves meanwhile)
    vocab = llm.model.args.vocab_size
    if mode.startswith("hf"):
        peer = hf_peer_figures(llm, 5, 200, 3, static=mode == "hf", ttft_lengths=PROMPTS[1:])
        ttft = {5: peer["ttft_ms"], **peer["ttft_ms_by_length"]}
        return {"decode": peer["tokens_per_s"], "ttft_ms": ttft, "first_run_s": peer["first_call_s"]}
    llm.warm_up(_prompt(5, vocab))
    first_run = time.perf_counter() - t0
    gen = llm.generator

    def run(ids, n):
        gen.reset()
        for _ in llm.stream_ids(ids, n, stop_ids=()):
            pass
        return llm.stats

    ids = _prompt(5, vocab)
    run(ids, 200)
    rates = [run(ids, 200).decode_tokens_per_s for _ in range(3)]
    ttft = {}
    for n in PROMPTS:
        ids_n = _prompt(n, vocab, seed=n)
        run(ids_n, 2)
        ttft[n] = statistics.median(run(ids_n, 2).prefill_s for _ in range(3)) * 1e3
    ceiling = read_ceiling_gb_s(torch.device(device))
    dtype = llm.model.dtype
    per_token = gen.stats.weight_bytes + 105 * kv_bytes_per_position(llm.model.args, dtype)
    rate = statistics.median(rates)
    from brisklm.sampling import SamplingParams
    ids = _prompt(35, vocab, seed=1)
    gen.reset()
    padded = list(gen.tokens(ids, 32, SamplingParams()))
    graphs, gen.steps.graphed_prefill = gen.steps.graphed_prefill, None
    gen.reset()
    plain = list(gen.tokens(ids, 32, SamplingParams()))
    gen.steps.graphed_prefill = graphs
    same = next((i for i, (a, b) in enumerate(zip(padded, plain)) if a != b), len(plain))
    check = {"graphed_prefill_same_greedy_tokens": f"{same}/{len(plain)}"}
    if gen.steps.graphed:  # the replayed step gives the tokens the op-by-op step gives
        from brisklm.generate import Generator
        ids = _prompt(35, vocab, seed=1)
        gen.reset()
        replayed = list(gen.tokens(ids, 64, SamplingParams()))
        os.environ["BRISKLM_CUDA_GRAPHS"] = "0"
        plain = Generator(llm.model, gen.max_seq_length)
        check["greedy_equals_op_by_op"] = (replayed == list(plain.tokens(ids, 64, SamplingParams())))
    return {**check, "decode": rate, "min": min(rates), "max": max(rates), "fraction": per_token * rate / ceiling / 1e9,
            "ceiling_gb_s": ceiling, "ttft_ms": ttft, "first_run_s": first_run,
            "cache": gen.max_seq_length, "compiled": gen.steps.compiled, "graphed": gen.steps.graphed,
            "torch": torch.__version__}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True, help="the bundled SmolLM2 GGUF")
    parser.add_argument("--only", default=",".join(MODELS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--modes", default=None, help="comma-separated: default,warm,no_compile,hf_eager,hf")
    parser.add_argument("--device", default="cuda", help="(cpu: to check the script itself)")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        print("RESULT " + json.dumps(measure(*opts.worker, opts.gguf, opts.device)), flush=True)
        return
    results = {}
    for model in opts.only.split(","):
        modes = ["default", "warm", "no_compile"] + (["hf_eager", "hf"] if model in PEERS else [])
        modes = [m for m in modes if not opts.modes or m in opts.modes.split(",")]
        for mode in modes:
            cmd = [sys.executable, __file__, "--gguf", opts.gguf, "--device", opts.device, "--worker", model, mode]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(f"{model} {mode} failed:\n{done.stderr[-2000:]}\n")
                continue
            results[f"{model} {mode}"] = r = json.loads(line[7:])
            r["process_s"] = time.perf_counter() - t0
            sys.stderr.write(f"{model} {mode}: {r}\n")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    print("| model | path | decode tok/s | fraction of read ceiling | TTFT ms (5 / 35 / 64 / 200 tokens) "
          "| first run s (load + first tokens) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        model, mode = name.split(" ")
        frac = f"{r['fraction']:.3f}" if "fraction" in r else ""
        ttft = " / ".join(f"{r['ttft_ms'][str(n)]:.1f}" for n in PROMPTS)
        print(f"| {model} | {mode} | {r['decode']:.1f} | {frac} | {ttft} | {r['first_run_s']:.1f} |")


if __name__ == "__main__":
    main()
