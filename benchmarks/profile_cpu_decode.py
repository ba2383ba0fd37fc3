"""Where a compiled CPU decode step's time goes: torch.profiler over 32 greedy
steps of a model (default: the bundled SmolLM2 GGUF), inductor's own C++
kernels timed one by one (cpp.enable_kernel_profile).

    PYTHONPATH=. python3 benchmarks/profile_cpu_decode.py [--checkpoint_path P] [--threads 2]
"""
import argparse

import torch

import brisklm
from brisklm.sampling import SamplingParams


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_path", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    llm = brisklm.load(opts.checkpoint_path, device="cpu", compile=True,
                       compile_options={"cpp.enable_kernel_profile": True})
    gen = llm.generator
    ids = llm.tokenizer.encode("Once upon a time")
    for _ in range(2):  # compile, then warm
        list(gen.tokens(ids, 64, SamplingParams()))
    print(f"decode tokens/s: {gen.stats.decode_tokens_per_s:.1f}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        list(gen.tokens(ids, 33, SamplingParams()))  # the prefill and 32 steps
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=opts.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
