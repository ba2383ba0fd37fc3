"""brisk-lm's own checkpoint: a folder written by `brisk convert`.

    brisk.json          {"format": "brisklm", "version": 1, "model_args": {...}, "tokenizer": {...}}
    model.safetensors   the canonical state dict (see model.canonical_names), or
    model-00001.safetensors ...  shards of it, with brisk.json's "weight_map"
                        naming each tensor's shard (a model written as it is read)
    tokenizer files     as the tokenizer backend saves them

It loads with no name mapping, no fusion and no dequantization: a memory
map, then assignment.
"""
from __future__ import annotations

import contextlib
import json
import os

from ..errors import BriskError
from ..model import ModelArgs, canonical_names
from ..tokenizer import Tokenizer
from . import Checkpoint, tracked

FORMAT_VERSION = 1


SHARD_BYTES = 2 << 30  # a shard is written once its tensors reach this size


class NativeWriter:
    """Writes a native folder tensor by tensor: tensors are held until they
    reach shard_bytes, then written as one shard and dropped, so writing
    needs one shard's memory, not the model's. `finish` writes the rest and
    brisk.json (a single shard is model.safetensors)."""

    def __init__(self, folder: str, shard_bytes: int = SHARD_BYTES):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise BriskError(f"{folder}: cannot create the output folder ({e.strerror})") from None
        self.folder, self.shard_bytes = folder, shard_bytes
        self.tensors, self.held, self.peak_held = {}, 0, 0
        self.aliases, self.seen, self.weight_map, self.shards = {}, {}, {}, 0

    def add(self, key: str, t):
        # safetensors stores no shared memory: a tensor held under two names (a
        # GGUF's tied Q8_0 embedding and output) is written once, the second
        # name an alias of the first (within one shard).
        if t.data_ptr() in self.seen and self.tensors[self.seen[t.data_ptr()]].shape == t.shape:
            self.aliases[key] = self.seen[t.data_ptr()]
            return
        self.seen[t.data_ptr()] = key
        self.tensors[key] = t.contiguous()
        self.held += t.numel() * t.element_size()
        self.peak_held = max(self.peak_held, self.held)
        if self.held >= self.shard_bytes:
            self._flush(f"model-{self.shards + 1:05d}.safetensors")

    def _flush(self, name: str):
        from safetensors.torch import save_file
        path = os.path.join(self.folder, name)
        try:
            save_file(self.tensors, path)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(path, 0o666 & ~umask)  # (safetensors writes its file private; the rest is not)
        except OSError as e:  # a full disk, a read-only folder
            raise BriskError(f"{self.folder}: cannot write the checkpoint ({e.strerror or e})") from None
        self.weight_map.update({key: name for key in self.tensors})
        self.shards += 1
        self.tensors, self.seen, self.held = {}, {}, 0

    def finish(self, args: ModelArgs, tokenizer: Tokenizer | None, quantization: dict | None = None):
        sharded = self.shards > 0
        self._flush(f"model-{self.shards + 1:05d}.safetensors" if sharded else "model.safetensors")
        info = {"format": "brisklm", "version": FORMAT_VERSION, "model_args": args.to_dict(),
                "quantization": quantization, "aliases": self.aliases,
                "weight_map": self.weight_map if sharded else None,
                "tokenizer": tokenizer.save(self.folder) if tokenizer else None}
        try:
            with open(os.path.join(self.folder, "brisk.json"), "w", encoding="utf-8") as f:
                json.dump(info, f, indent=1)
        except OSError as e:
            raise BriskError(f"{self.folder}: cannot write the checkpoint ({e.strerror or e})") from None


def save_native(folder: str, args: ModelArgs, state_dict: dict, tokenizer: Tokenizer | None,
                quantization: dict | None = None, shard_bytes: int = SHARD_BYTES):
    """Write the canonical tensors (dense, or quantize.py's entries) and the metadata."""
    from ..quantize import quantized_entries
    writer = NativeWriter(folder, shard_bytes)
    for name in canonical_names(args):
        parts = None if name in state_dict else quantized_entries(state_dict, name)
        for key, t in ({name: state_dict[name]} if parts is None else
                       {f"{name}_{s}": t for s, t in parts.items()}).items():
            writer.add(key, t)
    writer.finish(args, tokenizer, quantization)


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


def tensor_shapes(folder: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """{key: (shape, bytes stored)} of every tensor the folder's weight files
    hold, from the safetensors headers alone."""
    import struct
    info = read_metadata(folder)
    out = {}
    for name in sorted(set((info.get("weight_map") or {}).values()) or {"model.safetensors"}):
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        except (OSError, ValueError, struct.error) as e:
            raise BriskError(f"{path}: corrupt, truncated or missing weights file ({e})") from None
        out.update({key: (tuple(e["shape"]), e["data_offsets"][1] - e["data_offsets"][0])
                    for key, e in header.items() if key != "__metadata__"})
    return out


def stored_bytes(folder: str, dtype) -> int:
    """Bytes the folder's weights take once loaded in `dtype`: dense tensors
    in `dtype`, quantized entries (integers and their scales) as stored."""
    import math

    import torch
    dense = set(canonical_names(ModelArgs(**read_metadata(folder)["model_args"])))
    size = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) * size if key in dense else stored
               for key, (shape, stored) in tensor_shapes(folder).items())


def load_native(folder: str, device, dtype, progress=None, transform=None, plan=None) -> Checkpoint:
    from safetensors import SafetensorError, safe_open
    info = read_metadata(folder)
    args = ModelArgs(**info["model_args"])
    if plan:
        plan(args)
    weight_map = info.get("weight_map") or {}
    weights = os.path.join(folder, "model.safetensors")
    state, aliases, read = {}, info.get("aliases") or {}, {}
    try:
        with contextlib.ExitStack() as stack:
            files = {name: stack.enter_context(safe_open(os.path.join(folder, name), framework="pt",
                                                         device=str(device)))
                     for name in sorted(set(weight_map.values()) or {"model.safetensors"})}
            if not weight_map:
                weight_map = {k: "model.safetensors" for k in files["model.safetensors"].keys()}
            keys = set(weight_map) | set(aliases)

            def get(key):  # an alias is the tensor it names, read once
                stored = aliases.get(key, key)
                if stored not in read:
                    read[stored] = files[weight_map[stored]].get_tensor(stored)
                return read[stored]

            for name, shape in tracked(canonical_names(args).items(), progress):
                if name not in keys:
                    quantized = [k for k in keys if k.startswith(name + "_")]
                    if not quantized:
                        raise BriskError(f"{weights}: missing tensor {name!r}")
                    if transform is None:  # quantized entries keep their own dtypes (integers, fp32 scales)
                        state.update({k: get(k) for k in quantized})
                        continue
                    # quantized again (another mode): from the weights the codes stand for
                    from ..quantize import dequantize
                    t = dequantize({k[len(name) + 1:]: get(k) for k in quantized})[..., :shape[-1]]  # (padding)
                else:
                    t = get(name)
                if tuple(t.shape) != shape:
                    raise BriskError(f"{weights}: tensor {name!r} has shape {tuple(t.shape)}, "
                                     f"expected {shape}")
                state.update(transform(args, name, t.to(dtype)) if transform else {name: t.to(dtype)})
    except (SafetensorError, OSError) as e:
        raise BriskError(f"{folder}: corrupt, truncated or missing weights file ({e})") from None
    tok = Tokenizer.from_saved(folder, info["tokenizer"]) if info.get("tokenizer") else None
    return Checkpoint(args, state, tok, folder)
