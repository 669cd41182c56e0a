"""The 8-bit KV cache (``kv_dtype="int8"``): int8 codes with an fp32 scale per token and kv head.

* quantization: symmetric absmax per row, within half a step of the value;
* the decode kernels read the codes where they lie and give SDPA's attention over the dequantized rows
  (fp32 tight, bf16 loose), the paged one bit for bit the one-sequence one over the same rows;
* a model over an int8 cache: prefill + cached decode (kernel) equal the int8 cache's own full forward,
  through a sliding layer's ring too; the paged forward equals the one-sequence cache; a batch's
  greedy tokens equal the same request alone, both under int8;
* SmolLM2 under teacher forcing: an int8 cache stays within a perplexity and KLD bound of the 16-bit
  cache (a cache that held wrong rows or scales would not);
* sizes: what config says is what is allocated; the compiled step refuses int8 in one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from localllm import native
from localllm.errors import LocalLLMError
from localllm.runtime import cpu_attention
from localllm.runtime.cache import KVCache, QuantKV, SequenceCache, empty_kv, quantize_kv
from localllm.runtime.generate import Generator, decode_one_token, prefill
from localllm.runtime.kv_pool import KVPool, gather, plan_pool
from localllm.runtime.sampling import SamplingParams

needs_kernel = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler to build the kernel")


def test_quantize_rows_within_half_a_step():
    x = torch.randn(2, 3, 50, 64) * torch.rand(2, 3, 50, 1) * 5
    x[0, 1, 7] = 0.0  # a row of zeros: scale 0, codes 0
    q = quantize_kv(x)
    assert q.codes.dtype == torch.int8 and q.scales.shape == (2, 3, 50) and q.scales.dtype == torch.float32
    assert q.codes.abs().max() <= 127 and q.codes.abs().amax(-1)[x.abs().amax(-1) > 0].min() == 127
    err = (q.dequantize(torch.float32) - x).abs()
    assert (err <= q.scales.unsqueeze(-1) * 0.5 + 1e-6).all()
    assert q.scales[0, 1, 7] == 0 and (q.codes[0, 1, 7] == 0).all()


def _q8(shape: tuple[int, ...], gen: torch.Generator, spread: float = 2.0) -> QuantKV:
    """Random rows of uneven magnitude, quantized."""
    x = torch.randn(*shape, generator=gen) * (torch.rand(*shape[:-1], 1, generator=gen) * spread + 0.1)
    return quantize_kv(x)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv,g,hd,length", [(3, 3, 64, 300), (2, 1, 16, 37), (1, 4, 40, 513), (2, 2, 128, 1)])
def test_kernel_matches_sdpa_on_dequantized_rows(dtype, kv, g, hd, length):
    gen = torch.Generator().manual_seed(hd + length)
    q = torch.randn(2, kv, g, hd, generator=gen).to(dtype)
    k_all, v_all = _q8((2, kv, length + 9, hd), gen, 4.0), _q8((2, kv, length + 9, hd), gen)
    k, v = k_all.rows(length), v_all.rows(length)  # the filled prefix of a longer cache: strided views
    got = cpu_attention.decode_attention(q, k, v)
    assert got.shape == q.shape and got.dtype == dtype
    want = F.scaled_dot_product_attention(q.float(), k.dequantize(torch.float32), v.dequantize(torch.float32))
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv,g,hd,bs", [(3, 3, 64, 16), (1, 4, 40, 32), (2, 1, 36, 16)])
def test_paged_kernel_matches_references_over_an_int8_pool(dtype, kv, g, hd, bs):
    gen = torch.Generator().manual_seed(hd * bs)
    lens = [1, bs - 1, bs, 3 * bs + 5, 200]
    n_blocks = 40
    k_pool, v_pool = _q8((n_blocks, kv, bs, hd), gen, 4.0), _q8((n_blocks, kv, bs, hd), gen)
    q = torch.randn(len(lens), kv, g, hd, generator=gen).to(dtype)
    order = torch.randperm(n_blocks, generator=gen)
    tables, used = [], 0
    for n in lens:
        tables.append(order[used : used + -(-n // bs)])
        used += len(tables[-1])
    table = torch.zeros(len(lens), max(len(t) for t in tables) + 1, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    got = cpu_attention.paged_decode_attention(q, k_pool, v_pool, table, torch.tensor(lens, dtype=torch.int32))
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        rows = tables[i]
        codes_k, codes_v = gather(k_pool.codes, v_pool.codes, rows, n)  # (1, KV, n, hd) int8
        sc_k, sc_v = gather(k_pool.scales, v_pool.scales, rows, n)  # (1, KV, n)
        one = cpu_attention.decode_attention(q[i : i + 1], QuantKV(codes_k, sc_k), QuantKV(codes_v, sc_v))
        assert torch.equal(got[i], one[0])  # the engine's decode rounds as the Generator's
        k, v = gather(k_pool, v_pool, rows, n, torch.float32)  # dequantized
        want = F.scaled_dot_product_attention(q[i : i + 1].float(), k, v)[0]
        assert (got[i].float() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


@needs_kernel
def test_kernel_refuses_mismatched_scales():
    q = torch.randn(1, 2, 2, 16)
    k = quantize_kv(torch.randn(1, 2, 10, 16))
    with pytest.raises(RuntimeError, match="scales must be float32"):
        torch.ops.localllm.decode_attention_q8(q, k.codes, k.scales[:, :, :5], k.codes, k.scales, 0.25)
    with pytest.raises(RuntimeError, match="codes must be int8"):
        torch.ops.localllm.decode_attention_q8(q, k.codes.float(), k.scales, k.codes, k.scales, 0.25)


@pytest.fixture(scope="module")
def lm(tiny_folder):
    from localllm.loaders.load import load_model

    _, folder = tiny_folder("llama")
    return load_model(str(folder), quant="fp32")


def test_sizes_are_what_config_says(lm):
    model, c = lm.model, lm.config
    cache = model.new_cache(64, kv_dtype="int8")
    assert cache.kv_dtype == "int8" and cache.nbytes() == c.kv_cache_bytes(64, "int8")
    assert c.kv_cache_bytes(1, "int8") == 2 * c.n_layers * c.n_kv_heads * (c.head_dim + 4)
    plan = plan_pool(c, 1 << 20, model.dtype, 16, "int8")
    pool = KVPool.allocate(c, plan, model.device)
    assert sum(x.nbytes for x in pool.k + pool.v) == plan.bytes <= 1 << 20
    assert plan.n_blocks > plan_pool(c, 1 << 20, torch.bfloat16, 16).n_blocks  # int8 beats 16-bit
    assert "int8" in plan.describe()
    with pytest.raises(LocalLLMError, match="unknown KV cache type"):
        model.new_cache(8, kv_dtype="int4")


def test_compiled_step_refuses_int8(lm):
    with pytest.raises(LocalLLMError, match="compiled decode step does not support a int8 KV cache"):
        Generator(lm.model, 32, compile=True, kv_dtype="int8")


def _full_length_int8(model, max_seq: int) -> SequenceCache:
    """An int8 cache whose every layer holds all ``max_seq`` positions (no ring): the reference a
    sliding layer's ring must match (its window then comes from the mask)."""
    c = model.config
    ring = model.new_cache(max_seq, kv_dtype="int8")
    shape = (1, c.n_kv_heads, max_seq, c.head_dim)
    layers = [KVCache(empty_kv(shape, "int8", model.dtype, model.device),
                      empty_kv(shape, "int8", model.dtype, model.device)) for _ in range(c.n_layers)]
    return SequenceCache(layers, ring.cos, ring.sin)


