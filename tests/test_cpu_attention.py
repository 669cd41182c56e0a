"""The CPU's attention over the paged KV pool (runtime/cpu_attention.py): the C++ paged decode kernel
against float64 attention (as accurate as SDPA) and SDPA over gathered blocks (fp32 tight, bf16
loose), with scattered blocks, non-full last blocks, different lengths and sliding windows (blocks
before a window never read); a kv group's heads round as each alone; threads change no bit; bad tables
refused; the chunk kernel (a prefill chunk's rows) against float64 attention over float, fp16 and bf16
pools, its rows' bits the same in any chunking; and the model's paged steps giving the full forward's
logits, with and without the kernels."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from localllm import native
from localllm.runtime import cpu_attention
from localllm.runtime.cache import quantize_kv
from localllm.runtime.kv_pool import KVPool, gather, plan_pool
from localllm.runtime.model import cache_rope_tables
from localllm.runtime.paged import PagedStep
from tests.engines import step_chunk

needs_kernel = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler to build the kernel")


def random_batch(dtype, kv, g, hd, bs, lens, n_blocks=40, seed=0):
    """Pools, a query per sequence and block tables of distinct, shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    k_pool = (torch.randn(n_blocks, kv, bs, hd, generator=gen) * 2).to(dtype)
    v_pool = torch.randn(n_blocks, kv, bs, hd, generator=gen).to(dtype)
    q = torch.randn(len(lens), kv, g, hd, generator=gen).to(dtype)
    order = torch.randperm(n_blocks, generator=gen)
    tables, used = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(order[used : used + nb])
        used += nb
    width = max(len(t) for t in tables) + 1  # wider than any sequence needs: padding is not read
    table = torch.full((len(lens), width), 0, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    return q, k_pool, v_pool, tables, table, torch.tensor(lens, dtype=torch.int32)


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention in float64: q (B, KV, G, hd), k, v (B, KV, L, hd)."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s.softmax(-1) @ v.double()


def _released(table: torch.Tensor, lens: list[int], bs: int, window: int | None) -> torch.Tensor:
    """``table`` with the entries of blocks every query's window has left set to -1, as a sliding-window
    group's tables hold them once the pool has the blocks back."""
    table = table.clone()
    for i, n in enumerate(lens):
        if window is not None:
            table[i, : max(0, n - window) // bs] = -1
    return table


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv,g,hd,bs", [(2, 2, 16, 16), (3, 3, 64, 16), (1, 4, 40, 32), (2, 1, 36, 16),
                                        (1, 2, 128, 32), (3, 3, 64, 12), (2, 4, 32, 8), (1, 4, 256, 16)])
