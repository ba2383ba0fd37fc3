"""One GPU session's checks and timings for the core engine; prints a table last.

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--gguf SmolLM2.gguf] [--peer]

1. the device's read-bandwidth ceiling (bf16 sum over 4 GB, two buffers
   alternated so L2 cannot help, CUDA events, median of 20);
2. `brisk generate --preset llama-3.1-8b --compile` (random bf16 weights,
   5-token prompt, 200 new tokens, 3 samples) through the real CLI;
3. the bundled SmolLM2 GGUF on the GPU, greedy, compiled: must say "Paris";
4. with --peer: Hugging Face transformers on the same shape with random bf16
   weights (eager, and static cache + torch.compile as its docs describe),
   timing generate() of 200 tokens after a warm-up (prefill included).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

import torch


def read_ceiling_gb_s(gb=4.0, reps=20):
    n = int(gb * 1e9 / 2)
    bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        bufs[i % 2].sum()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del bufs
    torch.cuda.empty_cache()
    return n * 2 / statistics.median(times) / 1e9


def run_cli(args, timeout=900):
    cmd = [sys.executable, "-m", "brisklm", "generate"] + args
    print("$ brisk generate " + " ".join(args), flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    print(done.stdout[-2000:], done.stderr[-3000:], sep="\n", flush=True)
    if done.returncode:
        raise SystemExit(f"CLI failed with {done.returncode}")
    err = done.stderr
    rates = [float(x) for x in re.findall(r"decode ([\d.]+) tokens/s", err)]
    ttft = [float(x) for x in re.findall(r"time to first token ([\d.]+) ms", err)]
    comp = re.search(r"Compiled in ([\d.]+) s", err)
    weights = float(re.search(r"model weights ([\d.]+) GB", err).group(1))
    peak = float(re.search(r"peak memory ([\d.]+) GB", err).group(1))
    return dict(rates=rates, ttft_ms=ttft, compile_s=float(comp.group(1)) if comp else None,
                weights_gb=weights, peak_gb=peak, wall_s=wall, stdout=done.stdout)


HF_PEER = r'''
import sys, time, torch, transformers
from brisklm.presets import PRESETS
cfg = dict(PRESETS["llama-3.1-8b"]); mode = sys.argv[1]
config = transformers.LlamaConfig(**cfg)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(config).eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        p.fill_(1.0) if "norm" in n else p.normal_(0, 0.02)
ids = torch.tensor([[1, 2, 3, 4, 5]], device="cuda")
kw = dict(max_new_tokens=200, min_new_tokens=200, do_sample=False)
if mode == "static":
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
t0 = time.perf_counter(); model.generate(ids, **kw); torch.cuda.synchronize()
warm = time.perf_counter() - t0
times = []
for _ in range(3):
    t0 = time.perf_counter(); out = model.generate(ids, **kw); torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
new = out.shape[1] - ids.shape[1]
print("PEER", mode, new / sorted(times)[1], warm)
'''


def run_peer(mode, timeout=600):
    try:
        done = subprocess.run([sys.executable, "-c", HF_PEER, mode], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    m = re.search(r"PEER \w+ ([\d.]+) ([\d.]+)", done.stdout)
    if not m:
        print(done.stderr[-3000:], flush=True)
        return None
    return float(m.group(1)), float(m.group(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--max_seq_length", type=int, default=1024)
    opts = ap.parse_args()
    rows = []
    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    ceiling = read_ceiling_gb_s()
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)

    ours = run_cli(["--preset", "llama-3.1-8b", "--device", "cuda", "--compile", "--max_new_tokens",
                    "200", "--num_samples", "3", "--max_seq_length", str(opts.max_seq_length)])
    # The compiled step attends over the whole static cache: count those bytes too.
    layers, kv_heads, head_dim = 32, 8, 128
    kv_gb = 2 * layers * kv_heads * head_dim * opts.max_seq_length * 2 / 1e9
    rate = statistics.median(ours["rates"])
    rows.append(("brisk bf16 compiled (llama-3.1-8b preset)", rate,
                 (ours["weights_gb"] + kv_gb) * rate / ceiling, ours))

    if opts.gguf:
        smol = run_cli(["--checkpoint_path", opts.gguf, "--device", "cuda", "--compile",
                        "--temperature", "0", "--prompt", "The capital of France is",
                        "--max_new_tokens", "32", "--num_samples", "2", "--max_seq_length", "256"])
        assert "Paris" in smol["stdout"], "SmolLM2 on CUDA did not answer Paris"
        rate_s = statistics.median(smol["rates"])
        rows.append(("brisk bf16 compiled (SmolLM2-135M GGUF)", rate_s,
                     smol["weights_gb"] * rate_s / ceiling, smol))

    peers = {}
    if opts.peer:
        for mode in ("eager", "static"):
            peers[mode] = run_peer(mode)
            print("peer", mode, peers[mode], flush=True)

    print("\n| run | decode tok/s | fraction of read ceiling | TTFT ms | compile s | peak GB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r, frac, d in rows:
        print(f"| {name} | {r:.1f} | {frac:.2f} | {statistics.median(d['ttft_ms']):.1f} | "
              f"{d['compile_s'] or 0:.1f} | {d['peak_gb']:.1f} |")
    for mode, res in peers.items():
        if res:
            print(f"| HF transformers {mode} (prefill incl.) | {res[0]:.1f} | "
                  f"{(ours['weights_gb']) * res[0] / ceiling:.2f} | | {res[1]:.1f} (1st call) | |")
            print(f"| ratio brisk / HF {mode} | {rate / res[0]:.2f}x | | | | |")
    print(f"\nread ceiling: {ceiling:.0f} GB/s; torch {torch.__version__}; "
          f"{torch.cuda.get_device_name()}; KV bytes counted for brisk 8B: {kv_gb:.3f} GB")
    print(json.dumps({"ceiling_gb_s": ceiling, "rows": [(n, r, f) for n, r, f, _ in rows],
                      "peers": peers}))


if __name__ == "__main__":
    main()
