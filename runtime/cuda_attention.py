"""The batch engine's attention on CUDA: every span of a step (decode rows, verify rows, prefill chunks
over cached prefixes) in one Triton kernel launch that reads keys and values where they lie in the
paged pool's blocks, through each sequence's block table. No history is gathered.

Why a Triton kernel of our own rather than torch's flex attention over a block mask:

* **int8 pools.** The kernel reads int8 codes and folds each row's fp32 scale in (a key's into its
  score, a value's into its softmax weight), as the CPU kernel does. Flex attention takes keys and
  values in the query's dtype only, so an int8 pool would need a dequantized copy every step.
* **GQA.** The G query heads that share a kv head are rows of one tile: each key block is read once
  per kv head, not once per query head.
* **Windows.** A sliding window is a per-row bound on the keys a row sees. A tile reads only the key
  blocks its rows' windows reach, so a window group's given-back blocks (-1 in its table) are never read.
* **Decode at small batch.** When tiles x kv heads are fewer than the SMs, the keys are split across
  programs (flash-decoding) and the partial results combined by a second kernel. The split count
  depends on the tile count alone, so a CUDA graph captured for a batch size replays at any context.
* **Checked on any machine.** The same kernel source runs under Triton's interpreter on CPU tensors
  (``tests/test_cuda_attention.py``); flex attention's CPU path is a different code generator from
  its CUDA one.
* **Compiling.** Every shape-dependent choice is a ``constexpr``; a step's launch depends on the
  number of tiles, the rows per tile (1 for steps of single queries) and the pool's dtype, so a model
  compiles a handful of variants, once.

Layout of a launch: the step's queries ``q`` (N, KV, G, hd), every sequence's rows in turn; ``tiles``
(T, 4) int32, each ``(sequence, first row, rows, position of the first row)`` of up to ``tile_rows``
consecutive query rows of one sequence; ``block_tables`` (S, max_blocks) int32 and ``context_lens``
(S,) int32 per sequence. Row ``i`` of a tile sits at position ``p = position + i`` and sees the keys at
positions ``0 .. p`` (``p - window + 1 .. p`` with a window), all written to the pool before the call.

Triton ships with torch's CUDA builds. The runtime imports it only when an engine on a CUDA device
asks for this kernel (:func:`span_kernel`); localllm does not depend on it, and its dev extra installs
it for the interpreter's checks.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from localllm.runtime.cache import QuantKV
from localllm.triton_kernels import available, check_device, jit

if available():  # only on CUDA (and in the interpreter's checks): the CPU runtime never imports this module
    import triton
    import triton.language as tl

#: Keys per inner step of the kernel (any multiple of the pool's block size or not: rows are
#: addressed one by one through the table).
BLOCK_N = 32
#: Query rows per tile in steps with a prefill chunk (steps of single queries use 1): with a kv
#: group's heads at most 8 x 16 query rows a tile, within an sm86/sm89 SM's shared memory.
PREFILL_TILE_ROWS = 8
#: Most key splits a tile's work is cut into (decode at small batch).
MAX_SPLITS = 16


@jit
def _span_attention(
    Q, K, V, KS, VS, O, PART, STATS, TABLES, TILES,
    sm_scale, window,
    sq_n, sq_h, sq_g,  # q's strides (its last dim is contiguous)
    so_n, so_h, so_g,  # the output's
    sk_b, sk_h, sk_r,  # the pools' strides (K and V alike)
    ss_b, ss_h,  # an int8 pool's scales' strides
    st,  # the block tables' row stride
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, QUANT: tl.constexpr,
    WINDOWED: tl.constexpr, WIDEN: tl.constexpr,
):
    t = tl.program_id(0)  # tile
    h = tl.program_id(1)  # kv head
    sp = tl.program_id(2)  # key split
    seq = tl.load(TILES + t * 4)
    row0 = tl.load(TILES + t * 4 + 1)
    nrows = tl.load(TILES + t * 4 + 2)
    pos0 = tl.load(TILES + t * 4 + 3)
    BQ: tl.constexpr = BLOCK_M * GP
    i = tl.arange(0, BQ)  # a tile's query: row i // GP, head i % GP of the kv group
    r = i // GP
    g = i % GP
    q_ok = (r < nrows) & (g < G)
    q_pos = pos0 + r
    d = tl.arange(0, HDP)
    d_ok = d < HD
    q_off = (row0 + r).to(tl.int64)[:, None] * sq_n + h * sq_h + g[:, None] * sq_g + d[None, :]
    q = tl.load(Q + q_off, mask=q_ok[:, None] & d_ok[None, :], other=0.0)  # (BQ, HDP)
    if QUANT:
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)
    hi = pos0 + nrows  # keys 0 .. hi - 1: up to the last row's own
    lo = 0
    if WINDOWED:
        lo = tl.maximum(pos0 - window + 1, 0)  # the first row's oldest key
    c_lo = lo // BLOCK_N
    c_hi = tl.cdiv(hi, BLOCK_N)
    per = tl.cdiv(c_hi - c_lo, SPLITS)
    c0 = c_lo + sp * per
    c1 = tl.minimum(c0 + per, c_hi)
    m_i = tl.full([BQ], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, HDP], tl.float32)
    for c in range(c0, c1):
        j = c * BLOCK_N + tl.arange(0, BLOCK_N)  # key positions
        k_ok = (j >= lo) & (j < hi)
        blk = tl.load(TABLES + seq * st + j // BS, mask=k_ok, other=0).to(tl.int64)
        row_off = blk * sk_b + h * sk_h + (j % BS) * sk_r  # (BLOCK_N,)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, HDP)
        if QUANT:
            k = k.to(tl.float32)
        if WIDEN:  # the same products and fp32 sums as the tensor cores'
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        if QUANT:
            s = s * tl.load(KS + blk * ss_b + h * ss_h + j % BS, mask=k_ok, other=0.0)[None, :]
        s = s * sm_scale
        sees = k_ok[None, :] & (j[None, :] <= q_pos[:, None])
        if WINDOWED:
            sees = sees & (j[None, :] > q_pos[:, None] - window)
        s = tl.where(sees, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])  # (BQ, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANT:
            p = p * tl.load(VS + blk * ss_b + h * ss_h + j % BS, mask=k_ok, other=0.0)[None, :]
            v = v.to(tl.float32)
        else:
            p = p.to(V.dtype.element_ty)
        if WIDEN:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (row0 + r).to(tl.int64)[:, None] * so_n + h * so_h + g[:, None] * so_g + d[None, :]
        tl.store(O + o_off, out.to(O.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])
    else:
        part = (t * tl.num_programs(1) + h) * SPLITS + sp
        tl.store(PART + (part * BQ + i)[:, None] * HDP + d[None, :], acc)
        tl.store(STATS + (part * BQ + i) * 2, m_i)
        tl.store(STATS + (part * BQ + i) * 2 + 1, l_i)

@jit
def _combine_splits(
    PART, STATS, O, TILES, so_n, so_h, so_g,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
    SPLITS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    row0 = tl.load(TILES + t * 4 + 1)
    nrows = tl.load(TILES + t * 4 + 2)
    BQ: tl.constexpr = BLOCK_M * GP
    i = tl.arange(0, BQ)
    r = i // GP
    g = i % GP
    q_ok = (r < nrows) & (g < G)
    d = tl.arange(0, HDP)
    base = (t * tl.num_programs(1) + h) * SPLITS
    m = tl.full([BQ], float("-inf"), tl.float32)
    for sp in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(STATS + ((base + sp) * BQ + i) * 2))
    m = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, HDP], tl.float32)
    for sp in tl.static_range(SPLITS):
        w = tl.exp(tl.load(STATS + ((base + sp) * BQ + i) * 2) - m)  # 0 for an empty split
        l_sum += w * tl.load(STATS + ((base + sp) * BQ + i) * 2 + 1)
        acc += w[:, None] * tl.load(PART + ((base + sp) * BQ + i)[:, None] * HDP + d[None, :])
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    o_off = (row0 + r).to(tl.int64)[:, None] * so_n + h * so_h + g[:, None] * so_g + d[None, :]
    tl.store(O + o_off, out.to(O.dtype.element_ty), mask=q_ok[:, None] & (d < HD)[None, :])


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_splits(q: torch.Tensor, n_tiles: int, tile_rows: int) -> int:
    """How many ways each tile's keys are split: enough programs for two waves over the SMs when a
    step of single queries has fewer tiles x kv heads than that; 1 for prefill tiles and on the CPU."""
    if tile_rows > 1 or q.device.type != "cuda":
        return 1
    programs = max(1, n_tiles * q.shape[1])
    return max(1, min(MAX_SPLITS, -(-2 * _sm_count(q.device.index or 0) // programs)))


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None, block_tables: torch.Tensor, context_lens: torch.Tensor,
            tiles: torch.Tensor, scale: float, window: int, tile_rows: int, splits: int) -> torch.Tensor:
    N, KV, G, hd = q.shape
    T = tiles.shape[0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    splits = splits or default_splits(q, T, tile_rows)
    if q.stride(-1) != 1:
        q = q.contiguous()
    # The kernel's addressing: rows of the pools (and scales), tables and tiles packed along their last dim.
    tiles, block_tables = tiles.contiguous(), block_tables.contiguous()
    for t in (k, v, *((k_scale, v_scale) if k_scale is not None else ())):
        if t.stride(-1) != 1:  # type: ignore[union-attr]
            raise ValueError("the KV pool's rows must be contiguous along their last dimension")
    check_device(q, "attention")
    attend, combine = _span_attention, _combine_splits
    # A tile's queries are rows x kv-group heads, padded to at least 16 (tl.dot's least M: tensor cores
    # for every tile; a decode tile's padding rows cost compute, of which decode has plenty to spare).
    GP, HDP = max(triton.next_power_of_2(G), -(-16 // tile_rows)), triton.next_power_of_2(hd)
    BQ = tile_rows * GP
    quant = k_scale is not None
    bs = k.shape[2]
    part = stats = out  # unused with one split
    if splits > 1:
        part = q.new_empty(T * KV * splits * BQ * HDP, dtype=torch.float32)
        stats = q.new_empty(T * KV * splits * BQ * 2, dtype=torch.float32)
    ks = k_scale if quant else k
    vs = v_scale if quant else v
    ss = (ks.stride(0), ks.stride(1)) if quant else (0, 0)
    big = BQ * HDP >= 16384
    attend[(T, KV, splits)](
        q, k, v, ks, vs, out, part, stats, block_tables, tiles,
        scale, window,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        k.stride(0), k.stride(1), k.stride(2), *ss, block_tables.stride(0),
        G=G, GP=GP, BLOCK_M=tile_rows, HD=hd, HDP=HDP, BS=bs, BLOCK_N=BLOCK_N, SPLITS=splits, QUANT=quant,
        # fp32 tiles (an int8 or fp32 pool) take twice the shared memory: one stage, no pipelining
        WINDOWED=window > 0, num_warps=8 if big else 4, num_stages=1 if quant or k.dtype == torch.float32 else 2,
        # Triton's interpreter multiplies bf16 matrices wrongly (3.9); it takes them widened, exactly.
        WIDEN=k.dtype == torch.bfloat16 and q.device.type != "cuda",
    )
    if splits > 1:
        combine[(T, KV)](part, stats, out, tiles, out.stride(0), out.stride(1), out.stride(2),
                         G=G, GP=GP, BLOCK_M=tile_rows, HD=hd, HDP=HDP, SPLITS=splits, num_warps=4)
    return out


@torch.library.custom_op("localllm::paged_span_attention", mutates_args=())
def _span_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None, block_tables: torch.Tensor, context_lens: torch.Tensor,
             tiles: torch.Tensor, scale: float, window: int, tile_rows: int, splits: int) -> torch.Tensor:
    return _launch(q, k, v, k_scale, v_scale, block_tables, context_lens, tiles, scale, window, tile_rows, splits)


@_span_op.register_fake
def _(q, k, v, k_scale, v_scale, block_tables, context_lens, tiles, scale, window, tile_rows, splits):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_span_attention(q: torch.Tensor, k_pool: torch.Tensor | QuantKV, v_pool: torch.Tensor | QuantKV,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, window: int | None,
                         tiles: torch.Tensor, tile_rows: int, splits: int | None = None) -> torch.Tensor:
    """Attention of every query row of a step over the paged pool (see the module's docstring for the
    layout): q (N, KV, G, hd); k_pool, v_pool (n_blocks, KV, block, hd), or an int8 pool's QuantKV
    (codes and (n_blocks, KV, block) fp32 scales; q is then fp32, as the model gives it for such a
    pool); ``tiles`` (T, 4) int32 of at most ``tile_rows`` rows each; ``splits``: ways each tile's keys
    are split (default :func:`default_splits`). Returns (N, KV, G, hd) in q's dtype; rows no tile
    covers are left undefined."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    n = splits or 0  # 0: the launch picks (default_splits)
    w = window or 0
    if isinstance(k_pool, QuantKV) and isinstance(v_pool, QuantKV):
        return _span_op(q, k_pool.codes, v_pool.codes, k_pool.scales, v_pool.scales, block_tables, context_lens,
                        tiles, scale, w, tile_rows, n)
    return _span_op(q, k_pool, v_pool, None, None, block_tables, context_lens, tiles, scale, w, tile_rows, n)


#: What makes :func:`paged_span_attention` a span kernel for :class:`runtime.paged.PagedStep` (every
#: span of a step, in tiles of this many rows where a step has a prefill chunk).
paged_span_attention.tile_rows = PREFILL_TILE_ROWS  # type: ignore[attr-defined]


def span_kernel() -> Any:
    """:func:`paged_span_attention` where Triton is installed, else None (the engine then attends
    with SDPA over gathered blocks)."""
    return paged_span_attention if available() else None
