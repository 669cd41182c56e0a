"""The batch engine on tiny random-weight models: a request's greedy tokens in a batch are its tokens
alone (the plainest loop: a whole cache-less forward per token, tests/engines.py), whatever joins and
leaves beside it, with chunked prefill, with
preemption, with prefix-cache hits; refusals, the busy queue, cancellation, stop ids, the context
limit, seeded sampling and the background thread.

Exactness: on the fp32 path (float weights, or int4 weights with fp32 activations) batched and alone
logits differ by float rounding only (~1e-6: other matmul shapes), so the greedy tokens are equal
wherever the alone run's margin (best minus second-best logit, checked by teacher forcing) is wide;
each comparison first checks that every margin it relies on is at least DECIDED. On the bf16 path
(int4 weights, bf16 activations) the tie rule of :func:`assert_same_or_tie` applies.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.loaders.load import load_model
from localllm.runtime.batch import BatchEngine
from localllm.runtime.kv_pool import block_bytes
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.scheduler import EngineBusy
from tests import engines

GREEDY = SamplingParams(temperature=0)
#: A greedy step is decided when its margin is this wide: far above fp32 rounding differences.
DECIDED = 1e-4
BIG = 1 << 20  # a KV budget no test here fills (1 MiB: 128 blocks of 16 tokens of the tiny fp32 model)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(1, 3), prompt(2, 17), prompt(3, 40), prompt(4, 64), prompt(5, 9)]
MAX_TOKENS = [20, 7, 30, 12, 25]


@pytest.fixture(scope="module")
def int4_fp32(tiny_folder):
    _, folder = tiny_folder("llama")
    with warnings.catch_warnings():  # int4 with fp32 activations runs on the reference kernel, and says so
        warnings.simplefilter("ignore")
        return load_model(str(folder), quant="int4", dtype="fp32")


@pytest.fixture(scope="module")
def int4(tiny_folder):
    _, folder = tiny_folder("llama")
    return load_model(str(folder), quant="int4", dtype="bf16")


def alone(lm, p: list[int], n: int | None, stop_ids=(), ctx: int = 256, params=GREEDY, kv_dtype: str = "16bit"
          ) -> list[int]:
    """``p``'s tokens alone: by whole forwards (:func:`tests.engines.reference`), or for a KV cache that
    stores other values than the activations (fp16, int8), by a one-sequence engine over such a pool."""
    if kv_dtype == "16bit":
        return engines.reference(lm.model, p, params, n, ctx, stop_ids)
    return engines.alone(lm.model, p, params, 10**6 if n is None else n, ctx, kv_dtype, stop_ids)


def forced_logits(lm, p: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits that chose each of ``tokens`` after ``p``, by one cache-less forward (steps, vocab)."""
    with torch.inference_mode():
        out = lm.model(torch.tensor([p + tokens[:-1]]))[0, len(p) - 1 :].float()
    return out


def assert_same(lm, p: list[int], got: list[int], want: list[int]) -> None:
    """fp32: the alone run's every step is decided, and the batch picked the same tokens."""
    if want:
        top2 = forced_logits(lm, p, want).topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        assert margin >= DECIDED, f"a near-tie ({margin:.2e}) in the expectation: pick another prompt"
    assert got == want


