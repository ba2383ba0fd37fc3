"""Do GEMV programs of one or two warps beat the tuned table? A focused sweep.

    PYTHONPATH=. python3 benchmarks/warps_sweep.py [--kind int4-g128] [--write] [--budget 120]

The dp4a kernels' main loop holds layout conversions of x's planes through
shared memory: at 4 warps each pass waits on 14 barriers (int4) or 6 (int8)
(sm_90 SASS, benchmarks/gemv_sass.py); a one-warp program needs 5 and 0 and
runs about the same instructions per code. gemv_sweep.py's candidates have 4
or 8 warps. This times, for each Llama-3.1-8B shape, the tabled config
against nearby blocks at 1 and 2 warps (same split-K), and
with --write stores the winners in the tuned table.
"""
from __future__ import annotations

import argparse
import time

from benchmarks.gemv_sweep import model_shapes, sweep, width_key, write_table
from brisklm.kernels import gemv
from brisklm.presets import preset

SMALL_WARPS = [(16, 1024, 1), (16, 512, 1), (16, 1024, 2), (32, 1024, 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="int4-g128")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--budget", type=float, default=120, help="seconds; shapes left after it keep their entry")
    opts = ap.parse_args()
    bits, start, table = width_key(opts.kind), time.time(), {}
    print("| matrix | N x K | tabled config | us | best config | us |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (n, k) in model_shapes(preset("llama-3.1-8b")).items():
        if time.time() - start > opts.budget:
            break
        key = f"{bits}:{n}:{k}"
        tabled = tuple(gemv.tuned()[key]["config"])
        base = sweep(opts.kind, n, k, [tabled])
        best = sweep(opts.kind, n, k, [tabled] + [(bn, bk, tabled[2], wp) for bn, bk, wp in SMALL_WARPS])
        print(f"| {name} | {n}x{k} | {tabled} | {base['us']:.2f} | {tuple(best['config'])} | {best['us']:.2f} |",
              flush=True)
        table[key] = {"config": best["config"], "us": round(best["us"], 2)}
    if opts.write:
        write_table(table)


if __name__ == "__main__":
    main()
