"""brisk-lm's own checkpoint: a folder written by `brisk convert`.

    brisk.json          {"format": "brisklm", "version": 1, "model_args": {...}, "tokenizer": {...}}
    model.safetensors   the canonical state dict (see model.canonical_names)
    tokenizer files     as the tokenizer backend saves them

It loads with no name mapping, no fusion and no dequantization: a memory
map, then assignment.
"""
from __future__ import annotations

import json
import os

from ..errors import BriskError
from ..model import ModelArgs, canonical_names
from ..tokenizer import Tokenizer
from . import Checkpoint, tracked

FORMAT_VERSION = 1


def save_native(folder: str, args: ModelArgs, state_dict: dict, tokenizer: Tokenizer | None,
                quantization: dict | None = None):
    """Write the canonical tensors (dense, or quantize.py's entries) and the metadata."""
    from safetensors.torch import save_file

    from ..quantize import quantized_entries
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise BriskError(f"{folder}: cannot create the output folder ({e.strerror})") from None
    tensors, aliases, seen = {}, {}, {}

    def add(key, t):
        # safetensors stores no shared memory: a tensor kept under two names (a
        # GGUF's tied Q8_0 embedding and output) is written once, the second
        # name an alias of the first.
        if t.data_ptr() in seen and tensors[seen[t.data_ptr()]].shape == t.shape:
            aliases[key] = seen[t.data_ptr()]
            return
        seen[t.data_ptr()] = key
        tensors[key] = t.contiguous()

    for name in canonical_names(args):
        parts = None if name in state_dict else quantized_entries(state_dict, name)
        for key, t in ({name: state_dict[name]} if parts is None else
                       {f"{name}_{s}": t for s, t in parts.items()}).items():
            add(key, t)
    try:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        info = {"format": "brisklm", "version": FORMAT_VERSION, "model_args": args.to_dict(),
                "quantization": quantization, "aliases": aliases,
                "tokenizer": tokenizer.save(folder) if tokenizer else None}
        with open(os.path.join(folder, "brisk.json"), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
    except OSError as e:  # a full disk, a read-only folder
        raise BriskError(f"{folder}: cannot write the checkpoint ({e.strerror or e})") from None


def read_metadata(folder: str) -> dict:
    """brisk.json, checked: its format version and model_args."""
    meta_path = os.path.join(folder, "brisk.json")
    try:
        with open(meta_path, encoding="utf-8") as f:
            info = json.load(f)
        ModelArgs(**info["model_args"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BriskError(f"{meta_path}: invalid brisk-lm checkpoint metadata ({e})") from None
    if info.get("version") != FORMAT_VERSION:
        raise BriskError(f"{meta_path}: unsupported format version {info.get('version')!r}")
    return info


def load_native(folder: str, device, dtype, progress=None, transform=None, plan=None) -> Checkpoint:
    from safetensors import SafetensorError, safe_open
    info = read_metadata(folder)
    args = ModelArgs(**info["model_args"])
    if plan:
        plan(args)
    weights = os.path.join(folder, "model.safetensors")
    state, aliases, read = {}, info.get("aliases") or {}, {}
    try:
        with safe_open(weights, framework="pt", device=str(device)) as f:
            keys = set(f.keys()) | set(aliases)

            def get(key):  # an alias is the tensor it names, read once
                stored = aliases.get(key, key)
                if stored not in read:
                    read[stored] = f.get_tensor(stored)
                return read[stored]

            for name, shape in tracked(canonical_names(args).items(), progress):
                if name not in keys:
                    quantized = [k for k in keys if k.startswith(name + "_")]
                    if not quantized:
                        raise BriskError(f"{weights}: missing tensor {name!r}")
                    # Quantized entries keep their own dtypes (integers, fp32 scales).
                    state.update({k: get(k) for k in quantized})
                    continue
                t = get(name)
                if tuple(t.shape) != shape:
                    raise BriskError(f"{weights}: tensor {name!r} has shape {tuple(t.shape)}, "
                                     f"expected {shape}")
                state.update(transform(args, name, t.to(dtype)) if transform else {name: t.to(dtype)})
    except (SafetensorError, OSError) as e:
        raise BriskError(f"{weights}: corrupt or truncated weights file ({e})") from None
    tok = Tokenizer.from_saved(folder, info["tokenizer"]) if info.get("tokenizer") else None
    return Checkpoint(args, state, tok, folder)
