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
from . import Checkpoint, assemble_from_hf_names

SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3",
             "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3_text", "MixtralForCausalLM": "mixtral",
             "Qwen3MoeForCausalLM": "qwen3_moe"}


def read_config(folder: str) -> ModelArgs:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise BriskError(f"{path}: cannot read config: {e}") from None
    if not isinstance(config, dict):
        raise BriskError(f"{path}: cannot read config: expected a JSON object")
    arch = (config.get("architectures") or [None])[0]
    model_type = config.get("model_type")
    if (arch not in SUPPORTED) if arch else (model_type not in SUPPORTED.values()):
        raise BriskError(f"{path}: unsupported architecture {arch or model_type!r} "
                         f"(supported: {', '.join(SUPPORTED)})")
    if model_type == "qwen2" or arch == "Qwen2ForCausalLM":
        config.setdefault("attention_bias", True)
    if model_type in ("qwen3", "qwen3_moe") or arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        config["qk_norm"] = True
    if model_type == "qwen3_moe" or arch == "Qwen3MoeForCausalLM":
        if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
            raise BriskError(f"{path}: dense layers among the experts' (decoder_sparse_step, mlp_only_layers) "
                             f"are not supported yet")
        config.setdefault("norm_topk_prob", False)  # (transformers' default for Qwen3-MoE)
    if model_type == "gemma3_text" or arch == "Gemma3ForCausalLM":
        config = gemma3_config(config, path)
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


def gemma3_config(config: dict, path: str) -> dict:
    """Gemma 3's fixed choices as config fields, and its older config keys
    (sliding_window_pattern, rope_local_base_freq) as ModelArgs reads them."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise BriskError(f"{path}: {key} is not supported yet")
    n, every = config.get("num_hidden_layers", 26), config.get("sliding_window_pattern", 6)
    config.setdefault("layer_types", ["sliding_attention" if (i + 1) % every else "full_attention"
                                      for i in range(n)])
    config.setdefault("rope_theta", 1e6)
    config.setdefault("rope_local_base_freq", 1e4)
    config.setdefault("query_pre_attn_scalar", 256)
    config.setdefault("hidden_activation", "gelu_pytorch_tanh")
    return dict(config, qk_norm=True, sandwich_norms=True, norm_offset=1.0,
                embed_scale=config.get("hidden_size", 2304) ** 0.5,
                tie_word_embeddings=config.get("tie_word_embeddings", True))


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
