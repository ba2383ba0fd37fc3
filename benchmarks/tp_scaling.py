"""Tensor-parallel decode speed over 1, 2, 4, 8 GPUs (issue 30's runs), one table.

    python3 benchmarks/tp_scaling.py [--presets llama-3.1-8b,llama-3.1-70b,mixtral-8x7b]
        [--modes none,int8] [--worlds 1,2,4,8] [--device cuda] [--samples 3]

Each cell is `brisk bench --preset P --quantize Q --tp N` (torchrun under
it, NCCL_NVLS_ENABLE=0), random weights in the real shapes, batch 1, a
5-token prompt, compiled decode: decode tokens/s, and the weights one rank
reads a token times that rate (the read bandwidth per GPU). A world size
the GPUs or the heads do not allow, or a model that does not fit, is
skipped with its one-line reason. On CPUs (--device cpu) it runs gloo
processes, for checking the script itself.

--profile: for each world above 1, also `brisk generate --tp N --profile`
of --profile_tokens tokens, and from the first rank's trace the all-reduce
time a token (NCCL's kernels on GPUs; gloo's all-reduce spans on CPUs,
waits included) and its share of a decode step, which is what the scaling
loses to communication.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def bench(preset: str, mode: str, world: int, device: str, samples: int) -> tuple[dict | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        command = [sys.executable, "-m", "brisklm", "bench", "--preset", preset, "--device", device,
                   "--quantize", mode, "--samples", str(samples), "--prefill", "", "--context", "",
                   "--json", out] + (["--tp", str(world)] if world > 1 else [])
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
            return None, (lines[-1] if lines else (done.stderr.strip().splitlines() or ["failed"])[-1])
        with open(out) as f:
            return json.load(f), ""


def collective_ms(trace_path: str) -> float:
    """Milliseconds of all-reduce in a torch.profiler chrome trace: NCCL's
    kernels where the GPU ran them, else gloo's all-reduce spans."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    spans = kernels or [e for e in events if e["name"] == "gloo:all_reduce"]
    return sum(e.get("dur", 0) for e in spans) / 1e3


def all_reduce_per_token(preset: str, mode: str, world: int, device: str, tokens: int) -> tuple[float | None, str]:
    """(all-reduce milliseconds a generated token, or None, why not)."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        command = [sys.executable, "-m", "brisklm", "generate", "--preset", preset, "--device", device,
                   "--quantize", mode, "--tp", str(world), "--max_new_tokens", str(tokens), "--num_samples", "2",
                   "--profile", trace]
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(trace):
            return None, (done.stderr.strip().splitlines() or ["profile failed"])[-1]
        return collective_ms(trace) / tokens, ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="llama-3.1-8b,llama-3.1-70b,mixtral-8x7b")
    ap.add_argument("--modes", default="none,int8")
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also the all-reduce time a token, from a profile")
    ap.add_argument("--profile_tokens", type=int, default=64)
    opts = ap.parse_args()
    gpus = None
    if opts.device == "cuda":
        import torch
        gpus = torch.cuda.device_count()
    rows = []
    for preset in opts.presets.split(","):
        for mode in opts.modes.split(","):
            for world in map(int, opts.worlds.split(",")):
                if gpus is not None and world > gpus:
                    rows.append((preset, mode, world, None, f"only {gpus} GPUs"))
                    continue
                result, why = bench(preset, mode, world, opts.device, opts.samples)
                if result and opts.profile and world > 1:
                    result["all_reduce_ms"], why = all_reduce_per_token(preset, mode, world, opts.device,
                                                                        opts.profile_tokens)
                rows.append((preset, mode, world, result, why))
                figure = f"{result['decode']['tokens_per_s']:.1f} tok/s" if result else why
                print(f"{preset} {mode} tp {world}: {figure}", file=sys.stderr, flush=True)
    print("| model | weights | GPUs | decode tok/s | GB a token, one rank | GB/s a GPU "
          "| all-reduce a token, ms (share of the step) | note |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for preset, mode, world, result, why in rows:
        if result is None:
            print(f"| {preset} | {mode} | {world} | | | | | {why} |")
            continue
        rate, read = result["decode"]["tokens_per_s"], result["decode"]["bytes_per_token"] / 1e9
        reduce = result.get("all_reduce_ms")
        share = f"{reduce:.3f} ({reduce * rate / 1e3:.2f})" if reduce is not None else ""
        print(f"| {preset} | {mode} | {world} | {rate:.1f} | {read:.2f} | {rate * read:.0f} | {share} | {why} |")


if __name__ == "__main__":
    main()
