"""Logits -> next token, entirely on the device (no host synchronization).

Sampling draws Exponential(1) noise q and takes argmax(p / q): the index is
distributed as p (the "exponential race", equivalent to Gumbel-max), with no
torch.multinomial and so no device-to-host sync. Filters follow the usual
definitions: top-k keeps the k largest logits, top-p the smallest set whose
probability reaches p, min-p drops tokens below min_p times the top probability.

A step takes the settings as data, not as constants of its code: None for
greedy, else one (4,) tensor (`SamplingParams.on`) in which a filter that is
off holds its neutral value. Every filter always runs, so one compiled step
(or CUDA graph) serves every temperature, top-k, top-p and min-p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self):
        if not self.temperature >= 0:  # (NaN too)
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:  # (comparisons with NaN are false)
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def on(self, device) -> torch.Tensor | None:
        """The settings as a step takes them: None (greedy), or (4,) float32
        [temperature, top_k, top_p, min_p], an unset filter at its neutral value."""
        if self.greedy:
            return None
        top_p = self.top_p if self.top_p is not None and self.top_p < 1 else float("inf")
        values = [self.temperature, self.top_k or float("inf"), top_p, self.min_p or 0.0]
        return torch.tensor(values, dtype=torch.float32, device=device)


def as_settings(params, device) -> torch.Tensor | None:
    return params.on(device) if isinstance(params, SamplingParams) else params


def sorted_probs(logits: torch.Tensor, settings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., V) logits -> the probabilities after temperature and filters, in
    descending order of the logits, and that order (..., V)."""
    temperature, top_k, top_p, min_p = settings.unbind()
    logits, order = (logits.float() / temperature.clamp(min=1e-5)).sort(dim=-1, descending=True)
    # top-k keeps every logit equal to the k-th largest (ties included)
    kth = (top_k.clamp(max=logits.shape[-1]).long() - 1).expand(*logits.shape[:-1], 1)
    logits = logits.masked_fill(logits < logits.gather(-1, kth), -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    probs = probs.masked_fill(probs < min_p * probs[..., :1], 0.0)
    # top-p: keep a token if the mass strictly before it is below top_p (so the top one stays)
    probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


def logits_to_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities after temperature and filters
    (params: SamplingParams or its `on` tensor; not greedy)."""
    probs, order = sorted_probs(logits, as_settings(params, logits.device))
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def argmax(x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """x.argmax(-1) for (B, V), the same index (the first of equal maxima), in two
    stages: the largest value of each chunk of V, then the best chunk. Compiled,
    a plain argmax over a vocabulary is one program looping over the whole
    row; the chunks spread it over the GPU."""
    if x.shape[-1] <= chunk:
        return x.argmax(dim=-1)
    x = torch.nn.functional.pad(x, (0, -x.shape[-1] % chunk), value=-float("inf"))
    best, where = x.view(x.shape[0], -1, chunk).max(dim=-1)
    block = best.argmax(dim=-1, keepdim=True)
    return (block * chunk + where.gather(-1, block)).squeeze(-1)


def sample(logits: torch.Tensor, params) -> torch.Tensor:
    """(B, V) logits -> (B,) int token ids, on the logits' device. params:
    SamplingParams, or its `on` form (None: greedy)."""
    settings = as_settings(params, logits.device)
    if settings is None:
        return argmax(logits)
    probs, order = sorted_probs(logits, settings)
    return order.gather(-1, draw(probs)[:, None]).squeeze(-1)


def draw(probs: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities -> (B,) indices, each row's distributed as it (the exponential race)."""
    return argmax(probs / torch.empty_like(probs).exponential_(1))


def allowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bitmask (..., W) int32, bit t % 32 of word t // 32 set for an allowed
    token t (llguidance's layout, constrain.py) -> (..., vocab_size) bool, on the device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[..., None] >> shifts) & 1).flatten(-2)[..., :vocab_size].bool()


def masked(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits with the tokens the bitmask (..., W) forbids at -inf: the
    grammar's distribution once softmaxed (a speculative verify's rows, each under its own mask)."""
    return logits.masked_fill(~allowed_tokens(bits, logits.shape[-1]), -float("inf"))


def sample_allowed(logits: torch.Tensor, settings, bits: torch.Tensor) -> torch.Tensor:
    """sample() over the tokens a grammar allows: the others' logits are -inf
    before temperature and every filter, so top-k, top-p and min-p choose among
    allowed tokens only. The mask is data (a tensor), so one compiled step or
    CUDA graph serves every grammar."""
    return sample(masked(logits, bits), settings)