@pytest.mark.parametrize("window", [None, 37])
def test_paged_kernel_matches_the_references(dtype, kv, g, hd, bs, window):
    """Every sequence's query over its own scattered blocks: within SDPA's error of float64 attention
    (plus the output's own rounding), and SDPA's result within fp32 (bf16, fp16) tolerance; with a
    window, over its last ``window`` keys only, from tables whose earlier entries are -1."""
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 200]  # a lone key, non-full and exactly full last blocks
    q, k_pool, v_pool, tables, table, ctx = random_batch(dtype, kv, g, hd, bs, lens, seed=hd + bs)
    got = cpu_attention.paged_decode_attention(q, k_pool, v_pool, _released(table, lens, bs, window), ctx, window)
    assert got.shape == q.shape and got.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        k, v = gather(k_pool, v_pool, tables[i], n)  # (1, KV, n, hd)
        first = 0 if window is None else max(0, n - window)
        k, v = k[:, :, first:], v[:, :, first:]
        want = F.scaled_dot_product_attention(q[i : i + 1].float(), k.float(), v.float())[0]
        assert (got[i].float() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
        exact = _exact(q[i : i + 1], k, v)[0]
        ours = (got[i].double() - exact).abs().max().item()
        sdpa = (F.scaled_dot_product_attention(q[i : i + 1], k, v)[0].double() - exact).abs().max().item()
        ulp = torch.finfo(dtype).eps * exact.abs().max().item()  # rounding the output alone: half an ulp
        assert ours <= max(sdpa, ulp) * 1.5 + 1e-6, (ours, sdpa)


@needs_kernel
@pytest.mark.parametrize("g,hd", [(2, 64), (3, 64), (4, 64), (4, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_kv_groups_heads_round_as_each_head_alone(g, hd, dtype):
    """The heads of a kv group share each key and value row as it is read; every head's output has the
    bits it has when it is the group's only head (the fmadds and sums of each element are unchanged).
    hd 256: rows wider than the registers (AVX2), their scores four keys at a time and their values
    in slices of the row."""
    q, k_pool, v_pool, _, table, ctx = random_batch(dtype, 3, g, hd, 16, [83, 5, 40], seed=g)
    together = cpu_attention.paged_decode_attention(q, k_pool, v_pool, table, ctx)
    for j in range(g):
        alone = cpu_attention.paged_decode_attention(q[:, :, j : j + 1].contiguous(), k_pool, v_pool, table, ctx)
        assert torch.equal(together[:, :, j : j + 1], alone)


@needs_kernel
@pytest.mark.parametrize("pool", ["fp32", "bf16", "fp16-pool", "int8"])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("kv,g,hd", [(3, 3, 64), (2, 1, 80)])
def test_a_sequences_verify_rows_round_as_each_row_alone(pool, window, kv, g, hd):
    """A verify chunk (speculative decoding: one sequence's consecutive positions as rows, each row's
    table cut to the blocks it reaches, as the engine writes them) is one task that reads each key and
    value row once for all its rows; each row has the bits it has as the batch's only row: chunks of
    2-6 rows, across block edges and past a window's start, beside lone rows and beside another
    sequence's row one position further (which must not join the chunk: its blocks differ)."""
    dtype = torch.bfloat16 if pool == "bf16" else torch.float32
    bs = 16
    lens = [60, 61, 62, 63, 64, 65, 9, 16, 17, 44, 45, 46, 47, 48, 16, 17]
    seq = [0, 0, 0, 0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 3, 4, 5]
    q, k_pool, v_pool, tables, _, ctx = random_batch(dtype, kv, g, hd, bs, [65, 9, 17, 48, 16, 17], n_blocks=24,
                                                     seed=5)
    q = torch.randn(len(lens), kv, g, hd, generator=torch.Generator().manual_seed(6)).to(dtype)
    table = torch.zeros(len(lens), max(len(t) for t in tables) + 1, dtype=torch.int32)
    for row, (n, s_) in enumerate(zip(lens, seq)):
        reach = -(-n // bs)
        table[row, :reach] = tables[s_][:reach]
    table = _released(table, lens, bs, window)
    ctx = torch.tensor(lens, dtype=torch.int32)
    if pool == "fp16-pool":
        k_pool, v_pool = k_pool.half(), v_pool.half()
    elif pool == "int8":
        k_pool, v_pool = quantize_kv(k_pool), quantize_kv(v_pool)
    together = cpu_attention.paged_decode_attention(q, k_pool, v_pool, table, ctx, window)
    for row in range(len(lens)):
        alone = cpu_attention.paged_decode_attention(q[row : row + 1], k_pool, v_pool, table[row : row + 1],
                                                     ctx[row : row + 1], window)
        assert torch.equal(together[row : row + 1], alone), row


@needs_kernel
@pytest.mark.parametrize("pool", ["fp32", "bf16", "fp16-pool", "int8"])
@pytest.mark.parametrize("kv,g,hd,window", [(1, 4, 256, None), (1, 4, 256, 300), (3, 3, 64, None), (1, 2, 40, 500)])
def test_a_lone_streams_split_tasks_round_as_whole_tasks(pool, kv, g, hd, window):
    """A single stream's step has fewer (sequence, kv head) tasks than threads, so each task's scores are
    split by blocks and its values by ranges of the head dimension across threads. Its rows (one query,
    and a verify chunk of three) have the bits they have in a batch whose tasks run whole, on 1, 2 or 3
    threads alike (a head size of 40 leaves a part that is not whole vectors)."""
    dtype = torch.bfloat16 if pool == "bf16" else torch.float32
    bs = 16
    lone = [700, 698, 699, 700]  # a lone row; a verify chunk of three over the same blocks
    others = [650, 300, 701, 512, 90, 333, 640, 480]  # enough tasks for whole ones
    q, k_pool, v_pool, tables, _, _ = random_batch(dtype, kv, g, hd, bs, [700] + others, n_blocks=400, seed=hd)
    rows = [(n, 0) for n in lone] + [(n, 1 + i) for i, n in enumerate(others)]
    q = torch.randn(len(rows), kv, g, hd, generator=torch.Generator().manual_seed(9)).to(dtype)
    table = torch.zeros(len(rows), max(len(t) for t in tables) + 1, dtype=torch.int32)
    for row, (n, seq) in enumerate(rows):
        table[row, : -(-n // bs)] = tables[seq][: -(-n // bs)]
    table = _released(table, [n for n, _ in rows], bs, window)
    ctx = torch.tensor([n for n, _ in rows], dtype=torch.int32)
    if pool == "fp16-pool":
        k_pool, v_pool = k_pool.half(), v_pool.half()
    elif pool == "int8":
        k_pool, v_pool = quantize_kv(k_pool), quantize_kv(v_pool)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = cpu_attention.paged_decode_attention(q, k_pool, v_pool, table, ctx, window)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for first, n in ((0, 1), (1, 3)):
                alone = cpu_attention.paged_decode_attention(q[first : first + n], k_pool, v_pool,
                                                             table[first : first + n], ctx[first : first + n], window)
                assert torch.equal(alone, batch[first : first + n]), (threads, first)
    finally:
        torch.set_num_threads(saved)


@needs_kernel
def test_float32_queries_read_a_float16_pool():
    """``--kv-cache fp16``: fp32 activations over float16 pools, each row widened as it is read: SDPA
    in fp32 over the same fp16 rows, within fp32 rounding."""
    lens = [1, 15, 16, 17, 53, 200]
    q, k_pool, v_pool, tables, table, ctx = random_batch(torch.float32, 3, 3, 64, 16, lens, seed=7)
    k_pool, v_pool = k_pool.half(), v_pool.half()
    got = cpu_attention.paged_decode_attention(q, k_pool, v_pool, table, ctx)
    assert got.dtype == torch.float32
    for i, n in enumerate(lens):
        k, v = gather(k_pool, v_pool, tables[i], n)  # float16 rows
        assert k.dtype == torch.float16
        want = F.scaled_dot_product_attention(q[i : i + 1], k.float(), v.float())[0]
        assert (got[i] - want).abs().max().item() <= 2e-6 * max(1.0, want.abs().max().item())
    with pytest.raises(RuntimeError, match="must share a dtype"):
        cpu_attention.paged_decode_attention(q.bfloat16(), k_pool, v_pool, table, ctx)


@needs_kernel
def test_paged_kernel_runs_on_many_threads_alike():
    q, k_pool, v_pool, _, table, ctx = random_batch(torch.float32, 2, 3, 64, 16, [300, 17, 1, 64] * 8, 400)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_decode_attention(q, k_pool, v_pool, table, ctx)
        torch.set_num_threads(max(2, saved))
        many = cpu_attention.paged_decode_attention(q, k_pool, v_pool, table, ctx)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, many)


@needs_kernel
def test_paged_kernel_refuses_bad_tables():
    q, k_pool, v_pool, _, table, ctx = random_batch(torch.float32, 1, 1, 16, 16, [20, 5])
    bad = table.clone()
    bad[0, 1] = 40  # the pool has blocks 0..39
    with pytest.raises(RuntimeError, match="block id 40 of sequence 0 is outside the pool of 40"):
        cpu_attention.paged_decode_attention(q, k_pool, v_pool, bad, ctx)
    with pytest.raises(RuntimeError, match="has context length 49, its table holds 48"):
        cpu_attention.paged_decode_attention(q, k_pool, v_pool, table, torch.tensor([49, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="context length 0"):
        cpu_attention.paged_decode_attention(q, k_pool, v_pool, table, torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="block_tables must be"):
        cpu_attention.paged_decode_attention(q, k_pool, v_pool, table.long(), ctx)
    with pytest.raises(RuntimeError, match="does not match the pools"):
        cpu_attention.paged_decode_attention(q[:, :, :, :8], k_pool, v_pool, table, ctx)
    released = table.clone()
    released[0, 0] = -1  # a block a window of 4 has left (20 keys: it reads 16..19, block 1 only)
    cpu_attention.paged_decode_attention(q, k_pool, v_pool, released, ctx, 4)
    with pytest.raises(RuntimeError, match="block id -1 of sequence 0"):
        cpu_attention.paged_decode_attention(q, k_pool, v_pool, released, ctx)  # no window: it is read
    with pytest.raises(RuntimeError, match="is not float, bfloat16 or half"):
        cpu_attention.paged_decode_attention(q.int(), k_pool.int(), v_pool.int(), table, ctx)


def chunk_case(dtype, kv, g, hd, bs, n, q_pos, window, seed=0):
    """A chunk of n rows at q_pos over shuffled blocks of a pool of ``dtype``: q (n, KV, G, hd), the
    pools, the table from the first block a row reads on, that block's index; the rows of the last
    block past the context are NaN (never written), as are the table's entries before it (-1)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = q_pos + n
    nb = -(-ctx // bs)
    k_pool = (torch.randn(nb + 5, kv, bs, hd, generator=gen) * 2).to(dtype)
    v_pool = torch.randn(nb + 5, kv, bs, hd, generator=gen).to(dtype)
    table = torch.randperm(nb + 5, generator=gen)[:nb]
    if ctx % bs:
        k_pool[table[-1], :, ctx % bs :] = float("nan")
        v_pool[table[-1], :, ctx % bs :] = float("nan")
    first = 0 if window is None else max(0, q_pos - window + 1) // bs
    q = torch.randn(n, kv, g, hd, generator=gen)
    return q, k_pool, v_pool, table[first:], first


def chunk_reference(q, k_pool, v_pool, blocks, first, q_pos, window):
    """The chunk's attention in float64 over its gathered keys, with the causal (and window) mask."""
    n, kv, g, hd = q.shape
    bs = k_pool.shape[2]
    ks, vs = gather(k_pool, v_pool, blocks, q_pos + n - first * bs, torch.float32)  # (1, KV, L, hd)
    keys = torch.arange(first * bs, q_pos + n)[None, :]
    rows = torch.arange(q_pos, q_pos + n)[:, None]
    seen = (keys <= rows) & (keys > rows - window if window is not None else True)  # (n, L)
    s = torch.einsum("nkgd,kld->kgnl", q.double(), ks[0].double()) / math.sqrt(hd)
    p = s.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("kgnl,kld->nkgd", p, vs[0].double())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv,g,hd,bs", [(1, 4, 256, 16), (3, 3, 64, 16), (2, 1, 32, 8), (2, 2, 48, 12)])
@pytest.mark.parametrize("n,q_pos,window", [(1, 0, None), (130, 0, None), (40, 300, None), (90, 200, 37),
                                            (300, 0, 64)])
def test_chunk_kernel_matches_float64_attention(dtype, kv, g, hd, bs, n, q_pos, window):
    """A prefill chunk's rows, from position 0 or after a cached prefix, causal among themselves, under
    a window or not, GQA groups, block sizes that do and do not divide into the kernel's 16-key chunks:
    float64 attention's values to fp32 rounding, unwritten (NaN) rows and released blocks never read."""
    assert cpu_attention.chunk_kernel(hd) is not None
    q, k_pool, v_pool, blocks, first = chunk_case(dtype, kv, g, hd, bs, n, q_pos, window)
    got = cpu_attention.paged_chunk_attention(q, k_pool, v_pool, blocks, first, q_pos, window, hd ** -0.5)
    want = chunk_reference(q, k_pool, v_pool, blocks, first, q_pos, window)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("window", [None, 24])
def test_chunk_rows_have_their_bits_in_any_chunking(window):
    """A prompt's rows attended whole, in three chunks (as a chunked prefill or a prefix-cache hit
    runs them), or on one thread: the same bits, row for row."""
    q, k_pool, v_pool, blocks, _ = chunk_case(torch.float32, 2, 3, 64, 16, 100, 0, None)
    assert cpu_attention.chunk_kernel(64) is not None
    whole = cpu_attention.paged_chunk_attention(q, k_pool, v_pool, blocks, 0, 0, window, 0.125)
    for a, b in [(0, 37), (37, 38), (38, 100)]:
        first = 0 if window is None else max(0, a - window + 1) // 16
        part = cpu_attention.paged_chunk_attention(q[a:b], k_pool, v_pool, blocks[first:], first, a, window, 0.125)
        assert torch.equal(part, whole[a:b])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_attention.paged_chunk_attention(q, k_pool, v_pool, blocks, 0, 0, window, 0.125), whole)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_chunk_kernel_refuses_what_it_cannot_read():
    """Head dims that are not whole 16-key panels get no chunk kernel (SDPA runs); a table too short
    for the chunk, one that starts after a row's oldest key or names a block outside the pool is an
    error, not a read of memory that is not the pool's."""
    assert cpu_attention.chunk_kernel(40) is None and cpu_attention.chunk_kernel(64) is not None
    q, k_pool, v_pool, blocks, _ = chunk_case(torch.float32, 2, 2, 32, 16, 40, 20, None)
    with pytest.raises(RuntimeError, match="the table is too short"):
        cpu_attention.paged_chunk_attention(q, k_pool, v_pool, blocks[:2], 0, 20, None, 0.2)
    with pytest.raises(RuntimeError, match="after the oldest key"):
        cpu_attention.paged_chunk_attention(q, k_pool, v_pool, blocks[1:], 1, 20, None, 0.2)
    bad = blocks.clone()
    bad[1] = k_pool.shape[0]
    with pytest.raises(RuntimeError, match="is not in the pool"):
        cpu_attention.paged_chunk_attention(q, k_pool, v_pool, bad, 0, 20, None, 0.2)
    with pytest.raises(RuntimeError, match="not a multiple of 16"):
        cpu_attention.paged_chunk_attention(q[..., :8], k_pool[..., :8], v_pool[..., :8], blocks, 0, 20, None, 0.2)


#: Two prompts and their block tables: P1 spans three blocks, its last one part full.
P1, P2 = [(7 * i) % 300 + 3 for i in range(40)], [200, 11, 64, 9, 31, 5, 77]
T1, T2 = [3, 1, 7], [4]


def three_paged_steps(model, kv_dtype: str, kernel, chunk=None) -> tuple[KVPool, list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """P1 and P2 through three paged steps over a fresh pool of ``kv_dtype``: P1's first 20 tokens
    beside all of P2; the rest of P1 beside P2's decode token 9; decode tokens 11 and 12. The pool,
    and each step's logits (S_out, vocab)."""
    config = model.config
    pool = KVPool.allocate(config, plan_pool(config, 1 << 20, model.dtype, 16, kv_dtype), model.device)
    cos, sin = cache_rope_tables(config, 128, model.device)
    cos, sin = cos.to(model.dtype), sin.to(model.dtype)

    def run(chunks):
        step, ids = PagedStep.build(pool, chunks, cos, sin, kernel, chunk)
        with torch.inference_mode():
            return model(ids, step)[0]

    return pool, [run([step_chunk(P1[:20], 0, T1, False), step_chunk(P2, 0, T2, True)]),
                  run([step_chunk(P1[20:], 20, T1, True), step_chunk([9], 7, T2, True)]),
                  run([step_chunk([11], 40, T1, True), step_chunk([12], 8, T2, True)])]


@pytest.mark.parametrize("attention", ["kernels", "kernel", "sdpa"])
def test_paged_forward_gives_the_full_forwards_logits(tiny_fp32, attention):
    """Two sequences through three paged steps (a first chunk beside a whole prompt; the rest of the
    prompt beside a decode token; two decode tokens), blocks scattered: each row's logits are those of
    a whole cache-less forward of that sequence, and the pool holds the keys where the tables say;
    with the decode and chunk kernels (the engine's CPU steps), the decode kernel alone, or SDPA."""
    kernel = cpu_attention.paged_kernel() if attention != "sdpa" else None
    chunk = cpu_attention.chunk_kernel(tiny_fp32.config.head_dim) if attention == "kernels" else None
    if attention != "sdpa" and kernel is None:
        pytest.skip("no C++ kernel here")
    model = tiny_fp32.model
    pool, (s1, s2, s3) = three_paged_steps(model, "16bit", kernel, chunk)
    with torch.inference_mode():
        full1 = model(torch.tensor([P1 + [11]]))[0]  # (41, vocab)
        full2 = model(torch.tensor([P2 + [9, 12]]))[0]  # (9, vocab)
    want = {"p2": full2[6], "p1": full1[39], "p2+9": full2[7], "p1+11": full1[40], "p2+9+12": full2[8]}
    got = {"p2": s1[0], "p1": s2[0], "p2+9": s2[1], "p1+11": s3[0], "p2+9+12": s3[1]}
    for name, w in want.items():
        assert torch.allclose(got[name], w, atol=2e-5, rtol=0), name
    assert not torch.equal(got["p1"], got["p1+11"])  # the steps really differ
