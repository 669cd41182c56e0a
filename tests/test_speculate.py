"""Speculative decoding (n-gram prompt lookup) in the batch engine, on the tiny random-weight llama:
the tokens are the tokens without it, greedy and seeded, alone and batched, through preemption and
stops; rejected draft rows are never keyed into the prefix cache; the proposer and the cost model
decide as they say.

Engines here draft whenever a proposal exists (:class:`Flat` step costs: extra rows cost nothing),
so that verification, not the cost model, is what runs.
"""

from __future__ import annotations

import pytest
import torch

from localllm.runtime.batch import BatchEngine
from localllm.runtime.block_manager import BlockManager
from localllm.runtime.engine import Engine
from localllm.runtime.kv_pool import block_bytes
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.speculate import NgramIndex, Proposal, StepCosts, plan_drafts
from tests import engines
from tests.test_batch import BIG, GREEDY, assert_same, prompt


class Flat(StepCosts):
    """Every decode step costs the same, however many rows: any draft pays."""

    def estimate(self, rows: int) -> float | None:
        return 1.0


def copying(seed: int, n: int, repeat: int) -> list[int]:
    """A prompt whose end repeats an earlier span (a proposal as soon as the reply goes on copying)."""
    p = prompt(seed, n)
    return p + p[:repeat]


PROMPTS = [prompt(1, 3), prompt(2, 17), copying(3, 40, 12), prompt(4, 64), copying(5, 30, 30)]
MAX_TOKENS = [40, 25, 40, 30, 35]


def drafting(model, **kwargs) -> BatchEngine:
    eng = BatchEngine(model, **{"kv_budget_bytes": BIG, **kwargs})
    eng.costs = Flat()
    return eng


def test_the_index_proposes_what_followed_the_latest_longest_match():
    ix = NgramIndex()
    tokens = [5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3]
    assert ix.propose(tokens, 3) == ([7, 8, 4], 3)  # the latest (1, 2, 3), not the first
    assert ix.propose(tokens + [7, 6], 4) == ([], 0)  # (3, 7, 6) never occurred, nor (7, 6)
    assert ix.propose([*tokens, 7, 6, 2, 3], 2) == ([7, 6], 2)  # (2, 3): what followed its latest match
    assert ix.propose([1, 2], 4) == ([], 0)  # nothing before the suffix itself


def test_drafts_go_where_they_pay():
    measured = StepCosts()
    for rows, t in [(1, 10.0), (2, 10.5), (3, 11.0), (4, 11.5), (5, 14.0), (8, 20.0), (9, 22.5), (10, 25.0)]:
        for _ in range(StepCosts.TRUSTED):
            measured.record(rows, t)
    likely, unlikely = Proposal([1, 2, 3, 4], 3, 0.9), Proposal([1, 2, 3], 2, 0.02)
    assert plan_drafts([likely], measured) == [3]  # the 4th row costs more than a 0.66 chance returns
    assert plan_drafts([unlikely], measured) == [0]
    assert plan_drafts([None], measured) == [0]
    # 8 sequences: a row costs 2.5, as much as a token's share of the step (20 / 8): nothing pays
    assert plan_drafts([likely] * 8, measured) == [0] * 8
    assert plan_drafts([likely], StepCosts()) == [0]  # no decode step measured yet: measure one first


def test_greedy_tokens_are_the_tokens_without_speculation(tiny_fp32):
    """Five requests batched, drafting wherever a proposal exists: each one's tokens are its tokens
    alone one per step (every step decided), drafts were verified and some accepted, and every block
    is back."""
    eng = drafting(tiny_fp32.model)
    handles = [eng.submit(p, GREEDY, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    eng.run_until_done()
    for p, n, h in zip(PROMPTS, MAX_TOKENS, handles):
        assert_same(tiny_fp32, p, h.result(), engines.reference(tiny_fp32.model, p, GREEDY, n))
    assert eng.drafted_tokens > 20 and 0 < eng.accepted_tokens < eng.drafted_tokens  # both branches ran
    assert eng.steps < sum(MAX_TOKENS)  # some steps added several tokens
    assert sum(h.stats.accepted_tokens for h in handles) == eng.accepted_tokens
    eng.blocks.check()
    assert eng.usage()["blocks_used"] == 0


# Low temperatures: the random model's replies then repeat themselves, so drafts get accepted too.
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.1, top_k=0, top_p=1.0, seed=3),
                                    SamplingParams(temperature=0.15, top_k=20, top_p=0.9, repeat_penalty=1.05, seed=11),
                                    SamplingParams(temperature=0, repeat_penalty=1.1)],
                         ids=["plain", "filtered-penalised", "greedy-penalised"])
