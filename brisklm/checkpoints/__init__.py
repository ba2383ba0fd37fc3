"""Checkpoint readers: each turns a format into (ModelArgs, canonical state dict, Tokenizer).

`load(path_or_name)` recognises a Hugging Face folder, a GGUF file, a native
brisk-lm folder (written by `brisk convert`), or None for the bundled default
model. Every problem with the input becomes a one-line BriskError naming the
file and the fault.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import BriskError
from ..model import ModelArgs, rotary_first
from ..tokenizer import Tokenizer


@dataclass
class Checkpoint:
    args: ModelArgs
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    path: str


def load(path: str | None = None, device="cpu", dtype=torch.float32, progress=None,
         keep_gguf_blocks: bool | str = False, transform=None, plan=None) -> Checkpoint:
    """Read a checkpoint, placing each tensor on device in dtype as it is read.

    plan(args), if given, is called once the model's shapes are read and
    before any tensor is (api's memory plan, which may refuse there).

    transform(args, name, tensor) -> entries, if given, replaces each dense
    canonical tensor as it is read (quantize.quantizer: quantized while
    loading, so the dense model never exists whole).

    progress, if given, is called as progress(done, total) while tensors load.
    keep_gguf_blocks: "all" keeps a GGUF file's Q4_0/Q4_1 matrices as int4
    entries (quantize.py's format) and its Q8_0 ones as grouped int8, instead
    of dequantizing them; "output" keeps the Q4 blocks and of the Q8_0 ones
    only the output layer's. Which to ask for on which device is the loading
    policy's (loading.gguf_blocks_to_keep), not the reader's."""
    kind, path = resolve(path)
    if kind == "native":
        from .native import load_native
        return load_native(path, device, dtype, progress, transform, plan)
    if kind == "hf":
        from .hf import load_hf_folder
        return load_hf_folder(path, device, dtype, progress, transform, plan)
    from .gguf import load_gguf
    return load_gguf(path, device, dtype, progress, keep_gguf_blocks, transform, plan)


def read_tokenizer(path: str | None) -> Tokenizer:
    """A checkpoint's tokenizer alone, its tensors left unread (GPTQ's
    calibration text needs it before the weights that a reader gives first)."""
    kind, where = resolve(path)
    if kind == "hf":
        from ..tokenizer import load_hf_tokenizer
        tok = load_hf_tokenizer(where)
    elif kind == "gguf":
        from .gguf import load_tokenizer, metadata, open_reader
        tok = load_tokenizer(metadata(open_reader(where)), where)
    else:
        from .native import read_metadata
        info = read_metadata(where)
        tok = Tokenizer.from_saved(where, info["tokenizer"]) if info.get("tokenizer") else None
    if tok is None:
        raise BriskError(f"{where}: no tokenizer (GPTQ calibrates on text)")
    return tok


class _Shapes(Exception):
    pass


def read_args(path: str | None) -> ModelArgs:
    """A checkpoint's ModelArgs, its tensors left unread."""
    def stop(args):
        raise _Shapes(args)
    try:
        load(path, plan=stop)
    except _Shapes as e:
        return e.args[0]
    raise BriskError(f"{path}: no shapes read")  # (every reader calls plan)


def resolve(path: str | None) -> tuple[str, str]:
    """(format, path) of a checkpoint: "native", "hf" (folders) or "gguf" (a
    file, or a folder holding one); None is the bundled default model, and a
    Hugging Face repo id that is no path on disk is found in the hub caches
    (hub.find_model)."""
    if path is None:
        from .hub import default_model_path
        path = default_model_path()
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        from .hub import find_model
        path = find_model(path) or path
        if not os.path.exists(path):
            raise BriskError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "brisk.json")):
            return "native", path
        if os.path.exists(os.path.join(path, "config.json")):
            return "hf", path
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) != 1:
            raise BriskError(f"{path}: not a checkpoint folder (no config.json, brisk.json "
                             f"or single .gguf file)")
        path = os.path.join(path, ggufs[0])
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise BriskError(f"{path}: unrecognised checkpoint format (expected a GGUF file or a "
                         f"Hugging Face / brisk-lm folder)")
    return "gguf", path


# Our canonical per-layer names -> Hugging Face's. q/k/v and
# gate/up are concatenated into the fused matrices.
HF_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
HF_FUSED = {
    "attention.wqkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                              "self_attn.v_proj.weight"],
    "attention.wqkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias",
                            "self_attn.v_proj.bias"],
    "feed_forward.w13.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
}
# Gemma 3's four norms a layer: the pre-MLP one is ours, the two after are extra
HF_SANDWICH = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffn_norm.weight": "post_feedforward_layernorm.weight"}
# Mixture-of-experts layers: the router and each expert's parts (gate rows, then up)
HF_MIXTRAL = {"gate.weight": "block_sparse_moe.gate.weight", "experts": "block_sparse_moe.experts.",
              "w13.weight": ["w1.weight", "w3.weight"], "w2.weight": ["w2.weight"]}
HF_MOE = {"gate.weight": "mlp.gate.weight", "experts": "mlp.experts.",  # Qwen3-MoE
          "w13.weight": ["gate_proj.weight", "up_proj.weight"], "w2.weight": ["down_proj.weight"]}
# ... or stored already fused, in the same order (Phi-3 / Phi-4)
HF_STORED_FUSED = {"attention.wqkv.weight": "self_attn.qkv_proj.weight",
                   "feed_forward.w13.weight": "mlp.gate_up_proj.weight"}