def assert_same_or_tie(lm, p: list[int], got: list[int], want: list[int]) -> None:
    """bf16: equal up to a first difference, where the alone run's logit of the batch's pick must be
    within 4 bf16 steps (ulps at the top logit) of its best: a near-tie that the batch's other matmul
    shapes, rounding to bf16 in every layer, may reverse. After it the texts differ: nothing more is
    compared."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            logits = forced_logits(lm, p, want)[i]
            top = logits.max()
            ulp = 2.0 ** (torch.floor(torch.log2(top.abs())) - 7)
            assert top - logits[g] <= 4 * ulp, (i, g, w, logits.topk(2))
            return
    assert len(got) == len(want)


def run_mixed(lm, **engine_args) -> tuple[BatchEngine, list]:
    """Three requests, a few steps, then two more join; different lengths leave at different times."""
    eng = BatchEngine(lm.model, **{"kv_budget_bytes": BIG, **engine_args})
    handles = [eng.submit(PROMPTS[i], GREEDY, MAX_TOKENS[i]) for i in range(3)]
    for _ in range(4):
        eng.step()
    handles += [eng.submit(PROMPTS[i], GREEDY, MAX_TOKENS[i]) for i in range(3, 5)]
    eng.run_until_done()
    return eng, handles


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
@pytest.mark.parametrize("chunk", [256, 8])
def test_batched_tokens_are_the_tokens_alone(tiny_fp32, attention, chunk):
    eng, handles = run_mixed(tiny_fp32, attention=attention, chunk_tokens=chunk)
    for p, n, h in zip(PROMPTS, MAX_TOKENS, handles):
        assert_same(tiny_fp32, p, h.result(), alone(tiny_fp32, p, n))
        s = h.stats
        assert s.finish_reason == "length" and s.generated_tokens == n and s.prompt_tokens == len(p)
        assert s.ttft_s is not None and s.ttft_s > 0 and s.preemptions == 0
    assert eng.usage()["blocks_used"] == 0 and eng.usage()["running"] == 0
    eng.blocks.check()
    if attention == "auto":
        assert eng.kernel is not None or eng.device.type != "cpu"


def test_an_fp16_pool_batches_exactly_and_holds_twice_the_tokens(tiny_fp32):
    """fp32 activations over float16 keys and values: the batch's tokens are each sequence's tokens
    alone over an fp16 cache, and the same budget holds twice the blocks of an fp32 pool."""
    eng, handles = run_mixed(tiny_fp32, kv_dtype="fp16", chunk_tokens=8)
    assert eng.pool.k[0].dtype == torch.float16 and "(float16)" in eng.pool.plan.describe()
    for p, n, h in zip(PROMPTS, MAX_TOKENS, handles):
        assert_same(tiny_fp32, p, h.result(), alone(tiny_fp32, p, n, kv_dtype="fp16"))
    wide = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG)
    assert eng.pool.n_blocks == 2 * wide.pool.n_blocks


def test_an_fp16_cache_is_refused_under_bf16_activations(int4):
    with pytest.raises(LocalLLMError, match="an fp16 KV cache is for float32"):
        BatchEngine(int4.model, kv_budget_bytes=BIG, kv_dtype="fp16")


def test_chunked_prefill_bounds_each_step(tiny_fp32):
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, chunk_tokens=8, speculate=False)  # sizes without drafts
    handles = [eng.submit(p, GREEDY, 5) for p in PROMPTS]
    sizes = []
    while eng.has_work:
        sizes.append(eng.step())
    assert max(sizes) <= 8 + len(PROMPTS)  # the prompt budget plus one decode token per sequence
    assert sum(sizes) == sum(len(p) + 4 for p in PROMPTS)  # every prompt token once, and 4 decode tokens each
    for p, h in zip(PROMPTS, handles):
        assert_same(tiny_fp32, p, h.result(), alone(tiny_fp32, p, 5))


def test_int4_weights_with_fp32_activations_batch_exactly(int4_fp32):
    _, handles = run_mixed(int4_fp32, chunk_tokens=16)
    for p, n, h in zip(PROMPTS, MAX_TOKENS, handles):
        assert_same(int4_fp32, p, h.result(), alone(int4_fp32, p, n))


def test_int4_bf16_batches_within_the_tie_rule(int4):
    assert int4.dtype == torch.bfloat16
    _, handles = run_mixed(int4, chunk_tokens=16)
    for p, n, h in zip(PROMPTS, MAX_TOKENS, handles):
        assert_same_or_tie(int4, p, h.result(), alone(int4, p, n))


def test_preemption_keeps_the_tokens(tiny_fp32):
    """A pool of 8 blocks (128 tokens) for five requests needing ~260: the youngest are preempted and
    recomputed from their prompt and the tokens they had, and still give their tokens alone."""
    budget = 8 * block_bytes(tiny_fp32.config, 16, torch.float32)
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=budget, chunk_tokens=32)
    assert eng.plan.n_blocks == 8 and eng.max_seq_len == 128
    handles = [eng.submit(p, GREEDY, n + 20) for p, n in zip(PROMPTS, MAX_TOKENS)]
    eng.run_until_done()
    assert eng.scheduler.preemptions > 0 and sum(h.stats.preemptions for h in handles) > 0
    for p, n, h in zip(PROMPTS, MAX_TOKENS, handles):
        assert_same(tiny_fp32, p, h.result(), alone(tiny_fp32, p, n + 20))
    eng.blocks.check()
    assert eng.usage()["blocks_used"] == 0


def test_prefix_hits_report_cached_tokens_and_keep_the_tokens(tiny_fp32):
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG)
    a = PROMPTS[3]  # 64 tokens
    first = eng.submit(a, GREEDY, 10)
    assert first.result() == alone(tiny_fp32, a, 10) and first.stats.cached_tokens == 0

    # a shared 50-token prefix: its 3 full blocks come from the cache, the rest is computed
    b = a[:50] + prompt(9, 6)
    h = eng.submit(b, GREEDY, 12)
    assert_same(tiny_fp32, b, h.result(), alone(tiny_fp32, b, 12))
    assert h.stats.cached_tokens == 48

    # the same prompt again: all but the last block (its last token must run to give logits)
    h = eng.submit(a, GREEDY, 10)
    assert_same(tiny_fp32, a, h.result(), alone(tiny_fp32, a, 10))
    assert h.stats.cached_tokens == 48

    # the same tokens after a different first token share nothing
    c = [7] + a[1:]
    h = eng.submit(c, GREEDY, 3)
    h.result()
    assert h.stats.cached_tokens == 0

    # a follow-up turn: blocks filled while decoding were keyed too
    out = alone(tiny_fp32, a, 10)
    follow = a + out + [5, 6, 7]
    h = eng.submit(follow, GREEDY, 8)
    assert_same(tiny_fp32, follow, h.result(), alone(tiny_fp32, follow, 8))
    computed = len(a) + len(out) - 1  # the last reply token never ran
    assert h.stats.cached_tokens == computed // 16 * 16 == 64


def test_concurrent_requests_share_a_prefix(tiny_fp32):
    """The second request arrives while the first decodes: it reuses the first one's full blocks."""
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG)
    a = PROMPTS[2]  # 40 tokens: 2 full blocks
    h1 = eng.submit(a, GREEDY, 20)
    eng.step()
    eng.step()
    h2 = eng.submit(a[:35] + [3, 4], GREEDY, 20)
    eng.step()
    assert h2.stats.cached_tokens == 32
    assert eng.usage()["blocks_used"] == 3 + 1  # two shared blocks, a partial one each
    eng.run_until_done()
    assert_same(tiny_fp32, a, h1.result(), alone(tiny_fp32, a, 20))
    assert_same(tiny_fp32, a[:35] + [3, 4], h2.result(), alone(tiny_fp32, a[:35] + [3, 4], 20))


