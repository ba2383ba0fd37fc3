"""Tensor parallelism: one model over N processes (torchrun), each holding 1/N
of every layer's weights (Megatron-LM's split, Shoeybi et al. 2019).

Each rank builds an ordinary, narrower model: its share of the attention
heads and of the MLP's (and each expert's) intermediate units, from the
checkpoint's tensors sliced as they are read (`sharder`, a reader transform:
no process ever holds the whole model; from safetensors and GGUF rows, a
split tensor's share is all a rank reads of it). Then `parallelize` adds the one
communication the split needs: the outputs of the row-parallel matrices
(wo, and w2 or the MoE sum) are partial sums, all-reduced once per block half
through functional collectives, which torch.compile captures in the step's
graph. Embedding, norms, routers and the output layer are replicated, so
every rank computes the same logits and samples the same token (the same
seed on every rank: the request's, or the first rank's draw).

The split, for rank r of N:
- column-parallel (rows of W: outputs): wqkv (its q, k and v blocks each),
  w13 (gate and up each), their biases;
- row-parallel (columns of W: inputs): wo, w2; a quantized weight's groups
  of inputs must not straddle two ranks (in_features / N a multiple of the
  group), and per-output-channel scales are kept whole.
Quantized entries are split the same way after quantizing the whole tensor,
so each rank's weights are exactly the single-process model's slices.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from .model import ModelArgs, canonical_names, layer_part
from .quantize import FORMATS

COLUMN = ("attention.wqkv.weight", "attention.wqkv.bias", "feed_forward.w13.weight")
ROW = ("attention.wo.weight", "feed_forward.w2.weight")


def local_args(args: ModelArgs, world: int) -> ModelArgs:
    """The shapes of one rank's model: 1/world of the heads and intermediate
    units (an MoE model's experts' own size where they have one)."""
    mlp = "moe_intermediate_size" if args.num_local_experts and args.moe_intermediate_size else "intermediate_size"
    split = {k: getattr(args, k) for k in ("num_attention_heads", "num_key_value_heads", mlp)}
    for what, n in split.items():
        if n % world:
            raise ValueError(f"{what}={n} does not divide by the tensor-parallel world size {world}")
    return replace(args, **{k: n // world for k, n in split.items()})


def _split(name: str) -> tuple[str, str | None]:
    """(canonical weight name, how it splits: "column", "row" or None) of a
    state-dict entry: a dense tensor, or a quantized part (`{name}_{part}`)."""
    parts = {part for fmt in FORMATS.values() for part in fmt.parts}
    base = next((name[:-len(p) - 1] for p in parts if name.endswith("_" + p)), name)
    local = layer_part(base)
    return base, "column" if local in COLUMN else "row" if local in ROW else None


def shard_entry(args: ModelArgs, name: str, t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s slice of one state-dict entry (a dense tensor or a quantized part)."""
    base, how = _split(name)
    if how is None or (how == "row" and t.dim() == 1):  # replicated; a per-channel scale of a row split
        return t
    if how == "column":
        a = args
        local = base.split(".", 2)[2]
        blocks = ([a.num_attention_heads * a.head_dim] + [a.num_key_value_heads * a.head_dim] * 2
                  if local.startswith("attention.") else [t.shape[0] // 2] * 2)
        rows, start = [], 0
        for size in blocks:  # each of q / k / v (gate / up) split in N
            part = size // world
            rows.append(t[start + rank * part:start + (rank + 1) * part])
            start += size
        return torch.cat(rows).contiguous()
    cols = t.shape[1]
    if cols % world:
        raise ValueError(f"{name}: {cols} columns do not divide by the tensor-parallel world size {world} "
                         f"(a group of inputs would straddle two ranks)")
    if name.endswith("_int4") and 2 * cols != canonical_names(args)[base][1]:
        raise ValueError(f"{name}: int4 inputs padded to a whole group cannot be split between ranks")
    part = cols // world
    return t[:, rank * part:(rank + 1) * part].contiguous()


def sharder(rank: int, world: int, inner=None):
    """A reader transform (checkpoints.load's): each tensor as read, through
    `inner` (e.g. the quantizer) first, then sliced to this rank's share.

    `transform.share(name)` tells a reader that can read part of a tensor
    (safetensors, a GGUF file's mapping) which share of each of its parts
    to read, (dim, rank, world); the reader passes that share with local=True. A column
    split's rows are independent, so they are read in part under any
    per-row or per-group quantizer; a row split's inputs only unquantized
    (an int8 row's scale is the whole row's)."""
    def transform(args, name, tensor, local=False):
        entries = inner(args, name, tensor) if inner else {name: tensor}
        return entries if local else {n: shard_entry(args, n, t, rank, world) for n, t in entries.items()}

    def share(name):
        how = _split(name)[1]
        if how == "column" or (how == "row" and inner is None):
            return (0 if how == "column" else 1), rank, world
        return None

    transform.share = share
    return transform


class AllReduced(nn.Module):
    """`inner`'s output summed over the ranks (a row-parallel layer's partial sums)."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x, *more):  # (more: an MoE layer's padding rows)
        from torch.distributed import _functional_collectives as funcol
        return funcol.all_reduce(self.inner(x, *more), "sum", self.group)


def parallelize(model, group) -> nn.Module:
    """Add the all-reduce after each row-parallel part of a rank's model."""
    for layer in model.layers:
        layer.attention.wo = AllReduced(layer.attention.wo, group)
        ffn = layer.feed_forward
        if hasattr(ffn, "w2"):
            ffn.w2 = AllReduced(ffn.w2, group)
        else:  # (an MoE layer: one all-reduce of its experts' summed outputs)
            layer.feed_forward = AllReduced(ffn, group)
    model.tensor_parallel = group
    return model
