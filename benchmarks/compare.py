"""Decode speed of several git revisions side by side, in one device call.

    python3 benchmarks/compare.py prepare main my-branch ...   # here: a copy of each under .variants/
    python3 benchmarks/compare.py prepare main main:main-2     # REV:NAME, a second copy of one revision
    python3 benchmarks/compare.py run [--only a,b] [--sweep int8] [-- --quantize int8 ...]   # on the GPU
    python3 benchmarks/compare.py run --each '--quantize int8' --each '--quantize int4'   # several configurations

`prepare` writes each revision's files (git archive) to .variants/<name>
(its tuned GEMV table completed by this checkout's), a folder to carry to the
device.
`run` benches every variant found there: first all at once to fill the
compiler caches (compiling in parallel), then one after another, alone on
the GPU, timed; each configuration twice, in alternating order, so a drift
of the machine shows. Then each variant decodes 32 tokens greedily with
`brisk generate` (same seeded random weights, the first configuration):
variants that change no arithmetic must give the same token ids. Prints a
table per configuration last. Carry .variants to the device.

Plan the device call's length: on an H200 (8B preset) each bench process
takes about 35 s, so configurations x variants x 2 passes x 35 s, plus about
60 s of parallel compiling and 10 s a variant for the greedy ids (four
configurations of two variants did not fit in 600 s).

With --picks, $OUT/1-picks.md lists the block sizes inductor kept for each
kernel it timed at the first run, per variant: to tell which picks make a
fast compile (prepare several copies of one revision under other names).

Each figure is also appended to $OUT/0-summary.md as it is measured (the
logs stay in a temporary folder; the device returns only a few files), so a
run cut short by the time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = os.path.join(ROOT, ".variants")
BENCH = ["-m", "brisklm", "bench", "--preset", "llama-3.1-8b", "--device", "cuda", "--compile",
         "--samples", "3", "--prefill", "", "--context", ""]


def merge_tuned(ours: str, theirs: str):
    """The variant's tuned GEMV table, with this checkout's entries where it has none."""
    if not os.path.exists(ours):
        return
    with open(ours) as f:
        table = json.load(f)
    if os.path.exists(theirs):
        with open(theirs) as f:
            for device, entries in json.load(f).items():
                table.setdefault(device, {}).update(entries)
    with open(theirs, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)


def prepare(refs: list[str]):
    os.makedirs(VARIANTS, exist_ok=True)
    for ref in refs:
        ref, _, name = ref.partition(":")  # REV:NAME, e.g. main:main-2 for a second copy of main
        dest = os.path.join(VARIANTS, (name or ref).replace("/", "_"))
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        archive = subprocess.run(["git", "-C", ROOT, "archive", ref], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
        merge_tuned(os.path.join(ROOT, "brisklm", "kernels", "gemv_tuned.json"),
                    os.path.join(dest, "brisklm", "kernels", "gemv_tuned.json"))
        print(f"{ref} -> {os.path.relpath(dest, ROOT)}")


def in_variant(name: str) -> dict:
    """Where a variant's commands run: its folder, its brisklm first on the path."""
    cwd = os.path.join(VARIANTS, name)
    # Its own compiler cache: a cached graph of another variant can match this
    # one's trace while its kernels' output shapes (tuned split-K) differ.
    cache = os.path.join(tempfile.gettempdir(), "compare-cache", name)
    return {"cwd": cwd, "env": dict(os.environ, PYTHONPATH=cwd, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=cache)}


def bench(name: str, extra: list[str], log: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *BENCH, *extra], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            **in_variant(name))


GENERATE = ["-m", "brisklm", "generate", "--preset", "llama-3.1-8b", "--device", "cuda", "--compile",
            "--max_new_tokens", "32", "--temperature", "0", "--quiet"]
SHARED = {"--quantize": 1, "--groupsize": 1, "--kv_int8": 0, "--compile_options": 1, "--dtype": 1,  # with values
          "--preset": 1, "--device": 1}


def generate_args(extra: list[str]) -> list[str]:
    """The bench arguments that `brisk generate` takes too."""
    out, i = [], 0
    while i < len(extra):
        n = SHARED.get(extra[i])
        if n is not None:
            out += extra[i:i + 1 + n]
        i += 1 + (n or 0)
    return out


def token_ids(name: str, extra: list[str]) -> str:
    done = subprocess.run([sys.executable, *GENERATE, *generate_args(extra)], capture_output=True, text=True,
                          **in_variant(name))
    return done.stdout.strip() if done.returncode == 0 else "failed: " + done.stderr.strip()[-80:]


def decode_rate(log: str) -> str:
    """tokens/s, with the fraction of the read ceiling measured in the same process."""
    text = open(log).read()
    m = re.search(r"decode tokens/s [^|]*\| ([\d.]+)", text)
    if not m:
        return "failed: " + text.strip().splitlines()[-1][:80]
    f = re.search(r"fraction of the read ceiling \| ([\d.]+)", text)
    return m.group(1) + (f" ({f.group(1)})" if f else "")


