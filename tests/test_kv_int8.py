"""The 8-bit KV cache (``kv_dtype="int8"``): int8 codes with an fp32 scale per token and kv head.

* quantization: symmetric absmax per row, within half a step of the value;
* the paged decode kernel reads the codes where they lie and gives SDPA's attention over the
  dequantized rows (fp32 tight, bf16 loose), windowed or not;
* a model over an int8 pool: chunked prefill + decode through the kernel equal the same steps through
  SDPA over the gathered, dequantized rows, sliding layers included; a batch's greedy tokens equal
  the same request alone, both under int8;
* SmolLM2 under teacher forcing: an int8 pool stays within a perplexity and KLD bound of the 16-bit
  one (a pool that held wrong rows or scales would not);
* sizes: what config says is what is allocated.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from localllm import native
from localllm.errors import LocalLLMError
from localllm.runtime import cpu_attention
from localllm.runtime.batch import BatchEngine
from localllm.runtime.cache import QuantKV, quantize_kv
from localllm.runtime.kv_pool import KVPool, cache_bytes, gather, plan_pool
from localllm.runtime.sampling import SamplingParams
from tests import engines

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
@pytest.mark.parametrize("kv,g,hd,bs", [(3, 3, 64, 16), (1, 4, 40, 32), (2, 1, 36, 16), (1, 4, 256, 16)])
@pytest.mark.parametrize("window", [None, 21])
def test_paged_kernel_matches_sdpa_over_an_int8_pool(dtype, kv, g, hd, bs, window):
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
    if window is not None:  # blocks the window has left are given back: their entries are never read
        for i, n in enumerate(lens):
            table[i, : max(0, n - window) // bs] = -1
    got = cpu_attention.paged_decode_attention(q, k_pool, v_pool, table, torch.tensor(lens, dtype=torch.int32),
                                               window)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        k, v = gather(k_pool, v_pool, tables[i], n, torch.float32)  # dequantized
        first = 0 if window is None else max(0, n - window)
        want = F.scaled_dot_product_attention(q[i : i + 1].float(), k[:, :, first:], v[:, :, first:])[0]
        assert (got[i].float() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


@needs_kernel
def test_kernel_refuses_mismatched_scales():
    q = torch.randn(1, 2, 2, 16)
    k = quantize_kv(torch.randn(3, 2, 16, 16))  # a pool of 3 blocks of 16
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    op = torch.ops.localllm.paged_decode_attention_q8
    with pytest.raises(RuntimeError, match="scales must be float32"):
        op(q, k.codes, k.scales[:, :, :5], k.codes, k.scales, tables, lens, 0.25, 0)
    with pytest.raises(RuntimeError, match="codes must be int8"):
        op(q, k.codes.float(), k.scales, k.codes, k.scales, tables, lens, 0.25, 0)


def test_sizes_are_what_config_says(tiny_fp32):
    model, c = tiny_fp32.model, tiny_fp32.config
    assert cache_bytes(c, 1, torch.float32, "int8") == 2 * c.n_layers * c.n_kv_heads * (c.head_dim + 4)
    plan = plan_pool(c, 1 << 20, model.dtype, 16, "int8")
    pool = KVPool.allocate(c, plan, model.device)
    assert sum(x.nbytes for x in pool.k + pool.v) == plan.bytes <= 1 << 20
    assert plan.bytes_per_block == cache_bytes(c, 16, torch.float32, "int8")
    assert plan.n_blocks > plan_pool(c, 1 << 20, torch.bfloat16, 16).n_blocks  # int8 beats 16-bit
    assert "int8" in plan.describe()
    with pytest.raises(LocalLLMError, match="unknown KV cache type"):
        plan_pool(c, 1 << 20, model.dtype, 16, "int4")


def _kernel_and_sdpa(model, ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logits over an int8 pool, prefilled in chunks of ``n``, then decoded: through the
    paged kernel (reading codes and scales where they lie), and through SDPA over the gathered rows."""
    out = []
    for attention in ("auto", "sdpa"):
        engine = BatchEngine(model, kv_budget_bytes=1 << 20, chunk_tokens=n, kv_dtype="int8", attention=attention)
        out.append(engine.forced_logits(ids[: n + 6], ids[n + 6 :]))
    return out[0], out[1]


@needs_kernel
def test_int8_kernel_decode_equals_sdpa_over_the_dequantized_rows(tiny_fp32):
    """Decode steps read the codes with the kernel, prefill reads dequantized rows with SDPA: the same
    values; and int8 is close to the 16-bit pool, not equal."""
    model = tiny_fp32.model
    ids = torch.randint(3, 380, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    got, want = _kernel_and_sdpa(model, ids, 13)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = model(torch.tensor([ids]))[0, 18:]  # 16-bit
    assert 0 < (want - plain).abs().max() < 0.1 * plain.abs().max()


@needs_kernel
def test_int8_pool_of_sliding_layers(tmp_path):
    """Gemma 3's sliding layers over an int8 pool: chunks past the window, then decode far past it
    through the kernel (each query's last 8 rows), equal SDPA over the window's gathered rows."""
    from tests.conftest import write_tiny_tokenizer
    from tests.test_families import gemma3_model, ours_from

    ref = gemma3_model()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    write_tiny_tokenizer(tmp_path, ref.config.vocab_size)
    model = ours_from(tmp_path)
    ids = torch.randint(3, ref.config.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    got, want = _kernel_and_sdpa(model, ids, 13)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batch_under_int8_equals_the_request_alone(tiny_fp32):
    """The batch engine over an int8 pool: each request's greedy tokens are its tokens alone over an
    int8 pool (margins checked by teacher forcing, as tests/test_batch.py does)."""
    from tests.test_batch import DECIDED, prompt

    greedy = SamplingParams(temperature=0)
    prompts, n = [prompt(1, 3), prompt(3, 40), prompt(4, 64)], 12
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=1 << 20, chunk_tokens=24, kv_dtype="int8")
    assert eng.plan.kv_dtype == "int8" and isinstance(eng.pool.k[0], QuantKV)
    handles = [eng.submit(p, greedy, max_tokens=n) for p in prompts]
    eng.run_until_done()
    judge = BatchEngine(tiny_fp32.model, kv_budget_bytes=1 << 20, kv_dtype="int8")
    for p, h in zip(prompts, handles):
        want = engines.alone(tiny_fp32.model, p, greedy, n, kv_dtype="int8")
        top2 = judge.forced_logits(p, want[:-1]).topk(2).values  # the alone run's margins, int8 pool
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
    """Next-token log-probabilities (T, vocab) of ``ids`` teacher-forced through decode steps over a
    pool of ``kv_dtype`` (each step reads every earlier key and value as stored)."""
    engine = BatchEngine(model, kv_budget_bytes=64 << 20, kv_dtype=kv_dtype)
    return engine.forced_logits(ids[:1], ids[1:]).log_softmax(-1)


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