def test_a_request_that_can_never_fit_is_refused_with_numbers(tiny_fp32):
    budget = 4 * block_bytes(tiny_fp32.config, 16, torch.float32)
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=budget)
    assert eng.max_seq_len == 64  # the pool, not the model's 256, bounds a sequence
    with pytest.raises(LocalLLMError, match=r"the prompt is 64 tokens and the context holds 64 \(prompt and reply "
                                            r"together; the KV pool has 4 blocks x 16 tokens = 64\)"):
        eng.submit(PROMPTS[3], GREEDY, 1)
    assert eng.submit(PROMPTS[3][:63], GREEDY, 5).result()  # one position left: it runs
    with pytest.raises(LocalLLMError, match="holds no block"):
        BatchEngine(tiny_fp32.model, kv_budget_bytes=100)
    with pytest.raises(LocalLLMError, match="max tokens 0"):
        eng.submit([5], GREEDY, 0)


def test_a_full_queue_says_busy(tiny_fp32):
    """A burst on an idle engine: its free slots and the queue take max_running + max_waiting requests
    before any step ran; one more is refused until a slot frees."""
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=2, max_waiting=2)
    handles = [eng.submit([5, 6 + i], GREEDY, 2) for i in range(4)]
    with pytest.raises(EngineBusy, match="busy.*retry after"):
        eng.submit([5, 9], GREEDY, 2)
    eng.run_until_done()
    assert [h.stats.finish_reason for h in handles] == ["length"] * 4
    eng.submit([5, 9], GREEDY, 2)  # idle again: room for a new burst
    eng.run_until_done()


def test_cancel_frees_the_blocks(tiny_fp32):
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=2)
    keep = eng.submit(PROMPTS[2], GREEDY, 30)
    gone = eng.submit(PROMPTS[3], GREEDY, 30)
    queued = eng.submit(PROMPTS[4], GREEDY, 30)  # waits: max_running
    for _ in range(5):
        eng.step()
    got = [next(gone), next(gone)]
    gone.cancel()
    queued.cancel()
    eng.step()
    assert gone.stats.finish_reason == "cancelled" and queued.stats.finish_reason == "cancelled"
    produced = got + gone.result()  # what came before the cancel can still be read
    assert len(produced) == gone.stats.generated_tokens < 30
    assert_same(tiny_fp32, PROMPTS[3], produced, alone(tiny_fp32, PROMPTS[3], 30)[: len(produced)])
    assert queued.result() == [] and queued.stats.ttft_s is None
    assert eng.usage()["running"] == 1 and eng.usage()["waiting"] == 0
    keep.cancel()
    eng.step()
    u = eng.usage()
    assert u["blocks_used"] == 0 and u["blocks_free"] + u["blocks_cached"] == u["blocks"]
    eng.blocks.check()