def _chunked_then_decoded(model, ids: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Logits of positions n-1, n+5, n+6, ...: a prefill chunk of n, one of 6, then decode steps, all
    over one int8 cache."""
    cache = model.new_cache(ids.shape[1], kv_dtype="int8")
    out = [prefill(model, cache, ids[:, :n]), prefill(model, cache, ids[:, n : n + 6], start=n)]
    for pos in range(n + 6, ids.shape[1]):
        out.append(decode_one_token(model, cache, ids[:, pos : pos + 1], torch.tensor([pos]), pos))
    return out


@needs_kernel
def test_int8_prefill_then_kernel_decode_equals_the_int8_full_forward(lm):
    """Decode steps read the codes with the kernel, prefill reads dequantized rows with SDPA: the same values."""
    model = lm.model
    assert model.decode_kernel is not None
    ids = torch.randint(3, 380, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = model(ids, _full_length_int8(model, 40), start=0)  # (1, 40, vocab)
        got = _chunked_then_decoded(model, ids, 13)
        plain = model(ids)  # 16-bit: int8 is close, not equal
    want = [full[:, 12], full[:, 18], *(full[:, p] for p in range(19, 40))]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert 0 < (full - plain).abs().max() < 0.1 * plain.abs().max()


@needs_kernel
def test_int8_ring_of_a_sliding_layer(tmp_path):
    """Gemma 3's sliding layers keep a ring of int8 rows: chunks that wrap it, then decode past the
    window through the kernel, equal an int8 cache that keeps every row (windowed by the mask)."""
    from tests.conftest import write_tiny_tokenizer
    from tests.test_families import WINDOW, gemma3_model, ours_from

    ref = gemma3_model()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    write_tiny_tokenizer(tmp_path, ref.config.vocab_size)
    model = ours_from(tmp_path)
    model.set_decode_attention(cpu_attention.kernel())
    ids = torch.randint(3, ref.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert [layer.rows for layer in model.new_cache(30, kv_dtype="int8").layers][0] == WINDOW
        full = model(ids, _full_length_int8(model, 30), start=0)
        got = _chunked_then_decoded(model, ids, 13)  # the first chunk itself wraps the ring of 8
    want = [full[:, 12], full[:, 18], *(full[:, p] for p in range(19, 30))]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_paged_int8_forward_gives_the_int8_sequence_cache_logits(lm, attention):
    """Two sequences through paged steps over an int8 pool (chunk beside prompt, rest beside a decode
    token, two decode tokens): each row's logits are the one-sequence int8 cache's."""
    kernel = cpu_attention.paged_kernel() if attention == "kernel" else None
    if attention == "kernel" and kernel is None:
        pytest.skip("no C++ kernel here")
    from tests.test_paged_attention import P1, P2, three_paged_steps

    model = lm.model
    _, (s1, s2, s3) = three_paged_steps(model, "int8", kernel)
    p1, p2 = P1, P2
    with torch.inference_mode():
        c1, c2 = model.new_cache(64, kv_dtype="int8"), model.new_cache(64, kv_dtype="int8")
        p2_logits = prefill(model, c2, torch.tensor([p2]))
        c1_a = prefill(model, c1, torch.tensor([p1[:20]]))  # the chunking the paged run used
        p1_logits = prefill(model, c1, torch.tensor([p1[20:]]), start=20)
        p1_11 = decode_one_token(model, c1, torch.tensor([[11]]), torch.tensor([40]), 40)
        p2_9 = decode_one_token(model, c2, torch.tensor([[9]]), torch.tensor([7]), 7)
        p2_9_12 = decode_one_token(model, c2, torch.tensor([[12]]), torch.tensor([8]), 8)
    del c1_a
    pairs = [(s1[0], p2_logits[0]), (s2[0], p1_logits[0]), (s2[1], p2_9[0]), (s3[0], p1_11[0]),
             (s3[1], p2_9_12[0])]
    for got, want in pairs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batch_under_int8_equals_the_request_alone(lm):
    """The batch engine over an int8 pool: each request's greedy tokens are its tokens alone over an
    int8 cache (margins checked by teacher forcing, as tests/test_batch.py does)."""
    from localllm.runtime.batch import BatchEngine
    from tests.test_batch import DECIDED, prompt

    greedy = SamplingParams(temperature=0)
    prompts, n = [prompt(1, 3), prompt(3, 40), prompt(4, 64)], 12
    eng = BatchEngine(lm.model, kv_budget_bytes=1 << 20, chunk_tokens=24, kv_dtype="int8")
    assert eng.plan.kv_dtype == "int8" and isinstance(eng.pool.k[0], QuantKV)
    handles = [eng.submit(p, greedy, max_tokens=n) for p in prompts]
    eng.run_until_done()
    for p, h in zip(prompts, handles):
        want = list(Generator(lm.model, 256, kv_dtype="int8").generate(p, greedy, max_tokens=n))
        cache = lm.model.new_cache(256, kv_dtype="int8")
        with torch.inference_mode():  # the alone run's margins, under teacher forcing over an int8 cache
            logits = lm.model(torch.tensor([p + want[:-1]]), cache, start=0)[0, len(p) - 1 :].float()
        top2 = logits.topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() >= DECIDED, "a near-tie: pick another prompt"
        assert h.result() == want
    assert eng.usage()["blocks_used"] == 0


# -------------------------------------------------------------------------- SmolLM2, teacher forced
#: Bounds on SmolLM2 (fp32 activations) over 256 tokens of the eval text: measured perplexity ratio
#: 0.997 and KLD 1.9e-4 nats (without the key rotation: 7e-4); a cache with wrong rows or scales is
#: off by orders of magnitude.
PPL_RATIO_MAX = 1.01
KLD_MAX = 1e-3


def cache_logprobs(model, ids: list[int], kv_dtype: str) -> torch.Tensor:
    """Next-token log-probabilities (T, vocab) of ``ids`` run as one prefill over a cache of
    ``kv_dtype`` (its attention reads the cache: for int8, every key and value as stored)."""
    with torch.inference_mode():
        cache = model.new_cache(len(ids), kv_dtype=kv_dtype)
        return model(torch.tensor([ids]), cache, start=0)[0].float().log_softmax(-1)


def test_smollm2_int8_cache_quality(smollm2_path):
    from localllm.bench.settings import EVAL_TEXT
    from localllm.loaders.load import load_model

    lm = load_model(str(smollm2_path), device="cpu", quant="fp32")
    ids = lm.tokenizer.encode(EVAL_TEXT.read_text())[:257]
    inputs, targets = ids[:-1], torch.tensor(ids[1:])
    ref, q8 = cache_logprobs(lm.model, inputs, "16bit"), cache_logprobs(lm.model, inputs, "int8")
    nll = lambda lp: -lp.gather(-1, targets[:, None]).mean().item()  # noqa: E731
    ratio = float(torch.tensor(nll(q8) - nll(ref)).exp())
    kld = (ref.exp() * (ref - q8)).sum(-1).mean().item()
    assert ratio <= PPL_RATIO_MAX and 0 < kld <= KLD_MAX, (ratio, kld)


def test_a_rotation_made_while_tracing_is_not_kept():
    """Tracing (FakeTensorMode: torch.export, the fake CUDA checks) makes a fake matrix; the cache must
    not hand it to later real calls."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from localllm.runtime.cache import key_rotation

    with FakeTensorMode():
        assert key_rotation(48).shape == (48, 48)  # 48: a size no other test asks for
    r = key_rotation(48)
    assert not is_fake(r) and torch.allclose(r @ r.T, torch.eye(48), atol=1e-5)