def autotune_picks(name: str) -> list[str]:
    """The block sizes inductor kept for each kernel it timed at the first run
    (the .best_config files of the variant's compiler cache): the int4 step's
    speed depends on those picks (the journal, 2026-12-01)."""
    cache = in_variant(name)["env"]["TORCHINDUCTOR_CACHE_DIR"]
    rows = []
    for folder, _, files in os.walk(cache):
        for f in files:
            if not f.endswith(".best_config"):
                continue
            with open(os.path.join(folder, f)) as fh:
                pick = json.load(fh)
            source = os.path.join(folder, f[:-len(".best_config")] + ".py")
            text = open(source).read() if os.path.exists(source) else ""
            kernel = re.search(r"def (triton_\w+)\(", text)
            hints = re.search(r"size_hints=(\{[^}]*\})", text)
            blocks = ", ".join(f"{k} {v}" for k, v in sorted(pick.items()) if k.isupper() or k == "num_warps")
            rows.append(f"| {kernel.group(1) if kernel else f} | {hints.group(1) if hints else ''} | {blocks} |")
    return sorted(rows)


def run(configs: list[list[str]], only: str | None = None, sweep: str | None = None, picks: bool = False):
    """configs: one list of extra `brisk bench` arguments per configuration
    (e.g. int8, then int4), each benched for every variant."""
    names = sorted(n for n in os.listdir(VARIANTS) if os.path.isdir(os.path.join(VARIANTS, n))) \
        if os.path.isdir(VARIANTS) else []
    if only:
        names = [n for n in only.split(",") if n in names]  # in the order given: the first is the reference
    if not names:
        sys.exit("no variants: run `compare.py prepare REV ...` first and carry .variants")
    out = tempfile.mkdtemp(prefix="compare-logs-")
    summary = os.path.join(os.environ.get("OUT", out), "0-summary.md")

    def note(line: str):
        print(line, flush=True)
        with open(summary, "a") as f:
            f.write(line + "\n")

    t0 = time.time()
    if sweep:  # each variant's GEMV blocks tuned on this machine first, written into its table
        for n in names:
            cmd = [sys.executable, "benchmarks/gemv_sweep.py", "--kinds", sweep, "--check", sweep, "--write"]
            done = subprocess.run(cmd, capture_output=True, text=True, **in_variant(n))
            with open(os.path.join(out, f"{n}.sweep.log"), "w") as f:
                f.write(done.stdout + done.stderr)
            note(f"{n}: swept {sweep}" + ("" if done.returncode == 0 else " (failed: " + done.stderr[-300:] + ")"))
    warm = [bench(n, extra, os.path.join(out, f"{n}.c{c}.compile.log"))
            for c, extra in enumerate(configs) for n in names]
    for p in warm:
        p.wait()
    note(f"compiled all in {time.time() - t0:.0f} s")
    tables = []
    for c, extra in enumerate(configs):
        rates = {n: [] for n in names}
        for order in (names, names[::-1]):
            for n in order:
                log = os.path.join(out, f"{n}.c{c}.{len(rates[n])}.log")
                bench(n, extra, log).wait()
                rates[n].append(decode_rate(log))
                note(f"{n} {shlex.join(extra)}: {rates[n][-1]}")
        ids = {n: token_ids(n, extra) for n in names} if c == 0 else {}  # the first configuration's only
        for n in ids:  # noted now: a call cut short by its time limit keeps them
            note(f"{n} greedy ids: " + ("same as " + names[0] if n != names[0] and ids[n] == ids[names[0]]
                                        else ids[n][:60]))
        lines = [f"\nbrisk bench {shlex.join(BENCH[3:] + extra)}",
                 "| variant | decode tok/s (fraction of the read ceiling), first pass | second pass "
                 "| greedy token ids (32) |",
                 "| --- | --- | --- | --- |"]
        for n in names:
            got = ids.get(n, "(not run)")
            ok = not got.startswith(("failed", "(")) and n != names[0] and got == ids[names[0]]
            lines.append(f"| {n} | {' | '.join(rates[n])} | {'same as ' + names[0] if ok else got[:60]} |")
        tables.append("\n".join(lines))
    note(f"\n{time.time() - t0:.0f} s in all" + "".join(tables))
    if picks:
        with open(os.path.join(os.environ.get("OUT", out), "1-picks.md"), "w") as f:
            for n in names:
                f.write(f"\n## {n}\n\n| kernel | size hints | kept |\n| --- | --- | --- |\n")
                f.write("\n".join(autotune_picks(n)) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["prepare", "run"])
    ap.add_argument("args", nargs="*", help="prepare: git revisions; run (after --): more `brisk bench` arguments")
    ap.add_argument("--only", help="run: the variants to bench, comma-separated, the reference first (default: all)")
    ap.add_argument("--sweep", help="run: gemv_sweep.py these kinds (e.g. int8,int4-g128) in each variant first")
    ap.add_argument("--picks", action="store_true",
                    help="run: write each variant's autotuned kernel blocks (inductor's .best_config) to 1-picks.md")
    ap.add_argument("--each", action="append", metavar="ARGS",
                    help="run: one configuration's `brisk bench` arguments, quoted (repeat for several, e.g. "
                         "--each '--quantize int8' --each '--quantize int4'); default: the arguments after --")
    args = ap.parse_intermixed_args()
    if args.command == "prepare":
        prepare(args.args)
    else:
        run([shlex.split(e) for e in args.each] if args.each else [args.args], args.only, args.sweep, args.picks)


if __name__ == "__main__":
    main()
