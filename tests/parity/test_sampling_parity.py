"""Sampling parity: nanosft.model.sample_next_token against transformers' logits processors.

Compared: the next-token distribution nanosft samples from (the probabilities handed to
torch.multinomial) against softmax of transformers' TemperatureLogitsWarper -> TopKLogitsWarper ->
TopPLogitsWarper (the order GenerationMixin._get_logits_processor applies them) at ordinary values
(T = 0.7, k = 5, p = 0.9 and neighbours), exactly; then 20,000 seeded draws against transformers'
own draw (torch.multinomial on its probabilities under the same seed: the same ids) and against the
distribution itself (no filtered token drawn, each frequency within 5 standard errors). Negative
control: the distribution at T differs from the one at 1 / T, so a temperature that multiplies
instead of divides cannot pass. Hermetic: random logits, CPU, fp32.
Run: python -m pytest -q tests/parity/test_sampling_parity.py
"""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nanosft.model import sample_next_token

V = 50
CASES = [(0.7, 5, 0.9), (0.7, None, None), (1.3, None, 0.9), (0.7, 5, None), (0.5, 20, 0.8)]


def make_logits(rows=4, seed=0):
    return 3.0 * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def transformers_probs(logits, temperature, top_k, top_p):
    """softmax of the scores transformers' sampling path feeds torch.multinomial."""
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k is not None:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        processors.append(TopPLogitsWarper(top_p))
    scores = processors(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone())
    return scores.softmax(-1)


def nanosft_probs(logits, temperature, top_k, top_p, monkeypatch):
    """The probabilities sample_next_token passes to torch.multinomial (recorded, then sampled)."""
    seen = []
    multinomial = torch.multinomial

    def record(probs, *args, **kwargs):
        seen.append(probs.clone())
        return multinomial(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", record)
    sample_next_token(logits.clone(), temperature, top_k, top_p)
    monkeypatch.setattr(torch, "multinomial", multinomial)
    assert len(seen) == 1, "sample_next_token no longer samples with one torch.multinomial call"
    return seen[0]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_filtered_distribution_equals_transformers_processors(
    temperature, top_k, top_p, monkeypatch
):
    logits = make_logits()
    ours = nanosft_probs(logits, temperature, top_k, top_p, monkeypatch)
    theirs = transformers_probs(logits, temperature, top_k, top_p)
    # The same float operations in the same order: equal to the last bit.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    kept = (theirs > 0).sum(-1)
    if top_k is not None:
        assert (kept <= top_k).all()
    if top_k is None and top_p is None:
        assert (kept == V).all()  # temperature alone filters nothing


def test_temperature_divides_the_logits():
    # negative control: a multiplied temperature (T -> 1/T) gives another distribution, so the exact
    # comparison above would catch it; and T < 1 sharpens (the top probability grows).
    logits = make_logits()
    sharp = transformers_probs(logits, 0.7, None, None)
    flat = transformers_probs(logits, 1 / 0.7, None, None)
    assert (sharp - flat).abs().max() > 1e-2
    assert (sharp.max(-1).values > logits.softmax(-1).max(-1).values).all()


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 0.9), (1.3, None, 0.9)])
def test_many_seeded_draws_match_transformers_and_the_distribution(temperature, top_k, top_p):
    n = 20_000
    row = make_logits(rows=1, seed=3)
    probs = transformers_probs(row, temperature, top_k, top_p)[0]
    torch.manual_seed(123)
    ours = sample_next_token(row.expand(n, V).clone(), temperature, top_k, top_p)
    torch.manual_seed(123)
    # transformers' own draw (GenerationMixin._sample): multinomial over the processed softmax
    theirs = torch.multinomial(probs.expand(n, V), 1)[:, 0]
    assert torch.equal(ours, theirs)
    counts = torch.bincount(ours, minlength=V).double()
    assert counts[probs == 0].sum() == 0  # a filtered token is never drawn
    freq, p = counts / n, probs.double()
    stderr = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * stderr + 1e-12).all(), (freq - p).abs().max()
    assert (probs > 0).sum() >= 3  # ordinary values: several candidates remain, not greedy