def test_stop_ids_end_a_request_without_the_stop_token(tiny_fp32):
    p = PROMPTS[2]
    full = alone(tiny_fp32, p, 30)
    stop = full[6]
    want = alone(tiny_fp32, p, 30, stop_ids=[stop])
    assert want == full[: full.index(stop)]
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG)
    h = eng.submit(p, GREEDY, 30, stop_ids=[stop])
    other = eng.submit(PROMPTS[1], GREEDY, 30)
    eng.run_until_done()
    assert_same(tiny_fp32, p, h.result(), want)
    assert h.stats.finish_reason == "stop" and other.stats.finish_reason == "length"


def test_a_full_context_ends_with_length(tiny_fp32):
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_seq_len=48)
    p = PROMPTS[2]  # 40 tokens
    h = eng.submit(p, GREEDY)
    want = alone(tiny_fp32, p, None, ctx=48)  # the context's limit: 48 - 40 + 1 tokens
    assert len(want) == 9
    assert_same(tiny_fp32, p, h.result(), want)
    assert h.stats.finish_reason == "length"


def test_seeded_sampling_is_per_request(tiny_fp32):
    params = [SamplingParams(temperature=0.9, seed=s, repeat_penalty=1.1) for s in (1, 2, 1)]

    def run() -> list[list[int]]:
        eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG)
        hs = [eng.submit(PROMPTS[2], sp, 25) for sp in params]
        eng.run_until_done()
        return [h.result() for h in hs]

    first = run()
    assert first == run()  # reproducible
    assert first[0] == first[2] and first[0] != first[1]  # each request its own generator


def test_the_repeat_penalty_window_slides_per_request(tiny_fp32):
    """The engine keeps each request's window of the last repeat_last_n ids: its tokens are the
    reference loop's, which keeps that window on the host, and the window's length matters."""
    params = SamplingParams(temperature=0, repeat_penalty=3.0, repeat_last_n=4)
    p, n = PROMPTS[4], 16
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG)
    h = eng.submit(p, params, n)
    other = eng.submit(PROMPTS[1], GREEDY, n)  # beside a request without a penalty
    eng.run_until_done()
    want = alone(tiny_fp32, p, n, params=params)
    assert h.result() == want and other.result() == alone(tiny_fp32, PROMPTS[1], n)
    assert want != alone(tiny_fp32, p, n, params=SamplingParams(temperature=0, repeat_penalty=3.0, repeat_last_n=64))


def test_background_thread_serves_many_threads(tiny_fp32):
    want = [alone(tiny_fp32, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    with BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, chunk_tokens=16) as eng:

        def client(i: int) -> None:
            try:
                got[i] = list(eng.submit(PROMPTS[i], GREEDY, MAX_TOKENS[i]))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors and eng._thread is None
    for i, p in enumerate(PROMPTS):
        assert_same(tiny_fp32, p, got[i], want[i])


def test_iterating_one_handle_advances_all(tiny_fp32):
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG)
    a = eng.submit(PROMPTS[0], GREEDY, 5)
    b = eng.submit(PROMPTS[1], GREEDY, 20)
    assert len(list(a)) == 5 and a.done
    assert b.stats.generated_tokens == 5  # b ran beside a, its tokens waiting in its handle
    assert list(b) == alone(tiny_fp32, PROMPTS[1], 20) and b.done


@pytest.fixture(scope="module")
def windowed(tiny_folder):
    """A tiny Mistral whose sliding window (8) is shorter than the prompts."""
    lm = load_model(str(tiny_folder("mistral", sliding_window=8)[1]), quant="fp32")
    assert lm.config.sliding_window == 8
    return lm


def test_sliding_window_batches_like_alone(windowed):
    """Queries see only the last 8 positions, in chunks and decode steps alike (the paged kernel takes
    the window: each decode query reads its last 8 keys)."""
    eng = BatchEngine(windowed.model, kv_budget_bytes=BIG, chunk_tokens=8)
    handles = [eng.submit(p, GREEDY, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    eng.run_until_done()
    for p, n, h in zip(PROMPTS, MAX_TOKENS, handles):
        assert_same(windowed, p, h.result(), alone(windowed, p, n))
