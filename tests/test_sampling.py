"""Sampling filters on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.runtime.sampling import SamplingParams, apply_repeat_penalty, filter_logits, sample

PROBS = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
LOGITS = PROBS.log()


def kept(params: SamplingParams) -> list[int]:
    return torch.isfinite(filter_logits(LOGITS, params))[0].nonzero().flatten().tolist()


def test_greedy_is_argmax():
    assert sample(torch.tensor([[0.1, 3.0, -1.0]]), SamplingParams(temperature=0)).tolist() == [1]


def test_top_k():
    assert kept(SamplingParams(temperature=1, top_k=2, top_p=1)) == [0, 1]


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(SamplingParams(temperature=1, top_k=0, top_p=0.7)) == [0, 1]
    assert kept(SamplingParams(temperature=1, top_k=0, top_p=0.71)) == [0, 1, 2]
    assert kept(SamplingParams(temperature=1, top_k=0, top_p=0.1)) == [0]  # the best always stays


def test_min_p_relative_to_the_best():
    assert kept(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.3)) == [0, 1, 2]


def test_temperature_sharpens():
    out = filter_logits(LOGITS, SamplingParams(temperature=0.5, top_k=0, top_p=1)).softmax(-1)
    assert out[0, 0] > 0.5 and math.isclose(out.sum().item(), 1.0, rel_tol=1e-6)


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_repeat_penalty(logits, torch.tensor([[0, 1]]), 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_sampling_follows_the_distribution():
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1, top_k=0, top_p=1)
    draws = torch.stack([sample(LOGITS, params, generator=g) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=5).float() / 4000
    torch.testing.assert_close(freq, PROBS[0], atol=0.03, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(min_p=1.0), dict(top_k=-1),
                                    dict(repeat_penalty=0)])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(LocalLLMError):
        SamplingParams(**kwargs)
