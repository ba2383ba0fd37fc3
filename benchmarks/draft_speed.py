"""Speculative decoding with model drafts on a preset's shape (random
weights): what each drafter costs, and the most it can give.

    PYTHONPATH=. python3 benchmarks/draft_speed.py [--preset llama-3.1-8b] [--device cuda] [--tokens 128]

One target (compiled where decoding is), greedy, a 64-token prompt of random
ids, median of --samples runs after a warm-up. Drafters:
  self            the target's first --draft_layers layers
  int4 of itself  the same random weights quantized to int4 (gpt-fast's recipe)
  <draft_preset>  a smaller shape of its own (Llama-3.2-1B by default)
  itself          the target drafting for itself
Each is run as a user runs it (the draft policy chooses how many drafts
pay, from 0 to --draft_tokens, and random weights decide what is kept), and
one speculative step of --draft_tokens drafts is timed alone (the drafts,
the verify forward, reading the target's choices): K + 1 tokens in that time
is the labelled upper bound, every draft kept. (Random weights in bf16 give
near-even logits, whose argmax differs between a one-token step and a
verify step: even the target drafting for itself is rarely kept, so the
bound is timed rather than run.) Prints a table last.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import brisklm
from brisklm.api import drafter as make_drafter
from brisklm.sampling import SamplingParams
from brisklm.speculative import ModelDrafter, accept


def step_ms(gen, d, history: list[int], k: int, reps: int = 10) -> tuple[float, float]:
    """Milliseconds of one speculative step with k drafts at the end of
    history (whose keys the target's cache holds), as the loop runs it: the
    drafts, the verify forward over k + 1 tokens, reading the target's
    choices; and of the drafts alone. Medians over reps after two warm-ups."""
    greedy, here = SamplingParams(), len(history) - 1
    sync = torch.cuda.synchronize if gen.device.type == "cuda" else (lambda: None)
    whole, drafting = [], []
    for rep in range(reps + 2):
        d.kept(here)  # (each time from the same place: the drafts' keys are written again)
        sync()
        t0 = time.perf_counter()
        drafts, _ = d.propose(history, k, greedy, gen.logits)
        sync()
        t1 = time.perf_counter()
        accept(gen.logits([history[-1], *drafts], here)[0], drafts, None, greedy)
        t2 = time.perf_counter()
        if rep >= 2:
            whole.append((t2 - t0) * 1e3)
            drafting.append((t1 - t0) * 1e3)
    return statistics.median(whole), statistics.median(drafting)


def trace():
    """Print every DraftPolicy.update: the step's drafts, what was kept, its milliseconds, the cost table."""
    from brisklm.speculative import DraftPolicy
    update = DraftPolicy.update

    def traced(self, proposed, kept, seconds, steps=1):
        update(self, proposed, kept, seconds, steps)
        costs = {k: round(v * 1e3, 2) for k, v in sorted(self.cost.items())}
        print(f"      drafts {proposed} kept {kept} steps {steps}: {seconds * 1e3 / steps:.2f} ms a step; costs {costs}",
              flush=True)
    DraftPolicy.update = traced


def timed_runs(gen, ids, tokens, samples, drafter=None, k=4, adapt=True):
    """(median tokens/s, median tokens per target step, the tokens) over samples runs after a warm-up."""
    rates, steps, out = [], [], None
    for run in range(samples + 1):
        gen.reset()
        t0 = time.perf_counter()
        out = list(gen.tokens(ids, tokens, SamplingParams(), (), None, drafter, k, adapt_drafts=adapt))
        if run == 0:
            print(f"    warm-up run: {time.perf_counter() - t0:.1f} s", flush=True)
        else:
            rates.append(gen.stats.decode_tokens_per_s)
            steps.append(gen.stats.tokens_per_step or 1.0)
    return statistics.median(rates), statistics.median(steps), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--draft_tokens", type=int, default=4)
    ap.add_argument("--draft_layers", type=int, default=None, help="self: default a quarter of the layers")
    ap.add_argument("--draft_preset", default="llama-3.2-1b")
    ap.add_argument("--max_seq_length", type=int, default=4096)
    ap.add_argument("--only", default="self,int4,preset,itself", help="which drafters, comma-separated")
    ap.add_argument("--trace", action="store_true", help="print each speculative step: drafts asked, found, "
                    "kept, its time, and the policy's costs")
    opts = ap.parse_args()
    if opts.trace:
        trace()
    torch._dynamo.config.recompile_limit = 16  # (the compiled draft step: once for each drafter's model)
    load = dict(device=opts.device, max_seq_length=opts.max_seq_length, quiet=False)
    llm = brisklm.load(preset=opts.preset, **load)
    llm.wait_compiled()  # (timed: the compiled step, not the one that serves meanwhile)
    gen, k = llm.generator, opts.draft_tokens
    ids = torch.randint(0, llm.model.args.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    t0 = time.perf_counter()
    print("plain decoding", flush=True)
    plain, _, reference = timed_runs(gen, ids, opts.tokens, opts.samples)
    reference = ids + reference
    print(f"  {plain:.1f} tok/s ({time.perf_counter() - t0:.0f} s so far)", flush=True)
    drafters = {}
    wanted = opts.only.split(",")
    if "self" in wanted:
        d = make_drafter(llm.model, "self", k, opts.draft_layers)
        drafters[f"self, {d.depth} of {llm.model.args.num_hidden_layers} layers"] = lambda d=d: d
    if "int4" in wanted:
        drafters["int4 of itself"] = lambda: ModelDrafter(brisklm.load(preset=opts.preset, quantize="int4",
                                                                       compile=False, **load).model)
    if "preset" in wanted:
        drafters[opts.draft_preset] = lambda: ModelDrafter(brisklm.load(preset=opts.draft_preset, compile=False,
                                                                        **load).model)
    if "itself" in wanted:
        drafters["itself"] = lambda: ModelDrafter(llm.model)
    rows = []
    for name, make in drafters.items():
        print(f"drafter: {name}", flush=True)
        d = make()
        llm.warm_speculative(ids, d, k)
        rate, per_step, out = timed_runs(gen, ids, opts.tokens, opts.samples, d, k)
        same = out == reference[len(ids):]
        whole, drafting = step_ms(gen, d, reference[:-1], k)
        bound = (k + 1) * 1e3 / whole
        rows.append((name, rate, per_step, same, drafting / k, whole, bound))
        print(f"  {rate:.1f} tok/s ({per_step:.2f} a step); a step of {k} drafts {whole:.2f} ms (drafting "
              f"{drafting:.2f}): every draft kept, {bound:.1f} tok/s ({time.perf_counter() - t0:.0f} s so far)",
              flush=True)
        del d
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if opts.device == "cuda" else opts.device
    print(f"\n{opts.preset}, bf16, on {device}, torch {torch.__version__}, greedy, {opts.tokens} tokens after "
          f"64 random ids, up to {k} drafts a step; plain decoding {plain:.1f} tok/s")
    print(f"| drafter | tok/s as run | speed-up | tokens a target step | output equals plain | a draft step, ms "
          f"| a step of {k} drafts, ms | every draft kept: tok/s | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, rate, per_step, same, draft_ms, whole, bound in rows:
        print(f"| {name} | {rate:.1f} | {rate / plain:.2f}x | {per_step:.2f} | {same} | {draft_ms:.2f} | {whole:.2f} "
              f"| {bound:.1f} | {bound / plain:.2f}x |")

if __name__ == "__main__":
    main()
