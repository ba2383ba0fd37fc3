"""Decode speed through each way the decode step can be compiled, each run in
a fresh process with its own empty compiler cache.

    PYTHONPATH=. python3 benchmarks/precompile_paths.py [-- extra `brisk bench` arguments]

  saved:      the default: traced and compiled, saved (precompile.py) after
              the first step;
  loaded:     a second process on the same cache: the saved step loaded back;
  plain:      BRISKLM_PRECOMPILE=0, a plain torch.compile;
  save-fails: torch.compiler.save_cache_artifacts raises, as when torch's
              experimental precompile fails. precompile.py then compiles
              plainly after the first step and leaves a marker;
  marked:     a second process on that cache, which finds the marker and
              compiles plainly from the start.

Why: on one warm H200, int4 decoded at 489-493 tokens/s in runs whose cache
held such markers, and at 554-558 in fresh caches (benchmarks/RESULTS.md,
eighth session). Prints a table last.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

BENCH = ["--preset", "llama-3.1-8b", "--device", "cuda", "--compile", "--samples", "3", "--prefill", "",
         "--context", "", "--quantize", "int4", "--groupsize", "128"]
FAILING_SAVE = ("import runpy, sys, torch\n"
                "torch.compiler.save_cache_artifacts = lambda: 1 / 0\n"
                "sys.argv[0] = 'brisk'\n"
                "runpy.run_module('brisklm', run_name='__main__')\n")


def decode_rate(text: str) -> str:
    m = re.search(r"decode tokens/s [^|]*\| ([\d.]+ \(min [\d.]+, max [\d.]+\))", text)
    return m.group(1) if m else "failed: " + (text.strip().splitlines() or [""])[-1][:100]


def bench(args: list[str], cache: str, env: dict | None = None, failing_save=False) -> str:
    run = [sys.executable, "-c", FAILING_SAVE] if failing_save else [sys.executable, "-m", "brisklm"]
    done = subprocess.run([*run, "bench", *args], capture_output=True, text=True,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, **(env or {})})
    folder = os.path.join(cache, "brisklm")
    files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    kinds = ", ".join(f.split("-")[0] + f[f.index("."):] for f in files)  # e.g. decode.bin.broken
    return f"{decode_rate(done.stdout + done.stderr)} | {kinds}"


def main():
    args = BENCH + sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else BENCH
    rows = []
    with tempfile.TemporaryDirectory() as root:
        caches = {name: os.path.join(root, name) for name in ("saved", "plain", "failing")}
        for name, cache, env, failing in (("saved", caches["saved"], None, False),
                                          ("loaded", caches["saved"], None, False),
                                          ("plain", caches["plain"], {"BRISKLM_PRECOMPILE": "0"}, False),
                                          ("save-fails", caches["failing"], None, True),
                                          ("marked", caches["failing"], None, False)):
            rows.append(f"| {name} | {bench(args, cache, env, failing)} |")
            print(rows[-1], flush=True)
    print(f"\nbrisk bench {' '.join(repr(a) if a == '' else a for a in args)}")
    print("| path | decode tok/s (median, min-max) | files in the cache's brisklm folder |")
    print("| --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
