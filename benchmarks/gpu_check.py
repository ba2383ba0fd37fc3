"""GPU checks that CI (CPU only) cannot run; prints a short table last.

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--gguf SmolLM2.gguf]

1. the compiled decode step on CUDA (one CUDA graph, the decode attention
   kernel over the filled positions) and the compiled dynamic-shape prefill
   give exactly the greedy tokens of eager decoding, on a tiny fp32 model,
   with prompts that cross the kernel's block boundaries; and eager decoding
   through the kernel gives those of eager decoding through SDPA;
2. speculative decoding, compiled (the verify step over padded rows with flex
   attention, the one-token draft steps; plain steps between them queued
   ahead), gives the plain greedy tokens for prompt lookup and self-drafting,
   on the same model;
3. an MoE layer's one-token step with its chosen experts read in place
   (fusion.FusedLinear.expert_forward, gemv.expert_gemv), and a short prompt's
   16 rows, each expert with its own tokens' rows (w13 of all experts in one
   launch: FusedLinear.experts_forward), eager and compiled, against the experts' own
   modules, in bf16 with int8, int4, Q8_0 and bf16 experts;
4. `brisk generate --preset llama-3.1-8b --compile` end to end through the CLI;
5. with --gguf: the bundled SmolLM2 on CUDA, compiled, answers "Paris".

Speed figures come from `brisk bench` (brisklm/bench.py), run beside this.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import torch

from brisklm.fusion import fuse_for_decode
from brisklm.kernels import gemv
from brisklm.generate import Generator
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.quantize import FORMATS
from brisklm.sampling import SamplingParams

gemv.traced_as_constants()  # (this script compiles our modules itself, as load() does)


def check_compiled_equals_eager():
    args = ModelArgs(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    state = random_state_dict(args, torch.float32, device="cuda", std=0.2)
    model, plain = fuse_for_decode(build_model(args, state, FORMATS)), build_model(args, state, FORMATS)
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


DEVICE = "cuda"  # (the checks below also run on a CPU under TRITON_INTERPRET=1, slowly)


def check_speculative_compiled():
    from brisklm.speculative import ModelDrafter, NgramDrafter
    args = ModelArgs(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    state = random_state_dict(args, torch.float32, device=DEVICE, std=0.2)
    plain = Generator(fuse_for_decode(build_model(args, state, FORMATS)), 512)
    spec = Generator(fuse_for_decode(build_model(args, state, FORMATS)), 512, compile=True)
    rows = []
    for kind, drafter in (("ngram", NgramDrafter()), ("self", ModelDrafter(spec.model, depth=2))):
        for prompt_len in (7, 130):  # (the second crosses a block of the verify step's mask)
            prompt = [5, 6, 7, 8] * (prompt_len // 4) + [5] * (prompt_len % 4)
            want = list(plain.tokens(prompt, 60, SamplingParams()))
            got = list(spec.tokens(prompt, 60, SamplingParams(), drafter=drafter, draft_tokens=4))
            rows.append((kind, prompt_len, got == want, spec.stats.tokens_per_step))
            print(f"speculative {kind}, prompt {prompt_len}: equal {got == want}, "
                  f"{spec.stats.tokens_per_step:.2f} tokens a step", flush=True)
    return rows


def check_experts_in_place():
    from brisklm.fusion import FusedLinear
    from brisklm.quantize import quantize_state_dict
    args = ModelArgs(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                     num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    rows = []
    for mode in ("int8", "int4", "q8_0", "bf16"):
        state = random_state_dict(args, torch.bfloat16, device=DEVICE, std=0.05)
        if mode != "bf16":
            args_q, state = quantize_state_dict(args, state, mode, 128)
        model = fuse_for_decode(build_model(args if mode == "bf16" else args_q, state, FORMATS))
        model.setup_caches(1, 16)
        model.prepare()
        ffn = model.layers[0].feed_forward
        assert isinstance(ffn.experts[0].w13, FusedLinear)
        for way, m in (("by_slot", 1), ("by_expert_rows", 16)):
            x = torch.randn(m, 512, device=DEVICE, dtype=torch.bfloat16)
            weights, chosen = ffn.route(x)
            with torch.no_grad():
                want = ffn.by_expert(x, weights, chosen)
                eager = getattr(ffn, way)(x, weights, chosen)
                compiled = torch.compile(getattr(ffn, way), fullgraph=True, dynamic=False)(x, weights, chosen)
            errs = [((y - want).norm() / want.norm()).item() for y in (eager, compiled)]
            rows.append((f"{mode}, {way}", max(errs)))
            print(f"experts {way}, {mode}: relative error eager {errs[0]:.1e}, compiled {errs[1]:.1e}", flush=True)
    return rows


def run_cli(args, timeout=900):
    cmd = [sys.executable, "-m", "brisklm", "generate"] + args
    print("$ brisk generate " + " ".join(args), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    print(done.stdout[-1500:], done.stderr[-2500:], sep="\n", flush=True)
    if done.returncode:
        raise SystemExit(f"CLI failed with {done.returncode}")
    rate = float(re.search(r"Average decode: ([\d.]+) tokens/s", done.stderr).group(1))
    comp = re.search(r"(?:[Cc]ompiled in |compiled (?:decode )?step is ready \()([\d.]+) s", done.stderr)
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
    for kind, n, equal, per_step in check_speculative_compiled():
        table.append((f"speculative {kind}, compiled, == plain greedy tokens, prompt {n} "
                      f"({per_step:.2f} tokens a step)", equal))
    for mode, err in check_experts_in_place():
        table.append((f"MoE experts ({mode}) vs their modules, relative error {err:.1e} < 2e-2",
                      err < 2e-2))
    rate, comp, _ = run_cli(["--preset", "llama-3.1-8b", "--device", "cuda", "--compile",
                             "--max_new_tokens", "200", "--num_samples", "3"])
    table.append(("brisk generate --preset llama-3.1-8b --compile: tokens/s, compile s (waited for)",
                  f"{rate:.1f}, {comp if comp is None else round(comp, 1)}"))
    table.append(("brisk generate --compile decoded on the compiled step (said its compile's time)", comp is not None))
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