def test_seeded_tokens_are_the_tokens_without_speculation(tiny_fp32, params):
    """A draw is fixed by the seed and the position (runtime.sampling.unit_random), so a verified draft
    keeps a token exactly when sampling it alone would have picked it: the same tokens, not only the
    same distribution, with the repeat penalty's window moving over accepted drafts."""
    eng = drafting(tiny_fp32.model)
    handles = [eng.submit(p, params, 30) for p in PROMPTS]
    eng.run_until_done()
    for p, h in zip(PROMPTS, handles):
        assert h.result() == engines.reference(tiny_fp32.model, p, params, 30)
    assert eng.drafted_tokens > 0 and eng.accepted_tokens > 0


def test_a_stop_id_inside_accepted_drafts_ends_there(tiny_fp32):
    p = PROMPTS[4]
    want = engines.reference(tiny_fp32.model, p, GREEDY, 35)
    stop = next(t for t in want[8:] if want.count(t) > 1)  # a token the model repeats: it is drafted
    eng = drafting(tiny_fp32.model)
    h = eng.submit(p, GREEDY, 35, stop_ids=[stop])
    assert h.result() == want[: want.index(stop)] and h.stats.finish_reason == "stop"
    assert eng.usage()["blocks_used"] == 0


def test_a_stop_string_inside_accepted_drafts_cuts_the_text(tiny_fp32):
    """Several tokens in one step still stream one piece each: the text stops where the stop string
    starts, as without speculation, and the sequence's blocks are freed."""
    tok = tiny_fp32.tokenizer
    p = prompt(3, 20)  # its greedy reply runs into "(((((": drafts accepted across the stop string
    plain = Engine(tiny_fp32.model, tok, ctx=256, speculate=False)
    text = "".join(plain.stream_ids(p, GREEDY, 35))
    stop = "((("
    assert stop in text
    fast = Engine(tiny_fp32.model, tok, ctx=256)
    fast.batch.costs = Flat()
    got = "".join(fast.stream_ids(p, GREEDY, 35, stop=[stop]))
    assert got == text[: text.index(stop)] and fast.stats.stop_string
    assert fast.stats.drafted_tokens > 0
    assert fast.batch.usage()["blocks_used"] == 0


def test_preempted_sequences_with_drafts_keep_their_tokens(tiny_fp32):
    """A pool of 8 blocks for requests needing far more: drafts never take a block another sequence
    needs (they are dropped instead), preempted sequences lose theirs, and every request's tokens are
    its tokens alone."""
    budget = 8 * block_bytes(tiny_fp32.config, 16, torch.float32)
    eng = drafting(tiny_fp32.model, kv_budget_bytes=budget, chunk_tokens=32)
    handles = [eng.submit(p, GREEDY, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    eng.run_until_done()
    assert eng.scheduler.preemptions > 0 and eng.drafted_tokens > 0
    for p, n, h in zip(PROMPTS, MAX_TOKENS, handles):
        assert_same(tiny_fp32, p, h.result(), engines.reference(tiny_fp32.model, p, GREEDY, n))
    eng.blocks.check()
    assert eng.usage()["blocks_used"] == 0


def test_rejected_drafts_are_never_keyed_into_the_prefix_cache(tiny_fp32, monkeypatch):
    """Every token run a block was keyed with is a token the sequence kept; and a prompt served from
    those cached blocks gets the logits a fresh engine computes."""
    keyed: list[tuple[int, list[int]]] = []  # (sequence's table, tokens it was keyed with)
    commit = BlockManager.commit

    def spy(self, table, token_ids, computed):
        keyed.append((id(table), list(token_ids[:computed])))
        return commit(self, table, token_ids, computed)

    monkeypatch.setattr(BlockManager, "commit", spy)
    eng = drafting(tiny_fp32.model)
    handles = [eng.submit(p, GREEDY, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    eng.run_until_done()
    assert eng.drafted_tokens > eng.accepted_tokens  # some drafts were rejected
    final = {id(h._seq.table): h._seq.token_ids for h in handles}
    for table, tokens in keyed:
        assert final[table][: len(tokens)] == tokens
    whole = PROMPTS[2] + handles[2].result()
    cached = eng.forced_logits(whole[:-4], whole[-4:])
    fresh = engines.forced(tiny_fp32.model, whole[:-4], whole[-4:])
    torch.testing.assert_close(cached, fresh, rtol=0, atol=1e-5)
