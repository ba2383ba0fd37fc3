"""Every published decode variant in one call: one `brisk bench` process per
variant (fresh memory and compiled state each), then one summary table.

    PYTHONPATH=. python3 benchmarks/gpu_suite.py [--only bf16,int8] [-- extra bench flags]

Each variant's full markdown goes to stderr as it finishes; the table comes
last on stdout, ready for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

BASE = ["--preset", "llama-3.1-8b", "--device", "cuda", "--compile", "--samples", "3", "--prefill", ""]
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


def run_variant(name: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "brisklm", "bench", *BASE, *VARIANTS[name], *extra, "--json", out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(f"\n## {name}: {' '.join(cmd[3:])}\n{proc.stdout}")
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
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variant names")
    parser.add_argument("extra", nargs="*", help="flags added to every bench (after --)")
    opts = parser.parse_args()
    names = opts.only.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    rows = [row(name, run_variant(name, opts.extra)) for name in names]
    print("| variant | decode tok/s | fraction of read ceiling | cached tokens: tok/s (fraction) | vs transformers |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
