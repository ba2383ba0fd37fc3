"""How long the commands users run take to start: `brisk generate` to its
first sample, and `brisk chat` to its first reply (a message piped in), each
in a fresh process, first with the compiler's caches empty (cold), then
filled (warm), timing each stage from the lines the command logs.

    PYTHONPATH=. python3 benchmarks/start.py [--checkpoint_path model.gguf] [--device cuda] [--warm_runs 2] [--json out.json]

Any other arguments go to both commands (e.g. --preset llama-3.1-8b
--quantize int8). "ready" is the time of the line after which the command
generates ("Ready in", or the load's line where nothing is prepared); "first"
the line that reports the first sample or reply (8 new tokens after it);
"exit" the time from the last line to the process's end.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

COMMANDS = {
    "generate": (["generate", "--prompt", "The capital of France is", "--max_new_tokens", "8"], None,
                 re.compile(r"Sample 1: ")),
    "chat": (["chat", "--max_new_tokens", "8"], "Hi\n/exit\n", re.compile(r"\[\d+ tokens, [\d.]+ tokens/s")),
}


def timed_run(argv: list[str], stdin: str | None, first: re.Pattern, env: dict) -> dict:
    """One process: the seconds from its start to each stage's line."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "brisklm", *argv], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines, out = [], []

    def read(stream, into):
        for line in stream:
            into.append((time.perf_counter() - t0, line.rstrip()))

    readers = [threading.Thread(target=read, args=(proc.stderr, lines)),
               threading.Thread(target=read, args=(proc.stdout, out))]
    for reader in readers:
        reader.start()
    proc.stdin.write(stdin or "")
    proc.stdin.close()
    proc.wait()
    for reader in readers:
        reader.join()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed: " + "\n".join(line for _, line in lines[-5:]))
    at = lambda pattern: next((t for t, line in lines if re.search(pattern, line)), None)  # noqa: E731
    stages = {m.group(1): float(m.group(2)) for _, line in lines
              for m in [re.match(r"^(Loaded|Ready) in ([\d.]+) s", line)] if m}
    last = max(t for t, _ in lines + out)
    return {"import_to_load_s": lines[0][0] if lines else None, "load_s": stages.get("Loaded"), "warm_up_s": stages.get("Ready"),
            "ready_s": at(r"^Ready in") or at(r"^Loaded in"), "first_s": at(first.pattern),
            "exit_s": wall - last, "process_s": wall}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warm_runs", type=int, default=2)
    p.add_argument("--commands", default="generate,chat")
    p.add_argument("--json")
    opts, rest = p.parse_known_args()
    results = []
    with tempfile.TemporaryDirectory() as caches:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
        print("| command | caches | import s | load s | warm-up s | ready s | first s | exit s | process s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for i, name in enumerate(opts.commands.split(",")):
            argv, stdin, first = COMMANDS[name]
            for run in range(opts.warm_runs + (1 if i == 0 else 0)):
                cold = i == 0 and run == 0
                r = {"command": name, "caches": "cold" if cold else "warm",
                     **timed_run([*argv, *rest], stdin, first, env)}
                results.append(r)
                cells = [f"{r[k]:.1f}" if r[k] is not None else "" for k in
                         ("import_to_load_s", "load_s", "warm_up_s", "ready_s", "first_s", "exit_s", "process_s")]
                print(f"| {name} | {r['caches']} | " + " | ".join(cells) + " |", flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
