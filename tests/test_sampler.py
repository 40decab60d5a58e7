"""Sampling: filters checked on hand-made distributions, seeding, and validation of parameters."""

import math

import pytest
import torch

from workbench.errors import RequestError
from workbench.model.sampler import Sampler, filter_logits
from workbench.request import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def kept(x: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(x)).flatten().tolist()


def test_top_k_keeps_the_k_largest():
    assert kept(filter_logits(LOGITS, 1.0, 2, 1.0)) == [0, 1]


@pytest.mark.parametrize(
    "top_p, expected",
    [(0.4, [0]), (0.5, [0]), (0.7, [0, 1]), (0.8, [0, 1]), (0.9, [0, 1, 2]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_smallest_nucleus_reaching_p(top_p, expected):
    # cumulative 0.5, 0.8, 0.95, 1.0: keep tokens until the mass before them reaches top_p
    assert kept(filter_logits(LOGITS, 1.0, 0, top_p)) == expected


def test_temperature_scales_logits():
    x = filter_logits(LOGITS, 2.0, 0, 1.0)
    torch.testing.assert_close(torch.softmax(x, -1), PROBS.sqrt() / PROBS.sqrt().sum())


def test_greedy_and_degenerate_filters_pick_argmax():
    logits = torch.randn(3, 50)
    s = Sampler()
    greedy = s(logits, [SamplingParams()] * 3, [0, 1, 2])
    topk1 = s(logits, [SamplingParams(temperature=1.0, top_k=1, seed=1)] * 3, [3, 4, 5])
    assert greedy == topk1 == logits.argmax(-1).tolist()


def test_seeded_requests_are_reproducible_whatever_the_batch():
    logits = torch.randn(4, 100)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [Sampler()(logits[2:3], [p], [0])[0] for _ in range(1)]
    batched = Sampler()(
        logits, [SamplingParams(), SamplingParams(temperature=0.5, seed=1), p, SamplingParams()], [9, 8, 0, 6]
    )
    assert batched[2] == alone[0]


def test_sampling_follows_the_distribution():
    # 4,000 seeded draws from PROBS: each frequency within 4 standard errors of its probability
    s, p = Sampler(), SamplingParams(temperature=1.0, seed=123)
    draws = [s(LOGITS[None], [p], [0])[0] for _ in range(4000)]
    for tok, prob in enumerate(PROBS.tolist()):
        freq = draws.count(tok) / len(draws)
        assert abs(freq - prob) < 4 * math.sqrt(prob * (1 - prob) / len(draws))


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"seed": "x"}, "seed")],
)  # fmt: skip
def test_invalid_parameters_are_rejected(kwargs, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)
