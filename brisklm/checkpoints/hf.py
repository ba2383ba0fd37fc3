"""Hugging Face folders: config.json + *.safetensors (sharded or not) + tokenizer files.

Tensors are read through safetensors' memory map, one at a time, converted
to the target dtype/device and fused (q/k/v, gate/up) as they arrive.
`pytorch_model*.bin` is read with torch.load(weights_only=True), which refuses
arbitrary pickled objects.
"""
from __future__ import annotations

import json
import os
import pickle

from ..errors import BriskError
from ..model import ModelArgs
from ..tokenizer import load_hf_tokenizer
from . import Checkpoint, assemble_from_hf_names, families

def read_config(folder: str) -> ModelArgs:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise BriskError(f"{path}: cannot read config: {e}") from None
    if not isinstance(config, dict):
        raise BriskError(f"{path}: cannot read config: expected a JSON object")
    config = families.from_hf(config, path).hf_config(config, path)
    rope = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
    rope = rope.get("full_attention", rope)  # (Gemma 3's sliding layers are never scaled)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "linear", "llama3", "longrope", "su"):
        raise BriskError(f"{path}: rope scaling {kind!r} is not supported yet (default, linear, llama3, "
                         f"longrope are)")
    config["partial_rotary_factor"] = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    try:
        return ModelArgs.from_dict(config)
    except (TypeError, ValueError, KeyError) as e:
        raise BriskError(f"{path}: invalid config: {e}") from None


class _TensorFiles:
    """Name -> tensor over the folder's safetensors (or .bin) files, lazily."""

    def __init__(self, folder):
        self.folder = folder
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        self.index: dict[str, str] = {}
        self.handles = {}
        if files:
            for f in files:
                for key in self._open(f).keys():
                    self.index[key] = f
        else:
            bins = sorted(f for f in os.listdir(folder)
                          if f.startswith("pytorch_model") and f.endswith(".bin"))
            if not bins:
                raise BriskError(f"{folder}: no *.safetensors or pytorch_model*.bin weights")
            for f in bins:
                for key in self._open(f):
                    self.index[key] = f

    def _open(self, fname):
        if fname not in self.handles:
            path = os.path.join(self.folder, fname)
            try:
                if fname.endswith(".safetensors"):
                    from safetensors import safe_open
                    self.handles[fname] = safe_open(path, framework="pt")
                else:
                    import torch
                    self.handles[fname] = torch.load(path, map_location="cpu", mmap=True,
                                                     weights_only=True)
            except pickle.UnpicklingError:
                raise BriskError(f"{path}: refused: it holds pickled objects other than tensors "
                                 f"(.bin files are read with weights_only=True; convert it to "
                                 f"safetensors)") from None
            except Exception as e:  # corrupt header, truncated file
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise BriskError(f"{path}: corrupt or truncated weights file ({msg})") from None
        return self.handles[fname]

    def has(self, name):
        return name in self.index

    def get_share(self, name, dim: int, rank: int, world: int):
        """(full shape, block `rank` of `world` along dim): only that block read
        from a safetensors file; from a .bin file, the block of its mapping."""
        fname = self.index[name]
        handle = self._open(fname)
        try:
            if fname.endswith(".safetensors"):
                part = handle.get_slice(name)
                shape = tuple(part.get_shape())
            else:
                part = handle[name]
                shape = tuple(part.shape)
            size = shape[dim] // world
            if shape[dim] % world:  # (not the expected shape: the caller's check names it)
                return shape, None
            index = tuple(slice(rank * size, (rank + 1) * size) if i == dim else slice(None)
                          for i in range(len(shape)))
            return shape, part[index] if fname.endswith(".safetensors") else part[index].clone()
        except Exception as e:
            raise BriskError(f"{os.path.join(self.folder, fname)}: cannot read tensor "
                             f"{name!r} ({e})") from None

    def get(self, name):
        fname = self.index[name]
        handle = self._open(fname)
        try:
            return handle.get_tensor(name) if fname.endswith(".safetensors") else handle[name]
        except Exception as e:
            raise BriskError(f"{os.path.join(self.folder, fname)}: cannot read tensor "
                             f"{name!r} ({e})") from None


def load_hf_folder(folder: str, device, dtype, progress=None, transform=None, plan=None) -> Checkpoint:
    args = read_config(folder)
    if plan:
        plan(args)
    files = _TensorFiles(folder)
    state = assemble_from_hf_names(args, files.get, files.has, device, dtype, folder,
                                   progress=progress, transform=transform, get_share=files.get_share)
    return Checkpoint(args, state, load_hf_tokenizer(folder), folder)
