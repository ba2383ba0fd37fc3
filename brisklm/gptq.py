"""GPTQ: int4 weights that minimise each layer's output error on calibration text.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers" (2022). For a Linear with weight W (N, K) and inputs
X, quantize the columns of W one at a time and spread each column's rounding
error over the columns not yet quantized, weighted by the inverse of the
Hessian H = X^T X, so that ||X W^T - X Q^T|| stays small. Layers are done in
order, each calibrated on the outputs of the already-quantized layers before
it, one layer in memory at a time.

The result uses quantize.py's int4 format (scale and zero per group of
`groupsize` inputs), so it loads, saves and runs exactly like RTN int4.
"""
from __future__ import annotations

import copy

import torch

from .model import build_model
from .quantize import dequantize, pack_int4, quantize_embedding, quantize_int8


def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, groupsize: int, scale_dtype,
              damp: float = 0.01, block: int = 128):
    """GPTQ for one weight (N, K) given H (K, K) -> quantize.py's int4 parts."""
    # Pad K to whole groups: the padded columns are dead (zero input), as in RTN.
    pad = -w.shape[1] % groupsize
    w = torch.nn.functional.pad(w.float(), (0, pad))
    h = torch.nn.functional.pad(hessian.float(), (0, pad, 0, pad))
    n, k = w.shape
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(k)
    # Upper Cholesky factor of H^-1: row i holds how column i's error spreads to the right.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros(n, k)
    scales = torch.zeros(n, k // groupsize)
    zeros = torch.zeros(n, k // groupsize)
    block = max(block, groupsize) // groupsize * groupsize  # blocks hold whole groups
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, err = w[:, b0:b1].clone(), torch.zeros(n, b1 - b0)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % groupsize == 0:  # this group's grid, from its (updated) weights
                g = wb[:, i:i + groupsize]
                lo, hi = g.amin(1), g.amax(1)
                scale = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype).float()
                zero = (lo + 8 * scale).to(scale_dtype).float()
                scales[:, col // groupsize], zeros[:, col // groupsize] = scale, zero
            q = torch.round((wb[:, i] - zero) / scale + 8).clamp(0, 15)
            codes[:, col] = q
            e = (wb[:, i] - ((q - 8) * scale + zero)) / hb[i, i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return {"int4": pack_int4(codes), "scale": scales, "zero": zeros}


def _layer_inputs(layer):
    """Hooks that accumulate X^T X for the four Linears of a block."""
    names = {"attention.wqkv": layer.attention.wqkv, "attention.wo": layer.attention.wo,
             "feed_forward.w13": layer.feed_forward.w13, "feed_forward.w2": layer.feed_forward.w2}
    hessians = {name: None for name in names}
    hooks = []
    for name, module in names.items():
        def hook(mod, inputs, output, name=name):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()  # (after the norm: model.py applies it)
            h = x.T @ x
            hessians[name] = h if hessians[name] is None else hessians[name] + h
        hooks.append(module.register_forward_hook(hook))
    return hessians, hooks


@torch.no_grad()
def gptq_quantize_state_dict(args, state: dict, calibration: list[list[int]], groupsize: int = 128,
                             progress=None):
    """Canonical state dict -> (args, state) with GPTQ int4 Linears (output layer int8).

    calibration: token id sequences (e.g. a few thousand tokens of text)."""
    from dataclasses import replace
    if args.num_local_experts:
        raise ValueError("GPTQ of mixture-of-experts models is not supported yet (int4 RTN is: --mode int4)")
    calibration = [list(s) for s in calibration if len(s) > 1]
    if not calibration:
        raise ValueError("GPTQ needs calibration sequences of at least 2 tokens")
    dtype = state["tok_embeddings.weight"].dtype
    # The model stands on the checkpoint's own tensors; each block is copied to
    # fp32 for its calibration and dropped after it (a whole fp32 copy of an 8B
    # model would be 32 GB). The copy also keeps the caller's tensors unwritten.
    model = build_model(args, state)
    length = max(len(s) for s in calibration)
    model.setup_caches(1, length)
    xs = [model.tok_embeddings(torch.tensor([s])).float() for s in calibration]
    out = dict(state)
    for i in range(args.num_hidden_layers):
        layer = copy.deepcopy(model.layers[i]).float()
        hessians, hooks = _layer_inputs(layer)
        for x in xs:
            _run_block(model, layer, x)
        for h in hooks:
            h.remove()
        for local, hess in hessians.items():
            name = f"layers.{i}.{local}.weight"
            module = layer.get_submodule(local)
            parts = gptq_int4(out.pop(name), hess, groupsize, dtype)
            out.update({f"{name}_{s}": t for s, t in parts.items()})
            module.weight.copy_(dequantize(parts)[:, :module.weight.shape[1]])  # later layers see it
        xs = [_run_block(model, layer, x) for x in xs]
        del layer
        if progress:
            progress(i + 1, args.num_hidden_layers)
    if args.tie_word_embeddings:
        out["output.weight"] = state["tok_embeddings.weight"]
        args = replace(args, tie_word_embeddings=False)
    out.update({f"output.weight_{s}": t for s, t in quantize_int8(out.pop("output.weight")).items()})
    return args, quantize_embedding(out)


def calibration_ids(tokenizer, sequences: int = 8, length: int = 256) -> list[list[int]]:
    """Token sequences from the end of pydoc_data.topics: a fixed English text,
    disjoint from the start of it that `brisk eval` scores."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))[-60_000:]
    ids = tokenizer.encode(text)
    return [ids[i * length:(i + 1) * length] for i in range(min(sequences, len(ids) // length))]


def _run_block(model, layer, x):
    from .model import visible
    pos = torch.arange(x.shape[1], device=x.device)
    attention = layer.attention  # (its window and its RoPE table: Gemma 3's differ by layer)
    table = "rope_local" if attention.local_rope else "rope"
    cos, sin = getattr(model, table + "_cos")[pos], getattr(model, table + "_sin")[pos]
    return layer(x, cos, sin, visible(pos[:, None], pos[None, :], attention.window), pos)
