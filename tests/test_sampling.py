"""Sampling filters on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.runtime.sampling import (CHUNKED_VOCAB, SamplingParams, apply_repeat_penalty, filter_logits, greedy,
                                       sample, top_k, unit_random)

PROBS = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
LOGITS = PROBS.log()


def kept(params: SamplingParams) -> list[int]:
    return torch.isfinite(filter_logits(LOGITS, params))[0].nonzero().flatten().tolist()


def test_greedy_is_argmax():
    assert sample(torch.tensor([[0.1, 3.0, -1.0]]), SamplingParams(temperature=0)).tolist() == [1]


def test_greedy_takes_the_first_of_tied_maxima_over_a_large_vocabulary():
    """The CPU pick (max, not argmax) breaks ties as argmax does, across vector widths and rows."""
    logits = torch.zeros(3, 262144)
    logits[0, [70001, 5, 200000]] = 2.0
    logits[1, [131071, 131072]] = 1.0
    logits[2] = -1.0  # every token tied
    assert greedy(logits).tolist() == logits.argmax(-1).tolist() == [5, 131071, 0]


def test_greedy_with_a_tail_past_the_last_chunk():
    """A vocabulary that is not a whole number of chunks: the tail's best wins when larger, the
    chunk's (the lower id) when tied."""
    V = 151_936 + 77
    logits = torch.zeros(3, V)
    logits[0, V - 3] = 1.0
    logits[1, [V - 3, 4000]] = 1.0
    assert greedy(logits).tolist() == logits.argmax(-1).tolist() == [V - 3, 4000, 0]


def test_greedy_takes_a_nan_or_an_all_minus_inf_row_as_argmax_does():
    """The CPU kernel (a vocabulary of 64k tokens or more) picks the first NaN where a row has one (a
    broken model is not hidden behind a token), and token 0 of a row every token of which a mask
    refused; parts of rows on any number of threads."""
    V = 200_003
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    logits[0, [150_000, 7]] = float("nan")
    logits[1] = float("-inf")
    logits[2, [V - 1, 16384]] = 50.0  # tied in two parts of the row: the first
    logits[3, 16383] = 50.0  # the last value of a part
    assert greedy(logits).tolist() == logits.argmax(-1).tolist() == [7, 0, 16384, 16383]


def test_top_k():
    assert kept(SamplingParams(temperature=1, top_k=2, top_p=1)) == [0, 1]


def test_top_k_over_a_large_vocabulary_is_torch_topk():
    """The chunked search (a vocabulary of 64k tokens or more, on the CPU) finds what torch.topk
    finds in every row of a batch: with a tail past the last whole chunk, the best token in it, and a
    stretch of filtered (-inf) tokens."""
    V = 151_936 + 77
    assert V >= CHUNKED_VOCAB
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 4
    logits[1, V - 5] = 50.0
    logits[2, :1000] = float("-inf")
    values, ids = top_k(logits, 40)
    ref = torch.topk(logits, 40, dim=-1)
    assert torch.equal(values, ref.values) and torch.equal(ids, ref.indices)
    assert ids[1, 0].item() == V - 5


def test_top_k_puts_the_lower_id_first_among_equal_values():
    logits = torch.rand(2, 262_144, generator=torch.Generator().manual_seed(1)) - 1.0  # in [-1, 0)
    tied = [200_000, 7, 70_001, 131_072, 262_143, *range(1000, 1000 + 60 * 257, 257)]
    logits[0, tied] = 3.0
    logits[1, [100_000, 9]] = 5.0
    logits[1, [262_000, 8, 99_999]] = 4.0
    values, ids = top_k(logits, 40)
    assert ids[0].tolist() == sorted(tied)[:40] and bool((values[0] == 3.0).all())
    assert ids[1, :5].tolist() == [9, 100_000, 8, 99_999, 262_000]


def test_top_k_with_fewer_finite_values_than_k():
    """A grammar's mask can leave fewer allowed tokens than k: they come first, the rest are -inf."""
    logits = torch.full((1, 131_072), float("-inf"))
    logits[0, [5, 70_000, 9]] = torch.tensor([1.0, 3.0, 2.0])
    values, ids = top_k(logits, 40)
    assert ids[0, :3].tolist() == [70_000, 9, 5] and bool(torch.isinf(values[0, 3:]).all())


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


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampling_follows_the_distribution(top_k):
    """Inverse-CDF draws at 4,000 positions of one seed: each token as often as its probability
    (after top-k: renormalised over the kept ones), one row at a time and all rows at once alike."""
    params = SamplingParams(temperature=1, top_k=top_k, top_p=1)
    u = torch.tensor([unit_random(3, pos) for pos in range(4000)], dtype=torch.float64)
    draws = sample(LOGITS.expand(4000, -1), params, u)
    assert draws.tolist()[:50] == [int(sample(LOGITS, params, u[i : i + 1])) for i in range(50)]
    want = filter_logits(LOGITS, params).softmax(-1)[0]
    freq = torch.bincount(draws, minlength=5).float() / 4000
    torch.testing.assert_close(freq, want, atol=0.03, rtol=0)
    assert freq[3:].sum() == 0 or top_k == 0  # a filtered token is never drawn


def test_a_draw_is_fixed_by_seed_and_position():
    assert unit_random(7, 12) == unit_random(7, 12)
    assert len({unit_random(7, p) for p in range(1000)} | {unit_random(8, p) for p in range(1000)}) == 2000
    draws = [unit_random(seed, p) for seed in range(20) for p in range(500)]
    assert 0 <= min(draws) and max(draws) < 1 and abs(sum(draws) / len(draws) - 0.5) < 0.01


def test_a_draw_at_the_top_of_the_cdf_never_picks_a_filtered_token():
    params = SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.25)  # tokens 3 and 4 filtered out
    u = torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)
    assert sample(LOGITS.expand(2, -1), params, u).tolist() == [0, 2]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(min_p=1.0), dict(top_k=-1),
                                    dict(repeat_penalty=0)])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(LocalLLMError):
        SamplingParams(**kwargs)
