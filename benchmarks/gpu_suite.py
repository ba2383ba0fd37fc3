"""Every published decode variant in one call: one `brisk bench` process per
variant (fresh memory and compiled state each), then one summary table.

    PYTHONPATH=. python3 benchmarks/gpu_suite.py [--presets llama-3.1-8b,qwen3-8b] [--only bf16,int8]
        [--warm] [-- extra bench flags]

Each variant runs on each preset. --warm first runs them all at once with one
short sample each, so that the compiles share the GPU's wait and fill
inductor's caches; the timed runs then follow one at a time. Each variant's
full markdown goes to stderr as it finishes; the table comes last on stdout,
ready for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

BASE = ["--device", "cuda", "--compile", "--samples", "3", "--prefill", ""]
VARIANTS = {
    "bf16": ["--context", "32768", "--peer", "hf"],
    "bf16-short": ["--context", ""],  # the quantized variants' settings: 5-token prompt, the default cache
    "int8": ["--quantize", "int8", "--context", ""],
    "fp8": ["--quantize", "fp8", "--context", ""],
    "q8_0": ["--quantize", "q8_0", "--context", ""],
    "int4": ["--quantize", "int4", "--groupsize", "128", "--context", ""],
    "bf16-kv8": ["--kv_int8", "--context", "32768"],
    "bf16-4096": ["--max_seq_length", "4096", "--context", ""],  # `brisk generate`'s cache until 2026-12-01
}


def command(preset: str, name: str, extra: list[str], out: str) -> list[str]:
    return [sys.executable, "-m", "brisklm", "bench", "--preset", preset, *BASE, *VARIANTS[name], *extra,
            "--json", out]


def warm(runs: list[tuple[str, str]], extra: list[str], jobs: int):
    """The runs `jobs` at a time, one short sample each: compiles overlap, caches fill."""
    with tempfile.TemporaryDirectory() as tmp:
        for start in range(0, len(runs), jobs):
            batch = runs[start:start + jobs]
            procs = [subprocess.Popen(command(p, n, [*extra, "--samples", "1", "--new_tokens", "16"],
                                              os.path.join(tmp, f"{p}-{n}.json")),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for p, n in batch]
            for (p, n), proc in zip(batch, procs):
                err = proc.communicate()[1]
                if proc.returncode != 0:
                    sys.stderr.write(f"\n## warm-up {p} {n} failed:\n{err[-2000:]}")


def run_variant(preset: str, name: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = command(preset, name, extra, out)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(f"\n## {preset} {name}: {' '.join(cmd[3:])}\n{proc.stdout}")
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(proc.stderr[-3000:])
            return {}
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def row(name: str, r: dict) -> str:
    if not r:
        return f"| {name} | failed | | | |"
    d = r["decode"]
    long = "; ".join(f"{c['prompt_tokens']}: {c['tokens_per_s']:.1f} ({c['fraction_of_ceiling']:.3f})"
                     for c in r["long_context"])
    peer = f"{r['ratio_vs_hf_decode']:.2f}x" if "ratio_vs_hf_decode" in r else ""
    return (f"| {name} | {d['tokens_per_s']:.1f} ({d['min']:.1f}-{d['max']:.1f}) | "
            f"{d['fraction_of_ceiling']:.3f} of {r['read_ceiling_gb_s']:.0f} GB/s | {long} | {peer} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="llama-3.1-8b", help="comma-separated presets.py names")
    parser.add_argument("--warm", action="store_true", help="first run everything, --jobs at once, to fill the caches")
    parser.add_argument("--jobs", type=int, default=8, help="--warm's runs at once")
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variant names")
    parser.add_argument("extra", nargs="*", help="flags added to every bench (after --)")
    opts = parser.parse_args()
    names = opts.only.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    runs = [(preset, name) for preset in opts.presets.split(",") for name in names]
    if opts.warm:
        warm(runs, opts.extra, opts.jobs)
    rows = [row(f"{preset} {name}", run_variant(preset, name, opts.extra)) for preset, name in runs]
    print("| variant | decode tok/s | fraction of read ceiling | cached tokens: tok/s (fraction) | vs transformers |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
