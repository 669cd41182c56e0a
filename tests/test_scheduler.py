"""The scheduler alone (no model): admission against blocks, chunked prefill within a budget, one decode
token per running sequence, preemption of the youngest, refusal of what can never fit, a bounded queue.
A fake step stands in for the model: every sampling chunk 'generates' token 1000 + its sequence id."""

from __future__ import annotations

import pytest

from localllm.errors import LocalLLMError
from localllm.runtime.block_manager import BlockManager
from localllm.runtime.scheduler import EngineBusy, Scheduler, Sequence, Status

BS = 4


def seq(i: int, prompt_len: int, max_len: int = 64, first: int = 0) -> Sequence:
    return Sequence(i, prompt_len, list(range(first, first + prompt_len)), max_len)


def step(s: Scheduler) -> list[tuple[int, int, int]]:
    """Schedule, 'run' and record a step: its (seq id, start, length) chunks."""
    plan = s.schedule()
    s.computed(plan.chunks)
    for c in plan.chunks:
        if c.samples:
            c.seq.token_ids.append(1000 + c.seq.id)
    s.blocks.check()
    return [(c.seq.id, c.start, c.length) for c in plan.chunks]


def test_prompts_are_prefilled_in_chunks_beside_decodes():
    s = Scheduler(BlockManager(32, BS), chunk_tokens=8)
    s.add(seq(0, 3))
    assert step(s) == [(0, 0, 3)]  # a short prompt whole
    s.add(seq(1, 20, first=100))
    assert step(s) == [(0, 3, 1), (1, 0, 8)]  # decode token + first chunk (the budget)
    assert step(s) == [(0, 4, 1), (1, 8, 8)]
    assert step(s) == [(0, 5, 1), (1, 16, 4)]  # the rest; seq 1 samples its first token
    assert s.running[1].token_ids[-1] == 1001
    assert step(s) == [(0, 6, 1), (1, 20, 1)]  # both decoding


def test_a_step_counts_its_prompt_tokens_apart_from_its_decodes():
    s = Scheduler(BlockManager(32, BS), chunk_tokens=8)
    s.add(seq(0, 3))
    plan = s.schedule()
    assert plan.prefill_tokens == 3 and not plan.chunks[0].decodes
    s.computed(plan.chunks)
    s.running[0].token_ids.append(1000)
    s.add(seq(1, 20, first=100))
    plan = s.schedule()  # seq 0's decode token beside seq 1's first chunk
    assert [c.decodes for c in plan.chunks] == [True, False]
    assert plan.num_tokens == 9 and plan.prefill_tokens == 8


def test_budget_is_shared_in_arrival_order():
    s = Scheduler(BlockManager(32, BS), chunk_tokens=10)
    for i in range(3):
        s.add(seq(i, 7, first=10 * i))
    assert step(s) == [(0, 0, 7), (1, 0, 3)]  # seq 2 waits: no budget left
    assert [q.id for q in s.waiting] == [2]
    assert step(s) == [(0, 7, 1), (1, 3, 4), (2, 0, 6)]


def test_admission_waits_for_blocks_and_max_running():
    s = Scheduler(BlockManager(5, BS), chunk_tokens=64, max_running=8)
    s.add(seq(0, 12))  # 3 blocks
    s.add(seq(1, 12, first=50))  # 3 more: only 2 left
    assert step(s) == [(0, 0, 12)] and len(s.waiting) == 1
    s.finish(s.running[0])
    assert s.blocks.num_used == 0
    assert step(s) == [(1, 0, 12)]

    s = Scheduler(BlockManager(50, BS), max_running=2)
    for i in range(3):
        s.add(seq(i, 2, first=10 * i))
    assert [c[0] for c in step(s)] == [0, 1]


