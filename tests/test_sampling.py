"""Sampling: greedy, temperature, top-k, top-p, min-p, seeds; all on the device."""
import pytest
import torch

from brisklm.sampling import SamplingParams, argmax, logits_to_probs, sample

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))
    assert torch.equal(sample(logits, SamplingParams(temperature=1.0, top_k=1)), logits.argmax(-1))


@pytest.mark.compile
@pytest.mark.parametrize("vocab", [50, 1024, 1025, 49152, 128256])
def test_chunked_argmax_equals_argmax_ties_included(vocab):
    """Two stages (chunk maxima, then the best chunk), the same index as one argmax, eager
    and compiled: the first of equal maxima, also across chunks and in bf16."""
    compiled = torch.compile(argmax, fullgraph=True, dynamic=False)
    for x in (torch.randn(3, vocab), torch.randn(2, vocab).bfloat16()):
        ties = torch.zeros_like(x)
        ties[:, [vocab // 3, vocab // 2, vocab - 1]] = 1.0
        for t in (x, ties, torch.zeros_like(x)):
            assert torch.equal(argmax(t), t.argmax(-1))
            if vocab in (1025, 128256):
                assert torch.equal(compiled(t), t.argmax(-1))


def test_temperature_one_keeps_the_distribution():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0))
    assert torch.allclose(probs, LOGITS.exp(), atol=1e-6)


def test_top_k_keeps_the_k_most_likely():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([[2 / 3, 1 / 3, 0, 0, 0]]), atol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed; the fourth is not.
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([[0.5, 0.25, 0.15, 0, 0]]) / 0.9, atol=1e-6)
    # A top_p below the first probability keeps the first token only.
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.1))
    assert torch.allclose(probs, torch.tensor([[1.0, 0, 0, 0, 0]]))


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # floor = 0.2 * 0.5 = 0.1: tokens at 0.07 and 0.03 go.
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.2))
    assert torch.allclose(probs, torch.tensor([[0.5, 0.25, 0.15, 0, 0]]) / 0.9, atol=1e-6)


def test_samples_follow_the_distribution():
    torch.manual_seed(0)
    logits = LOGITS.expand(20000, 5)
    counts = torch.bincount(sample(logits, SamplingParams(temperature=1.0)), minlength=5)
    freq = counts.float() / counts.sum()
    # 20000 draws: the standard error of each frequency is below 0.004.
    assert torch.allclose(freq, LOGITS.exp()[0], atol=0.015)


def test_same_seed_same_samples():
    logits = torch.randn(8, 1000)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    torch.manual_seed(123)
    a = sample(logits, params)
    torch.manual_seed(123)
    b = sample(logits, params)
    assert torch.equal(a, b)
    torch.manual_seed(124)
    assert not torch.equal(sample(logits, params), a)  # the noise is used


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(min_p=2.0)])
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
