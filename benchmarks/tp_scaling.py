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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="llama-3.1-8b,llama-3.1-70b,mixtral-8x7b")
    ap.add_argument("--modes", default="none,int8")
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--samples", type=int, default=3)
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
                rows.append((preset, mode, world, result, why))
                figure = f"{result['decode']['tokens_per_s']:.1f} tok/s" if result else why
                print(f"{preset} {mode} tp {world}: {figure}", file=sys.stderr, flush=True)
    print("| model | weights | GPUs | decode tok/s | GB a token, one rank | GB/s a GPU | note |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for preset, mode, world, result, why in rows:
        if result is None:
            print(f"| {preset} | {mode} | {world} | | | | {why} |")
            continue
        rate, read = result["decode"]["tokens_per_s"], result["decode"]["bytes_per_token"] / 1e9
        print(f"| {preset} | {mode} | {world} | {rate:.1f} | {read:.2f} | {rate * read:.0f} | |")


if __name__ == "__main__":
    main()
