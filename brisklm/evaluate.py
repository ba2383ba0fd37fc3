"""Quality numbers: perplexity on a fixed text, and KL divergence against a reference model.

The default text is the English of Python's own `pydoc_data.topics` (present
in every CPython), a fixed slice, scored in fixed non-overlapping windows, so
figures compare across machines and runs. Perplexity is exp(mean negative
log-likelihood of each next token); KL is the mean over positions of
KL(reference || model) over the full vocabulary (the quantity llama.cpp's
perplexity tool reports as "Mean KLD").
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def default_text(chars: int = 60_000) -> str:
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text[:chars]


def _window_logits(model, ids: torch.Tensor, window: int):
    """Yield (logits (W, V) fp32, targets (W,)) for each window of ids."""
    model.setup_caches(1, window)  # the kind of cache (int8 or not) the model has
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start:start + window + 1]
        if chunk.numel() < 2:
            break
        x = chunk[:-1].to(model.tok_embeddings.weight.device)
        with torch.no_grad():
            logits = model(x[None], torch.arange(x.numel(), device=x.device), kv_len=x.numel())
        yield logits[0].float().cpu(), chunk[1:]


def negative_log_likelihood(model, ids: torch.Tensor, window: int = 512) -> tuple[float, int]:
    """(sum of -log p(ids[i] | the window's ids before i), count) over ids[1:]."""
    nll, count = 0.0, 0
    for logits, targets in _window_logits(model, ids, window):
        nll += F.cross_entropy(logits, targets, reduction="sum").item()
        count += targets.numel()
    return nll, count


def perplexity(model, ids: torch.Tensor, window: int = 512) -> float:
    nll, count = negative_log_likelihood(model, ids, window)
    return math.exp(nll / count)


def perplexity_and_kl(model, reference, ids: torch.Tensor, window: int = 512):
    """(perplexity of model, perplexity of reference, mean KL(reference || model))."""
    nll = nll_ref = kl = 0.0
    count = 0
    for (logits, targets), (ref, _) in zip(_window_logits(model, ids, window),
                                           _window_logits(reference, ids, window)):
        logp, logq = ref.log_softmax(-1), logits.log_softmax(-1)
        nll += F.nll_loss(logq, targets, reduction="sum").item()
        nll_ref += F.nll_loss(logp, targets, reduction="sum").item()
        kl += (logp.exp() * (logp - logq)).sum().item()
        count += targets.numel()
    return math.exp(nll / count), math.exp(nll_ref / count), kl / count
