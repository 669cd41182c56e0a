"""The generation API (runtime/engine.py's :class:`Engine`): a KV cache belongs to the sequence being
generated, not to the model: engines that share one model, run interleaved, each produce what a fresh
run alone produces, and each keeps its own prefix cache; a perplexity run on the same model meanwhile
changes nothing. fp32 tiny model: greedy is exact on one machine, and every expectation is a fresh run
on this machine, not hard-coded tokens."""

from __future__ import annotations

import pytest
import torch

from localllm.runtime.engine import Engine
from localllm.runtime.quality import compare
from localllm.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, seed=7)


def fresh(lm, prompt: list[int], params: SamplingParams, n: int, ctx: int = 96) -> list[int]:
    return list(Engine(lm.model, lm.tokenizer, ctx).generate_ids(prompt, params, max_tokens=n, stop_ids=()))


def gen(lm, ctx: int) -> Engine:
    return Engine(lm.model, lm.tokenizer, ctx)


def interleave(*streams) -> list[list[int]]:
    """Alternate next() over the iterators until all are done; the tokens of each."""
    out: list[list[int]] = [[] for _ in streams]
    live = dict(enumerate(streams))
    while live:
        for i, it in list(live.items()):
            try:
                out[i].append(next(it))
            except StopIteration:
                del live[i]
    return out


def test_interleaved_engines_on_one_model_match_fresh_runs(tiny_fp32):
    p1, p2 = [5, 17, 42, 99, 3, 8], [200, 11, 64]
    want1, want2 = fresh(tiny_fp32, p1, GREEDY, 24), fresh(tiny_fp32, p2, SAMPLED, 20, ctx=64)
    a, b = gen(tiny_fp32, 96), gen(tiny_fp32, 64)  # different lengths too
    got1, got2 = interleave(a.generate_ids(p1, GREEDY, 24, ()), b.generate_ids(p2, SAMPLED, 20, ()))
    assert got1 == want1 and got2 == want2
    assert len(set(want1)) > 3  # not a degenerate repetition that any cache would give

    # A follow-up on each reuses its own cached prefix (its full blocks), though the other ran in between.
    f1, f2 = p1 + got1 + [33, 34], p2 + got2[:-1] + [77]
    got_f1, got_f2 = interleave(a.generate_ids(f1, GREEDY, 12, ()), b.generate_ids(f2, GREEDY, 12, ()))
    assert a.stats.cached_tokens == 16 and b.stats.cached_tokens == 16  # 16-token blocks
    assert got_f1 == fresh(tiny_fp32, f1, GREEDY, 12) and got_f2 == fresh(tiny_fp32, f2, GREEDY, 12, ctx=64)


def test_interleaved_engines_match_fresh_runs(tiny_fp32):
    texts = ["the cat sat", "zebra 42 quux"]
    want = ["".join(Engine(tiny_fp32.model, tiny_fp32.tokenizer, 128).complete(t, GREEDY, max_tokens=16))
            for t in texts]
    e1, e2 = Engine(tiny_fp32.model, tiny_fp32.tokenizer, 128), Engine(tiny_fp32.model, tiny_fp32.tokenizer, 128)
    got = interleave(e1.complete(texts[0], GREEDY, max_tokens=16), e2.complete(texts[1], GREEDY, max_tokens=16))
    assert ["".join(g) for g in got] == want
    assert want[0] != want[1]


def test_quality_compare_beside_a_live_generation(tiny_fp32):
    prompt = [9, 8, 7, 6, 5]
    want = fresh(tiny_fp32, prompt, GREEDY, 20)
    stream = gen(tiny_fp32, 96).generate_ids(prompt, GREEDY, 20, ())
    got = [next(stream) for _ in range(7)]
    ids = torch.randint(3, tiny_fp32.config.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    q = compare(tiny_fp32.model, {"same": tiny_fp32.model}, ids, window=32)["same"]
    assert q.kld == pytest.approx(0.0, abs=1e-6) and q.top1 == 1.0
    got += list(stream)
    assert got == want


def test_the_model_holds_no_cache(tiny_fp32):
    engine = gen(tiny_fp32, 64)
    list(engine.generate_ids([5, 6, 7], GREEDY, 4, ()))
    names = [n for n, _ in tiny_fp32.model.named_buffers()] + [n for n, _ in tiny_fp32.model.named_parameters()]
    assert not [n for n in names if "cache" in n or "pool" in n]
    assert engine.batch.usage()["blocks_cached"] == 0  # 7 positions: no full block to keep


def test_a_reply_cut_short_frees_its_sequence_for_the_next(tiny_fp32):
    """A caller that stops reading (a stop string, a closed stream) leaves no sequence behind in the
    engine's pool or its one slot: the next reply runs, and as it runs in a fresh engine."""
    engine = Engine(tiny_fp32.model, tiny_fp32.tokenizer, 96)
    params = SamplingParams(temperature=0)
    tokens = engine.generate_ids([5, 6, 7, 8], params, max_tokens=20, stop_ids=())
    next(tokens)
    tokens.close()
    assert not engine.batch.scheduler.running and not engine.batch.has_work
    assert engine.batch.usage()["blocks_used"] == 0, engine.batch.usage()
    got = list(engine.generate_ids([9, 10, 11], params, max_tokens=5, stop_ids=()))
    assert got == list(Engine(tiny_fp32.model, tiny_fp32.tokenizer, 96).generate_ids([9, 10, 11], params, 5, ()))
