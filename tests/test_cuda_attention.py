"""The CUDA paged attention kernel (:mod:`runtime.cuda_attention`), its numerics checked on any machine:
the same Triton source runs under Triton's interpreter on CPU tensors. Against float64 attention over
keys and values gathered from their blocks (:func:`runtime.kv_pool.gather`): random pools, shuffled
block tables, lengths 1 to 2,000, GQA groups (padded and not), head dims that are not powers of two,
windows over tables whose left blocks are -1, fp32/fp16/bf16 and int8 pools, decode rows with the
keys split across programs, and prefill chunks over cached prefixes in tiles of several rows.

On a CUDA machine (``scripts/gpu_checks.sh``; no ``TRITON_INTERPRET`` there) the last test runs the
compiled kernel against the same references."""

from __future__ import annotations

import math

import pytest
import torch

from localllm import triton_kernels
from localllm.runtime import cuda_attention
from localllm.runtime.cache import quantize_kv
from localllm.runtime.kv_pool import gather

pytestmark = pytest.mark.skipif(not triton_kernels.available(), reason="triton is not installed (dev extra)")
#: CPU tensors run in Triton's interpreter: tests/conftest.py turns it on where there is no GPU.
on_cpu = pytest.mark.skipif(not triton_kernels.available() or not triton_kernels.interpreting(),
                            reason="Triton's interpreter is off (a GPU is here: the cuda tests run)")


def pools(pool: str, kv: int, hd: int, bs: int, n_blocks: int, gen: torch.Generator):
    """Random key and value pools in ``pool``'s form, and the activation dtype that reads them."""
    k = torch.randn(n_blocks, kv, bs, hd, generator=gen) * 2
    v = torch.randn(n_blocks, kv, bs, hd, generator=gen)
    if pool == "int8":
        return quantize_kv(k), quantize_kv(v), torch.float32
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[pool]
    return k.to(dtype), v.to(dtype), dtype


