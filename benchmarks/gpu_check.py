"""GPU checks that CI (CPU only) cannot run; prints a short table last.

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--gguf SmolLM2.gguf]

1. the compiled decode step on CUDA (one CUDA graph, the decode attention
   kernel over the filled positions) and the compiled dynamic-shape prefill
   give exactly the greedy tokens of eager decoding, on a tiny fp32 model,
   with prompts that cross the kernel's block boundaries; and eager decoding
   through the kernel gives those of eager decoding through SDPA;
2. `brisk generate --preset llama-3.1-8b --compile` end to end through the CLI;
3. with --gguf: the bundled SmolLM2 on CUDA, compiled, answers "Paris".

Speed figures come from `brisk bench` (brisklm/bench.py), run beside this.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import torch

from brisklm.fusion import fuse_for_decode
from brisklm.generate import Generator
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.sampling import SamplingParams


def check_compiled_equals_eager():
    args = ModelArgs(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    state = random_state_dict(args, torch.float32, device="cuda", std=0.2)
    model, plain = fuse_for_decode(build_model(args, state)), build_model(args, state)
    rows = []
    for prompt_len in (5, 120, 300):
        prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
        eager = list(Generator(model, 512).tokens(prompt, 40, SamplingParams()))
        compiled = list(Generator(model, 512, compile=True, compile_prefill=True)
                        .tokens(prompt, 40, SamplingParams()))
        sdpa = list(Generator(plain, 512).tokens(prompt, 40, SamplingParams()))  # no kernels: SDPA, cuBLAS
        rows.append((prompt_len, eager == compiled, eager == sdpa))
        print(f"prompt {prompt_len}: compiled == eager {eager == compiled}, fused == plain {eager == sdpa}",
              flush=True)
    return rows


def run_cli(args, timeout=900):
    cmd = [sys.executable, "-m", "brisklm", "generate"] + args
    print("$ brisk generate " + " ".join(args), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    print(done.stdout[-1500:], done.stderr[-2500:], sep="\n", flush=True)
    if done.returncode:
        raise SystemExit(f"CLI failed with {done.returncode}")
    rate = float(re.search(r"Average decode: ([\d.]+) tokens/s", done.stderr).group(1))
    comp = re.search(r"Compiled in ([\d.]+) s", done.stderr)
    return rate, float(comp.group(1)) if comp else None, done.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    opts = ap.parse_args()
    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    table = []
    for n, compiled_ok, kernel_ok in check_compiled_equals_eager():
        table += [(f"compiled == eager greedy tokens, prompt {n}", compiled_ok),
                  (f"fused kernels == PyTorch ops (SDPA, cuBLAS) greedy tokens (eager), prompt {n}", kernel_ok)]
    rate, comp, _ = run_cli(["--preset", "llama-3.1-8b", "--device", "cuda", "--compile",
                             "--max_new_tokens", "200", "--num_samples", "3"])
    table.append(("brisk generate --preset llama-3.1-8b --compile: tokens/s, compile s", f"{rate:.1f}, {comp:.1f}"))
    if opts.gguf:
        rate, comp, out = run_cli(["--checkpoint_path", opts.gguf, "--device", "cuda", "--compile",
                                   "--temperature", "0", "--prompt", "The capital of France is",
                                   "--max_new_tokens", "32", "--num_samples", "2"])
        table.append(("SmolLM2 GGUF on CUDA, compiled, says Paris", "Paris" in out))
    print("\n| check | result |\n| --- | --- |")
    for name, value in table:
        print(f"| {name} | {value} |")
    if not all(v for _, v in table if isinstance(v, bool)):
        raise SystemExit("a check failed")


if __name__ == "__main__":
    main()
