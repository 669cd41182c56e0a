"""Log-probabilities from the batch engine, on the tiny random-weight llama in fp32: each generated
token's entry is the log-softmax of the model's own logits at its position (a teacher-forced forward),
before temperature, filters and grammar masks; batched, sampled and through speculative verify rows
alike."""

from __future__ import annotations

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.runtime.batch import BatchEngine
from localllm.runtime.constrain import Constraints, json_schema
from localllm.runtime.sampling import SamplingParams
from tests.test_batch import BIG, GREEDY, prompt
from tests.test_speculate import PROMPTS, Flat


def check(lm, prompt_ids: list[int], tokens: list[int], entries, top: int) -> None:
    want = torch.log_softmax(BatchEngine(lm.model, kv_budget_bytes=BIG).forced_logits(prompt_ids, tokens), -1)
    assert [e.token for e in entries] == tokens
    for j, e in enumerate(entries):
        assert e.logprob == pytest.approx(want[j, e.token].item(), abs=1e-4)
        assert len(e.top) == top
        ids = [i for i, _ in e.top]
        assert [v for _, v in e.top] == pytest.approx(want[j, ids].tolist(), abs=1e-4)
        assert all(a[1] >= b[1] for a, b in zip(e.top, e.top[1:]))
        if top:
            assert e.top[0][1] == pytest.approx(want[j].max().item(), abs=1e-4)


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculated"])
def test_each_token_gets_the_models_own_log_probability(tiny_fp32, speculate):
    """Greedy and sampled (temperature 1.5, top-k 5: the entries ignore both) requests batched; with
    speculation the entries of accepted drafts come from their verify rows."""
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, speculate=speculate)
    if speculate:
        eng.costs = Flat()
    hot = SamplingParams(temperature=1.5, top_k=5, seed=2)
    asks = [(PROMPTS[2], GREEDY, 3), (PROMPTS[4], GREEDY, 0), (PROMPTS[1], hot, 20)]
    handles = [eng.submit(p, params, 24, logprobs=top) for p, params, top in asks]
    eng.run_until_done()
    for (p, _, top), h in zip(asks, handles):
        tokens = h.result()
        assert len(h.logprobs) == len(tokens) == 24
        check(tiny_fp32, p, tokens, h.logprobs, top)
    if speculate:
        assert eng.accepted_tokens > 0


def test_a_grammar_masks_sampling_not_the_log_probabilities(tiny_fp32):
    """A constrained reply's entries are the unmasked distribution: its tokens' log-probabilities as
    the model gives them, alternatives the grammar refused included."""
    constraints = Constraints(tiny_fp32.tokenizer, tiny_fp32.tokenizer.eos_ids)
    schema = json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    p = prompt(9, 7)
    h = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG).submit(p, GREEDY, 12, logprobs=5,
                                                          constraint=constraints.start(schema))
    tokens = h.result()
    check(tiny_fp32, p, tokens, h.logprobs, 5)
    first = h.logprobs[0]
    assert first.token == tiny_fp32.tokenizer.encode("{", add_special=False)[0]
    assert first.logprob < first.top[0][1]  # '{' was not the model's own first choice: the grammar's


def test_top_logprobs_out_of_range_is_refused(tiny_fp32):
    with pytest.raises(LocalLLMError, match="top logprobs 21 is out of range"):
        BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG).submit([5, 6], GREEDY, 2, logprobs=21)
