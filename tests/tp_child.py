"""One rank of tests/test_tp.py's tensor-parallel runs (under torchrun, gloo).

    torchrun --standalone --nproc_per_node=N tests/tp_child.py OUT.json [--compile]

For every case of CASES: this rank's share of the seeded random weights
(quantized whole, then sliced, as loading.load does), prompt logits, 12 greedy
tokens and the bytes of the rank's weights; rank 0 writes them all to OUT.json.
The dense case also decodes speculatively (prompt lookup, the first layer as
a draft), which must give its plain tokens.
Run with N = 1 (no torchrun needed) it gives the single-process reference."""
import json
import os
import sys

import torch
import torch.distributed as dist

from brisklm.generate import Generator
from brisklm.model import ModelArgs, build_model, random_state_dict
from brisklm.quantize import FORMATS
from brisklm.quantize import quantizer
from brisklm.sampling import SamplingParams
from brisklm.speculative import ModelDrafter, NgramDrafter
from brisklm import tp

DENSE = dict(vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=16, max_position_embeddings=128, attention_bias=True)
CASES = {"dense": (DENSE, "none"), "dense-int8": (DENSE, "int8"), "dense-int4": (DENSE, "int4"),
         "moe": ({**DENSE, "num_local_experts": 4, "num_experts_per_tok": 2, "attention_bias": False}, "none"),
         "moe-int4": ({**DENSE, "num_local_experts": 4, "num_experts_per_tok": 2, "attention_bias": False}, "int4")}


def weight_bytes(model):
    seen = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "kv_cache" not in name and not name.startswith("rope_"):
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def main():
    out, compiled = sys.argv[1], "--compile" in sys.argv
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    results = {}
    for case, (config, mode) in CASES.items():
        if compiled and case != "moe":  # (its step holds every all-reduce the dense ones do, and the router's)
            continue
        args = ModelArgs(**config)
        inner = quantizer(mode, 32) if mode != "none" else None
        transform = tp.sharder(rank, world, inner) if world > 1 else inner
        state = random_state_dict(args, torch.float32, seed=0, std=0.2, transform=transform)
        model = build_model(tp.local_args(args, world), state, FORMATS)
        if world > 1:
            tp.parallelize(model, dist.group.WORLD)
        ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
        model.setup_caches(1, 64)
        with torch.no_grad():
            logits = model(ids, torch.arange(6), kv_len=6)[0, -3:]
        gen = Generator(model, 64, compile=compiled)
        tokens = list(gen.tokens([3, 14, 15, 9, 26, 5], 12, SamplingParams()))
        if case == "dense" and not compiled:  # speculative, the policy adapting: the same drafts on every rank
            prompt = [3, 14, 15, 9, 26, 5] * 3
            plain = list(gen.tokens(prompt, 16, SamplingParams()))
            for drafter in (NgramDrafter(), ModelDrafter(model, depth=1)):
                spec = list(gen.tokens(prompt, 16, SamplingParams(), drafter=drafter, draft_tokens=3))
                assert spec == plain, (type(drafter).__name__, spec, plain)
        if case == "dense" and not compiled and world > 1:  # sampled with no seed: each rank's own random
            torch.manual_seed(rank)  # numbers differ, the ranks must sample the same tokens anyway
            sampled = [None] * world
            dist.all_gather_object(sampled, list(gen.tokens([3, 14, 15], 12, SamplingParams(temperature=1.0))))
            results["unseeded samples agree"] = all(s == sampled[0] for s in sampled)
        sizes = [weight_bytes(model)]
        if world > 1:
            sizes = [None] * world
            dist.all_gather_object(sizes, weight_bytes(model))
        results[case] = {"logits": logits.tolist(), "tokens": tokens, "bytes": sizes}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    if world > 1:  # (then an exit without the interpreter's teardown, as brisk's CLI ends: there gloo's
        dist.barrier()  # threads abort a rank now and then, "terminate called without an active exception")
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
