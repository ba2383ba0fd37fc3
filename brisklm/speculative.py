"""Speculative decoding: a cheap drafter proposes K tokens, one target forward
over K+1 positions checks them all.

The target's forward over [current token, draft 1..K] gives its own
distribution at every one of those positions. Greedy: the drafts are kept
while they equal the target's choice, and the target's choice at the first
mismatch (or after the last draft) comes free. Sampling: draft token d,
proposed with probability q(d), is kept with probability min(1, p(d)/q(d));
at the first rejection the token is drawn from the residual max(0, p - q),
normalized, and after K kept drafts one more from p (Leviathan et al. 2023;
Chen et al. 2023). Either way the output is distributed as plain decoding's:
greedy, token for token. A deterministic drafter (prompt lookup) has a
one-hot q.

Keys and values are rolled back by position, not copied: the verify forward
writes them at every position it reads, and positions past the kept tokens
are written again before anything attends to them.

Drafters:
  NgramDrafter: prompt lookup, the continuation of the latest earlier
                occurrence of the last n tokens (n = 3 down to 1).
  ModelDrafter: a model run token by token, either the target's first
                `depth` layers with its final norm and output layer (sharing
                the target's weights and those layers' cache), or a smaller
                model of its own with its own cache.
"""
from __future__ import annotations

import torch

from .model import Transformer
from .sampling import SamplingParams, logits_to_probs, sample


class NgramDrafter:
    """Prompt lookup: no second model."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n

    def propose(self, history: list[int], k: int, params: SamplingParams, run=None):
        """Up to k tokens following history, and None (the proposal is one-hot)."""
        for n in range(min(self.max_n, len(history) - 1), 0, -1):
            tail = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):  # the latest occurrence first
                if history[start:start + n] == tail:
                    return history[start + n:start + n + k], None
        return [], None

    def kept(self, length: int):
        pass


class ModelDrafter:
    """Drafts by running `model` one token at a time.

    With depth (and model the target itself) it runs the first `depth` layers
    only: their keys and values at the positions it drafts are the ones the
    verify forward writes again for the same tokens, so the cache is shared
    and always current. A separate draft model keeps its own cache, and
    `cached` lists the tokens whose keys it holds."""

    def __init__(self, model: Transformer, depth: int | None = None):
        self.model, self.depth = model, depth
        self.shares_cache = depth is not None
        self.cached: list[int] = []

    def propose(self, history: list[int], k: int, params: SamplingParams, run):
        """k tokens after history (its last token not yet in any cache), and
        their proposal distributions (k, V) when sampling (None when greedy).
        run: Generator.logits, which replays the steps from CUDA graphs."""
        start = 0
        if self.shares_cache:
            start = len(history) - 1
        else:  # catch up from the longest prefix it holds
            limit = min(len(self.cached), len(history) - 1)
            while start < limit and self.cached[start] == history[start]:
                start += 1
        feed = history[start:]
        drafts, probs = [], []
        for _ in range(k):
            logits = run(feed, start, model=self.model, last=len(feed) - 1, depth=self.depth)[:, -1]
            if not params.greedy:
                probs.append(logits_to_probs(logits, params)[0])
            drafts.append(int(sample(logits, params)))
            start += len(feed)
            feed = drafts[-1:]
        self.cached = [*history, *drafts[:-1]]  # (the last draft's keys were never written)
        return drafts, (torch.stack(probs) if probs else None)

    def kept(self, length: int):
        """Only the first `length` positions hold tokens of the history now."""
        del self.cached[length:]


def accept(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params: SamplingParams) -> list[int]:
    """The tokens a verify step emits: the kept drafts and one more.

    logits (len(drafts) + 1, V): the target's at the current token and at
    each draft. q: the drafts' proposal distributions (None: one-hot)."""
    if params.greedy:
        target = sample(logits, params).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == target[kept]:
            kept += 1
        return drafts[:kept] + [target[kept]]
    p = logits_to_probs(logits, params)
    out = []
    for i, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[i, d])
        if float(torch.rand(())) * q_d < float(p[i, d]):  # kept with probability min(1, p/q)
            out.append(d)
            continue
        residual = p[i].clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (residual - q[i]).clamp(min=0)
        if float(residual.sum()) <= 0:  # (p == q: a rejection there has probability 0)
            residual = p[i]
        return out + [int(torch.multinomial(residual / residual.sum(), 1))]
    return out + [int(torch.multinomial(p[-1], 1))]