def tracked(items, progress):
    """Iterate items, reporting progress(done, total) along the way."""
    items = list(items)
    for i, item in enumerate(items):
        if progress:
            progress(i, len(items))
        yield item
    if progress:
        progress(len(items), len(items))


def assemble_from_hf_names(args: ModelArgs, get, has, device, dtype, where: str,
                           file_name=lambda name: name, progress=None, skip=(), transform=None,
                           get_share=None):
    """Canonical state dict from a getter of Hugging Face-named tensors.

    Tensors are converted one at a time, and each goes through transform (see
    load) before the next is read, so peak memory is the result plus one
    tensor, never a second full copy. file_name maps a Hugging Face name to
    the name the file uses, for error messages.

    get_share(name, dim, rank, world) -> (full shape, rank's block along dim),
    where the files can be read in part (safetensors, GGUF): a tensor-parallel
    reader transform (tp.sharder) that says which share of a tensor it keeps
    (`transform.share(name)`) then gets only that share, read as such."""

    def fetch(name, shape=None, share=None):
        if not has(name):
            raise BriskError(f"{where}: missing tensor {file_name(name)!r}")
        full, t = get_share(name, *share) if share else (None, get(name))
        full = tuple(full or t.shape)  # (a share is checked by the whole tensor's shape)
        if shape is not None and full != shape:
            raise BriskError(f"{where}: tensor {file_name(name)!r} has shape {full}, expected {shape}")
        return t.to(device=device, dtype=dtype)

    share_of = getattr(transform, "share", None) if get_share else None

    from ..model import canonical_names
    shapes = canonical_names(args)
    a = args
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    part_rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
                 "mlp.gate_proj": a.intermediate_size, "mlp.up_proj": a.intermediate_size}
    layer_names = {**HF_LAYER, **HF_SANDWICH} if a.sandwich_norms else HF_LAYER
    experts = {}  # an MoE layer's tensors: Mixtral's block_sparse_moe names, or Qwen3-MoE's mlp ones
    if a.num_local_experts:
        mixtral = has("model.layers.0.block_sparse_moe.gate.weight")
        experts = dict(HF_MIXTRAL if mixtral else HF_MOE)
        part_rows.update({p.rsplit(".", 1)[0]: a.moe_intermediate_size or a.intermediate_size
                          for p in experts["w13.weight"]})
    state = {}

    def put(name, t, share=None):  # (share: t is already that share of the canonical tensor)
        t = rotary_rows(args, name, t, share[2] if share else 1)
        if transform is None:
            state[name] = t
        else:
            state.update(transform(args, name, t, local=True) if share else transform(args, name, t))
    for name, shape in tracked(shapes.items(), progress):
        if name in skip:  # provided otherwise (e.g. kept quantized)
            continue
        if name == "tok_embeddings.weight":
            put(name, fetch("model.embed_tokens.weight", shape))
        elif name == "norm.weight":
            put(name, fetch("model.norm.weight", shape))
        elif name == "output.weight":
            put(name, fetch("lm_head.weight", shape))
        else:
            _, i, local = name.split(".", 2)
            prefix = f"model.layers.{i}."
            if local == "feed_forward.gate.weight":
                put(name, fetch(prefix + experts["gate.weight"], shape))
                continue
            if local.startswith("feed_forward.experts."):  # "feed_forward.experts.3.w13.weight"
                e, part = local.split(".", 3)[2:]
                prefix, names = f"{prefix}{experts['experts']}{e}.", experts[part]
                rows = [part_rows[n.rsplit(".", 1)[0]] for n in names] if len(names) > 1 else [shape[0]]
                share = share_of(name) if share_of else None
                put(name, torch.cat([fetch(prefix + n, (r,) + tuple(shape[1:]), share)
                                     for n, r in zip(names, rows)]), share)
                continue
            share = share_of(name) if share_of else None  # (dim, rank, world) of each part, or None
            if local in layer_names:
                put(name, fetch(prefix + layer_names[local], shape, share), share)
            elif local in HF_STORED_FUSED and has(prefix + HF_STORED_FUSED[local]):
                put(name, fetch(prefix + HF_STORED_FUSED[local], shape))  # (q, k, v in one: read whole)
            else:
                rows = [part_rows[part.rsplit(".", 1)[0]] for part in HF_FUSED[local]]
                put(name, torch.cat([fetch(prefix + part, (n,) + tuple(shape[1:]), share)
                                     for part, n in zip(HF_FUSED[local], rows)]), share)
    return state


def rotary_rows(args: ModelArgs, name: str, t: torch.Tensor, world: int = 1) -> torch.Tensor:
    """The canonical tensor `name` (rows first: a weight, its bias, its
    quantized codes and scales; or a tensor-parallel rank's share of it, 1/world
    of the heads) with each q and k head's rows in model.rotary_first's order,
    where RoPE turns only some of a head's dims."""
    order = rotary_first(args)
    if order is None:
        return t
    order, d = order.to(t.device), args.head_dim
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return t[order]
    if not name.endswith(("attention.wqkv.weight", "attention.wqkv.bias")):
        return t
    heads = (args.num_attention_heads + args.num_key_value_heads) // world
    qk = t[:heads * d].unflatten(0, (heads, d))[:, order]
    return torch.cat([qk.flatten(0, 1), t[heads * d:]])


def hf_parts(name: str) -> list[str]:
    """The Hugging Face tensors a canonical Linear weight is made of, in order."""
    if name == "output.weight":
        return ["lm_head.weight"]
    _, i, local = name.split(".", 2)
    prefix = f"model.layers.{i}."
    return [prefix + p for p in (HF_FUSED[local] if local in HF_FUSED else [HF_LAYER[local]])]
