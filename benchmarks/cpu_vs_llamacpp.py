"""CPU decode speed of brisk-lm's weight formats against llama.cpp, side by side,
on the same GGUF file with the same number of threads.

    PYTHONPATH=. python3 benchmarks/cpu_vs_llamacpp.py [--gguf FILE] [--threads 2]
        [--llamacpp-python PYTHON] [--modes gguf,int8,int4,none] [--no-compile]

llama.cpp runs through llama-cpp-python, which is not a dependency: build it
in a scratch environment (../shared/PEERS.md in the project's workspace says
how) and pass that environment's interpreter with --llamacpp-python. It runs
in a child process; both sides decode greedily, 128 tokens after the same
8-token prompt, best and median of 3 runs after a warm-up, with
`threads` threads (torch.set_num_threads for brisk-lm, n_threads for llama.cpp).
The table printed last is the summary.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

# A prompt whose continuation is near-certain: with a weak one (say "The
# history of Paris is") the top two tokens can lie within 0.1% and llama.cpp's
# 8-bit activations pick the other one, so the token comparison says nothing.
PROMPT = "One, two, three, four, five, six, seven, eight, nine, ten"
NEW_TOKENS = 128

LLAMACPP = r"""
import json, sys, time, numpy as np, llama_cpp
path, threads, ids, new = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
def run():
    llm.reset()
    llm.eval(ids)
    t0, out = time.perf_counter(), []
    for _ in range(new):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        out.append(int(logits.argmax()))
        llm.eval([out[-1]])
    return new / (time.perf_counter() - t0), out
run()
runs = [run() for _ in range(3)]
print(json.dumps({"rates": [r[0] for r in runs], "tokens": runs[0][1], "version": llama_cpp.__version__}))
"""


def brisk_rates(path, mode, ids, compile_):
    import brisklm
    llm = brisklm.load(path, device="cpu", quantize=mode, compile=compile_, max_seq_length=256, quiet=True)
    llm.wait_compiled()  # (timed: the compiled step, not the one that serves meanwhile)
    run = lambda: list(llm.stream_ids(ids, NEW_TOKENS, stop_ids=()))  # noqa: E731
    t0 = time.time()
    run()  # warm-up (and compilation)
    warm = time.time() - t0
    rates, tokens = [], None
    for _ in range(3):
        tokens = run()
        rates.append(llm.stats.decode_tokens_per_s)
    return rates, tokens, llm.stats.weight_bytes, warm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None, help="default: the bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-python", default=sys.executable)
    ap.add_argument("--modes", default="gguf,int8,int4,none")
    ap.add_argument("--no-compile", action="store_true")
    opts = ap.parse_args()
    import brisklm
    from brisklm.checkpoints.hub import default_model_path
    path = opts.gguf or default_model_path(quiet=True)
    torch.set_num_threads(opts.threads)
    ids = brisklm.load(path, device="cpu", quiet=True).tokenizer.encode(PROMPT)[:8]
    rows = []
    proc = subprocess.run([opts.llamacpp_python, "-c", LLAMACPP, path, str(opts.threads), json.dumps(ids),
                           str(NEW_TOKENS)], capture_output=True, text=True)
    if proc.returncode == 0:
        ref = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append((f"llama.cpp {ref['version']} (the GGUF's own Q4_1/Q8_0 kernels)", ref["rates"], None, None))
        print(f"llama.cpp: {ref['rates']}", flush=True)
    else:
        ref = None
        print("llama.cpp did not run:", proc.stderr.strip().splitlines()[-1:], flush=True)
    for mode in opts.modes.split(","):
        rates, tokens, nbytes, warm = brisk_rates(path, mode, ids, not opts.no_compile)
        same = None if ref is None else next((i for i, (a, b) in enumerate(zip(tokens, ref["tokens"])) if a != b),
                                             NEW_TOKENS)
        rows.append((f"brisk-lm --quantize {mode}" + ("" if opts.no_compile else " --compile"), rates, nbytes, same))
        print(f"{mode}: {rates} (warm-up with compilation {warm:.0f} s)", flush=True)
    print(f"\n{path.rsplit('/', 1)[-1]}, {opts.threads} threads, torch {torch.__version__}, "
          f"{NEW_TOKENS} tokens after an 8-token prompt, greedy")
    print("| engine | decode tok/s (median; best) | weight bytes read per token "
          "| greedy tokens equal to llama.cpp's before the first difference |")
    print("| --- | --- | --- | --- |")
    for name, rates, nbytes, same in rows:
        size = f"{nbytes / 1e9:.3f} GB" if nbytes else ""
        same = "" if same is None else f"{same}/{NEW_TOKENS}"
        print(f"| {name} | {statistics.median(rates):.1f}; {max(rates):.1f} | {size} | {same} |")


if __name__ == "__main__":
    main()
