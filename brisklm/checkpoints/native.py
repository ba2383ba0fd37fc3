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
    tensors, seen = {}, set()

    def own(t):  # safetensors stores no shared memory (a GGUF's tied Q8_0 embedding and output)
        t = t.contiguous()
        t = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
        return t

    for name in canonical_names(args):
        parts = None if name in state_dict else quantized_entries(state_dict, name)
        if parts is None:
            tensors[name] = own(state_dict[name])
        else:
            tensors.update({f"{name}_{s}": own(t) for s, t in parts.items()})
    try:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        info = {"format": "brisklm", "version": FORMAT_VERSION, "model_args": args.to_dict(),
                "quantization": quantization,
                "tokenizer": tokenizer.save(folder) if tokenizer else None}
        with open(os.path.join(folder, "brisk.json"), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
    except OSError as e:  # a full disk, a read-only folder
        raise BriskError(f"{folder}: cannot write the checkpoint ({e.strerror or e})") from None


def load_native(folder: str, device, dtype, progress=None) -> Checkpoint:
    from safetensors import SafetensorError, safe_open
    meta_path = os.path.join(folder, "brisk.json")
    try:
        with open(meta_path, encoding="utf-8") as f:
            info = json.load(f)
        args = ModelArgs(**info["model_args"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BriskError(f"{meta_path}: invalid brisk-lm checkpoint metadata ({e})") from None
    if info.get("version") != FORMAT_VERSION:
        raise BriskError(f"{meta_path}: unsupported format version {info.get('version')!r}")
    weights = os.path.join(folder, "model.safetensors")
    state = {}
    try:
        with safe_open(weights, framework="pt", device=str(device)) as f:
            keys = set(f.keys())
            for name, shape in tracked(canonical_names(args).items(), progress):
                if name not in keys:
                    quantized = [k for k in keys if k.startswith(name + "_")]
                    if not quantized:
                        raise BriskError(f"{weights}: missing tensor {name!r}")
                    # Quantized entries keep their own dtypes (integers, fp32 scales).
                    state.update({k: f.get_tensor(k) for k in quantized})
                    continue
                t = f.get_tensor(name)
                if tuple(t.shape) != shape:
                    raise BriskError(f"{weights}: tensor {name!r} has shape {tuple(t.shape)}, "
                                     f"expected {shape}")
                state[name] = t.to(dtype)
    except (SafetensorError, OSError) as e:
        raise BriskError(f"{weights}: corrupt or truncated weights file ({e})") from None
    tok = Tokenizer.from_saved(folder, info["tokenizer"]) if info.get("tokenizer") else None
    return Checkpoint(args, state, tok, folder)