def tables_for(lens: list[int], bs: int, n_blocks: int, gen: torch.Generator):
    """Shuffled distinct blocks per sequence: each one's own, and the table (one entry wider than the
    longest needs: padding is never read)."""
    order = torch.randperm(n_blocks, generator=gen)
    width = max(-(-n // bs) for n in lens) + 1
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    own, used = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        own.append(order[used : used + nb])
        used += nb
        table[i, :nb] = own[-1]
    assert used <= n_blocks
    return own, table


def release(table: torch.Tensor, firsts: list[int], bs: int) -> torch.Tensor:
    """Entries before each sequence's first seen key's block set to -1."""
    table = table.clone()
    for i, first in enumerate(firsts):
        table[i, : first // bs] = -1
    return table


def reference(q_row: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 attention of one row's heads q (KV, G, hd) over k, v (KV, L, hd)."""
    s = q_row.double() @ k.double().transpose(-1, -2) / math.sqrt(q_row.shape[-1])
    return s.softmax(-1) @ v.double()


def check(pool: str, kv: int, g: int, hd: int, bs: int, spans: list[tuple[int, int]], window: int | None,
          tile_rows: int, splits: int | None, seed: int, device: str = "cpu") -> None:
    """``spans``: (context after the step, query rows) per sequence; rows are the last positions. The
    kernel runs on ``device`` (cpu: Triton's interpreter), the reference on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c for c, _ in spans]
    n_blocks = sum(-(-n // bs) for n in lens) + 3
    k_pool, v_pool, dtype = pools(pool, kv, hd, bs, n_blocks, gen)
    own, table = tables_for(lens, bs, n_blocks, gen)
    firsts = [0 if window is None else max(0, c - n - window + 1) for c, n in spans]
    table = release(table, firsts, bs)
    N = sum(n for _, n in spans)
    q = torch.randn(N, kv, g, hd, generator=gen).to(dtype)
    tiles, row = [], 0
    for s, (c, n) in enumerate(spans):
        for a in range(0, n, tile_rows):
            tiles.append((s, row + a, min(tile_rows, n - a), c - n + a))
        row += n
    tiles_t = torch.tensor(tiles, dtype=torch.int32)
    on = lambda x: x.to(device) if isinstance(x, torch.Tensor) else type(x)(*(t.to(device) for t in x))  # noqa: E731
    got = cuda_attention.paged_span_attention(on(q), on(k_pool), on(v_pool), on(table),
                                              on(torch.tensor(lens, dtype=torch.int32)), window, on(tiles_t),
                                              tile_rows, splits).cpu()
    assert got.shape == q.shape and got.dtype == dtype
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    row = 0
    for s, (c, n) in enumerate(spans):
        k, v = gather(k_pool, v_pool, own[s], c, torch.float32)  # (1, KV, c, hd), dequantized
        for a in range(n):
            p = c - n + a
            lo = 0 if window is None else max(0, p - window + 1)
            want = reference(q[row + a].float(), k[0, :, lo : p + 1], v[0, :, lo : p + 1])
            err = (got[row + a].double() - want).abs().max().item()
            assert err <= tol * max(1.0, want.abs().max().item()), (s, a, p, err)
        row += n


@on_cpu
@pytest.mark.parametrize("pool", ["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("kv,g,hd,bs", [(2, 4, 64, 16), (3, 3, 80, 16), (1, 1, 32, 32)])
@pytest.mark.parametrize("window", [None, 37])
def test_decode_rows_match_attention_over_gathered_blocks(pool, kv, g, hd, bs, window):
    """One query per sequence (a decode step): a lone key, non-full and exactly full last blocks, a
    long context; the keys split three ways (the combine kernel) and not at all."""
    spans = [(1, 1), (bs - 1, 1), (bs, 1), (bs + 1, 1), (3 * bs + 5, 1), (300, 1)]
    for splits in (1, 3):
        check(pool, kv, g, hd, bs, spans, window, 1, splits, seed=hd + bs + splits)


@on_cpu
@pytest.mark.parametrize("pool", ["fp16", "int8"])
@pytest.mark.parametrize("window", [None, 100])
def test_prefill_chunks_over_cached_prefixes(pool, window):
    """Chunks of a step past cached prefixes, in tiles of 8 rows (the last one partial), causal within
    the chunk and windowed across tile and block edges; a whole prompt from position 0; beside a
    sequence's decode row and a verify-like span of 4 rows."""
    spans = [(70, 37), (20, 20), (201, 1), (45, 4)]
    check(pool, 2, 3, 64, 16, spans, window, cuda_attention.PREFILL_TILE_ROWS, 1, seed=11)


@on_cpu
def test_a_context_of_2000_keys_split_and_windowed():
    """The long end: 2,000 keys in one sequence, beside short ones; splits 1 and 5; with a window of
    512 over a table whose first blocks are gone."""
    spans = [(2000, 1), (7, 1), (1025, 1)]
    for splits, window in ((1, None), (5, None), (5, 512)):
        check("fp16", 2, 2, 64, 16, spans, window, 1, splits, seed=splits)


@on_cpu
def test_a_long_prefill_chunk():
    """A 100-row chunk after a 1,900-token cached prefix: 2,000 keys, 13 tiles."""
    check("bf16", 1, 4, 64, 32, [(2000, 100)], None, cuda_attention.PREFILL_TILE_ROWS, 1, seed=3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pool", ["fp16", "bf16", "int8"])
def test_the_compiled_kernel_on_a_gpu(pool):
    """On a GPU: the CUDA build of the kernel against the same references, on a 7B model's head
    shapes (32 query heads over 8 kv heads of 128): decode rows split by the SM count and not, with
    a window, and a prefill chunk over a cached prefix."""
    decode = [(2000, 1), (1, 1), (37, 1), (600, 1)]
    for splits, window in ((None, None), (1, None), (4, 256)):
        check(pool, 8, 4, 128, 16, decode, window, 1, splits, seed=1, device="cuda")
    check(pool, 8, 4, 128, 16, [(1500, 500), (90, 1)], 300, cuda_attention.PREFILL_TILE_ROWS, 1, seed=2,
          device="cuda")



@on_cpu
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kv_dtype", ["16bit", "int8"])
def test_the_models_steps_through_the_kernel_give_sdpas_logits(span_models, arch, kv_dtype):
    """A model's batch steps with every span on the kernel (a first chunk beside a whole prompt; the
    rest of the prompt past its cached prefix beside a decode row; a verify chunk of 4 rows beside a
    decode row) give the logits of the same steps through SDPA over gathered blocks, fp32 and int8
    pools, one layer group and two (Gemma 3's window of 8 past the blocks it has left)."""
    from localllm.runtime.kv_pool import KVPool, plan_pool
    from localllm.runtime.model import cache_rope_tables
    from localllm.runtime.paged import PagedStep
    from tests.engines import step_chunk

    model = span_models[arch]
    config = model.config
    p1, p2 = [(7 * i) % 300 + 3 for i in range(40)], [200, 11, 64, 9, 31, 5, 77]
    # Block tables per layer group; the window group's table drops blocks its window has left (-1).
    t1, t2 = [3, 1, 7, 9], [4]
    cos, sin = (t.to(model.dtype) for t in cache_rope_tables(config, 128, model.device))

    def run(kernel) -> list[torch.Tensor]:
        pool = KVPool.allocate(config, plan_pool(config, 1 << 20, model.dtype, 16, kv_dtype), model.device)
        n_groups = 1 + max(pool.group_of)

        def chunk(tokens, start, table, logits, verify=False, window_from=0):
            more = tuple([-1] * window_from + table[window_from:] for _ in range(n_groups - 1))
            return step_chunk(tokens, start, table, logits, more, verify)

        steps = [[chunk(p1[:20], 0, t1, False), chunk(p2, 0, t2, True)],
                 [chunk(p1[20:], 20, t1, True), chunk([9], 7, t2, True)],
                 [chunk([11, 5, 6, 7], 40, t1, False, verify=True, window_from=2), chunk([12], 8, t2, True)]]
        out = []
        for chunks in steps:
            step, ids = PagedStep.build(pool, chunks, cos, sin, kernel)
            with torch.inference_mode():
                out.append(model(ids, step)[0])
        return out

    # An int8 pool quantizes each new key and value row: a difference of fp32 rounding in a layer's
    # output can move a code of the next layer's rows by one step, which moves these logits by a few
    # 1e-3 (SDPA and the CPU kernel differ as much). Each layer's attention itself agrees with float64
    # to 1e-6 (the tests above); a missing scale or a wrong window would be off by 0.1 or more.
    tol = 3e-5 if kv_dtype == "16bit" else 1e-2
    for want, got in zip(run(None), run(cuda_attention.paged_span_attention)):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=tol, rtol=0), (got - want).abs().max()