def test_the_youngest_is_preempted_and_recomputed_with_its_tokens():
    s = Scheduler(BlockManager(4, BS), chunk_tokens=64)
    s.add(seq(0, 4))  # 1 block each, full: each needs a new block for its first decode
    s.add(seq(1, 7, first=100))  # 2 blocks
    s.add(seq(2, 3, first=200))  # 1 block: the pool is full
    assert step(s) == [(0, 0, 4), (1, 0, 7), (2, 0, 3)]
    # seq 0 needs a 2nd block: the youngest (2) goes; seq 1's 8th token still fits its 2nd block
    plan = step(s)
    assert plan == [(0, 4, 1), (1, 7, 1)]
    assert [q.id for q in s.waiting] == [2] and s.preemptions == 1
    victim = s.waiting[0]
    assert victim.status is Status.WAITING and victim.computed == 0
    assert victim.token_ids == [200, 201, 202, 1002]  # its generated token stays, as prompt now
    s.finish(s.running[0])
    s.finish(s.running[0])
    assert step(s) == [(2, 0, 4)]  # recomputed: prompt + the token it had, then it samples on
    assert victim.token_ids[-1] == 1002 and len(victim.token_ids) == 5


def test_a_decode_preempts_itself_when_it_is_the_youngest():
    s = Scheduler(BlockManager(2, BS), chunk_tokens=64)
    s.add(seq(0, 3))
    s.add(seq(1, 4, first=100))
    assert step(s) == [(0, 0, 3), (1, 0, 4)]
    assert step(s) == [(0, 3, 1)]  # seq 1 needs a block; it is the youngest: it goes
    assert [q.id for q in s.waiting] == [1]
    assert step(s) == [(0, 4, 1)]  # seq 0 needs its 2nd block: seq 1's (its full block stays cached)


def test_preempted_full_blocks_come_back_from_the_cache():
    s = Scheduler(BlockManager(6, BS), chunk_tokens=64)
    s.add(seq(0, 8))
    s.add(seq(1, 12, first=100))  # 3 blocks, all full: the pool is 5/6 used
    step(s)
    step(s)  # seq 0 takes block 6 for its 9th token; seq 1 needs one more and preempts itself
    assert [q.id for q in s.waiting] == [1]
    s.finish(s.running[0])  # seq 0 leaves: its full blocks are cached, the partial one freed
    step(s)
    victim = s.running[0]
    assert victim.id == 1 and victim.computed == 13 and victim.stats.cached_tokens == 0
    assert s.blocks.hit_tokens == 12  # its 3 full blocks were found again: only the last token recomputed


def test_requests_that_can_never_fit_are_refused_with_numbers():
    s = Scheduler(BlockManager(4, BS))
    with pytest.raises(LocalLLMError, match=r"the prompt is 16 tokens and the context holds 16 \(prompt and "
                                            r"reply together; the KV pool has 4 blocks x 4 tokens = 16\)"):
        s.add(seq(0, 16, max_len=16))
    with pytest.raises(LocalLLMError, match="the prompt is empty"):
        s.add(seq(1, 0))
    s.add(seq(2, 15, max_len=16))  # prompt + 1 fits


def test_a_full_queue_says_busy():
    s = Scheduler(BlockManager(4, BS), max_waiting=2, max_running=1)
    for i in range(3):  # one for the free slot (taken at the next step), two queued behind it
        s.add(seq(i, 1))
    with pytest.raises(EngineBusy, match="2 requests are already waiting; retry after 1 s") as e:
        s.add(seq(3, 1))
    assert isinstance(e.value, LocalLLMError) and e.value.retry_after_s == 1.0
    step(s)  # seq 0 runs; 1 and 2 still wait for its slot
    with pytest.raises(EngineBusy):
        s.add(seq(4, 1))
    s.finish(s.running[0])
    s.add(seq(5, 1))  # the freed slot makes room


def test_finish_frees_blocks_of_running_and_waiting():
    s = Scheduler(BlockManager(8, BS), chunk_tokens=4)
    s.add(seq(0, 10))
    s.add(seq(1, 3, first=100))
    step(s)  # seq 0 admitted with all its blocks, prefilling; seq 1 waits (budget)
    assert s.blocks.num_used == 3
    s.finish(s.waiting[0])
    s.finish(s.running[0])
    assert s.blocks.num_used == 0 and not s.has_work
