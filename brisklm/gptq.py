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

import torch
import torch.nn.functional as F

from .model import KVCache, TransformerBlock, canonical_names, rope_tables, scale_embeddings, visible
from .quantize import dequantize, pack_int4, quantize_embedding, quantize_int8, untied


def upper_cholesky_of_inverse(h: torch.Tensor) -> torch.Tensor:
    """U, upper triangular, with H^-1 = U^T U, from one Cholesky and one
    triangular inverse: with P reversing the order, P H P = L L^T gives
    H^-1 = (P L^-1 P)^T (P L^-1 P)."""
    low = torch.linalg.cholesky(h.flip(0, 1))
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return torch.linalg.solve_triangular(low, eye, upper=False).flip(0, 1)


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
    h += damp * torch.diag(h).mean() * torch.eye(k, device=h.device)
    # Upper Cholesky factor of H^-1: row i holds how column i's error spreads to the right.
    hinv = upper_cholesky_of_inverse(h)
    # Worked transposed: W's column i is row i, contiguous, and each step is a few whole-row ops
    # (the loop runs once per input column, so its Python overhead is the cost on CPUs).
    wt = w.T.contiguous()
    codes, scales, zeros = (torch.zeros(rows, n, device=w.device) for rows in (k, k // groupsize, k // groupsize))
    block = max(block, groupsize) // groupsize * groupsize  # blocks hold whole groups
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, err = wt[b0:b1].clone(), torch.empty(b1 - b0, n, device=w.device)
        spread = hinv[b0:b1, b0:b1]
        inverse_diagonal = (1 / spread.diagonal()).tolist()
        for i, row in enumerate(spread.unbind(0)):
            col = b0 + i
            if col % groupsize == 0:  # this group's grid, from its (updated) weights
                g = wb[i:i + groupsize]
                lo, hi = g.amin(0), g.amax(0)
                scale = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype).float()
                zero = (lo + 8 * scale).to(scale_dtype).float()
                scales[col // groupsize], zeros[col // groupsize] = scale, zero
                offset = zero - 8 * scale  # (code q stands for q * scale + offset)
            # (written in place, into codes and err: the loop's cost is its number of torch calls)
            shifted = wb[i] - offset
            q = torch.div(shifted, scale, out=codes[col]).round_().clamp_(0, 15)
            e = torch.addcmul(shifted, q, scale, value=-1, out=err[i]).mul_(inverse_diagonal[i])
            wb[i:].addr_(row[i:], e, alpha=-1)
        wt[b1:] -= hinv[b0:b1, b1:].T @ err
    return {"int4": pack_int4(codes.T.contiguous()), "scale": scales.T.contiguous(), "zero": zeros.T.contiguous()}


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


class GPTQStream:
    """GPTQ as a reader transform (checkpoints.load's `transform`): tensors
    arrive in canonical_names' order (the embedding, the final norm, the
    output layer, then the layers one by one). A layer's tensors are held
    until its last one arrives; then the layer is calibrated on the outputs
    of the layers before it, its Linears quantized, and its dense tensors
    dropped. So a checkpoint quantizes with one layer dense (in fp32 while
    calibrated) beside the quantized ones and the calibration activations,
    on the device it is read to.

    calibration: token id sequences, or a function giving them (called when
    the embedding arrives: a reader loads the tokenizer last)."""

    def __init__(self, groupsize: int = 128, calibration=None, progress=None):
        self.groupsize, self.calibration, self.progress = groupsize, calibration, progress
        self.pending: dict[str, torch.Tensor] = {}
        self.xs = self.ropes = self.layer_names = None

    def __call__(self, args, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if name == "tok_embeddings.weight":
            return self.embedding(args, tensor)
        if name == "output.weight":
            return {f"{name}_{s}": t for s, t in quantize_int8(tensor).items()}
        if not name.startswith("layers."):
            return {name: tensor}
        self.pending[name] = tensor
        i = int(name.split(".")[1])
        if self.layer_names is None:
            self.layer_names = [[n for n in canonical_names(args) if n.startswith(f"layers.{j}.")]
                                for j in range(args.num_hidden_layers)]
        if any(n not in self.pending for n in self.layer_names[i]):
            return {}
        return self.quantize_layer(args, i)

    def embedding(self, args, table):
        if args.num_local_experts:
            raise ValueError("GPTQ of mixture-of-experts models is not supported yet (int4 RTN is: int4)")
        calibration = self.calibration() if callable(self.calibration) else self.calibration
        calibration = [list(s) for s in calibration or [] if len(s) > 1]
        if not calibration:
            raise ValueError("GPTQ needs calibration sequences of at least 2 tokens")
        self.dtype, length = table.dtype, max(len(s) for s in calibration)
        self.xs = [scale_embeddings(args, F.embedding(torch.tensor([s], device=table.device), table)).float()
                   for s in calibration]
        self.ropes = rope_tables(args, length, table.device)
        out = quantize_embedding({"tok_embeddings.weight": table})
        if args.tie_word_embeddings:  # (the output layer quantized on its own: untied)
            out.update({f"output.weight_{s}": t for s, t in quantize_int8(table).items()})
        return out

    @torch.no_grad()
    def quantize_layer(self, args, i: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{i}."
        mine = {n: self.pending.pop(n) for n in self.layer_names[i]}
        with torch.device("meta"):
            layer = TransformerBlock(args, i)
        # (an fp32 copy for calibration: the tensors as read stay as they are)
        layer.load_state_dict({n[len(prefix):]: t.to(torch.float32, copy=True) for n, t in mine.items()},
                              assign=True)
        layer.attention.kv_cache = KVCache(1, args.num_key_value_heads, max(x.shape[1] for x in self.xs),
                                           args.head_dim, torch.float32, self.xs[0].device)
        hessians, hooks = _layer_inputs(layer)
        for x in self.xs:
            _run_block(self.ropes, layer, x)
        for h in hooks:
            h.remove()
        out = {}
        for local, hess in hessians.items():
            name = f"{prefix}{local}.weight"
            module = layer.get_submodule(local)
            parts = gptq_int4(mine.pop(name), hess, self.groupsize, self.dtype)
            out.update({f"{name}_{s}": t for s, t in parts.items()})
            module.weight.copy_(dequantize(parts)[:, :module.weight.shape[1]])  # later layers see it
        self.xs = [_run_block(self.ropes, layer, x) for x in self.xs]
        out.update(mine)  # the norms and biases, as read
        if self.progress:
            self.progress(i + 1, args.num_hidden_layers)
        return out


def gptq_quantize_state_dict(args, state: dict, calibration: list[list[int]], groupsize: int = 128,
                             progress=None):
    """Canonical state dict -> (args, state) with GPTQ int4 Linears (output
    layer int8), through GPTQStream in canonical order (the caller's tensors
    are left as they are)."""
    stream, out = GPTQStream(groupsize, calibration, progress), {}
    for name in canonical_names(args):
        out.update(stream(args, name, state[name]))
    return untied(args, out), out


def calibration_ids(tokenizer, sequences: int = 8, length: int = 256) -> list[list[int]]:
    """Token sequences from the end of pydoc_data.topics: a fixed English text,
    disjoint from the start of it that `brisk eval` scores."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))[-60_000:]
    ids = tokenizer.encode(text)
    return [ids[i * length:(i + 1) * length] for i in range(min(sequences, len(ids) // length))]


def _run_block(ropes, layer, x):
    """One block over a calibration sequence x (1, T, C): causal, with the
    layer's own window and RoPE table (Gemma 3's differ by layer)."""
    pos = torch.arange(x.shape[1], device=x.device)
    attention = layer.attention
    cos, sin = (t[pos] for t in ropes[attention.local_rope])
    return layer(x, cos, sin, visible(pos[:, None], pos[None, :], attention.window), pos)
