"""The batch engine's attention on the CPU, over keys and values where they lie in the paged KV pool's
blocks (``csrc/``, built by :mod:`localllm.native` as :data:`LIBRARY`): ``localllm::paged_decode_attention``,
one query per sequence, and ``localllm::paged_chunk_attention``, a prefill chunk's rows of one sequence.

Why a kernel of our own: torch's flash-attention CPU kernel costs 20-30 us a call on a decode step's
few hundred keys (blocking, buffers, GEMM set-up around ~0.1 MFLOP of work), and SDPA would need each
sequence's history gathered out of its blocks first; this one does the same arithmetic in a few us
with no copy. A sliding-window layer passes its window, so the kernel reads only the keys a query
sees: a windowed model's step is one piece of code at every length, which the compiled step needs.

A prefill chunk (:func:`paged_chunk_attention`) is many rows of one sequence: there the work is
GEMM-shaped, and the kernel runs it through the quantized GEMMs' fp32 register tiles, reading 16 keys
at a time from their blocks, with an online softmax (``csrc/chunk_attention.cpp`` says why not SDPA
over a gathered copy).

``paged_decode_attention_q8`` reads an int8 pool (:class:`QuantKV`: int8 codes and an fp32 scale per
token and kv head) where it lies, folding each row's scale into its dot product (keys) or its softmax
weight (values): no 16-bit copy of the pool is made. The Python entry point below takes either form.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from localllm import native
from localllm.runtime.cache import QuantKV
from localllm.runtime.paged import PagedChunkAttention, PagedDecodeAttention


def _register_fakes() -> None:
    """The ops' output shapes for tracing (torch.export), without running them."""

    @torch.library.register_fake("localllm::paged_decode_attention")
    def _paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float, window: int = 0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("localllm::paged_decode_attention_q8")
    def _paged_q8(q: torch.Tensor, k_pool: torch.Tensor, k_scale: torch.Tensor, v_pool: torch.Tensor,
                  v_scale: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("localllm::paged_chunk_attention")
    def _chunk(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor, first_pos: int,
               q_pos: int, window: int, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)


_CSRC = Path(__file__).resolve().parent / "csrc"
_QUANT_CSRC = Path(__file__).resolve().parent.parent / "quant" / "csrc"  # the register tiles it shares
LIBRARY = native.NativeLibrary(
    "localllm_attention", (_CSRC / "decode_attention.cpp", _CSRC / "chunk_attention.cpp"),
    ("paged_decode_attention", "paged_decode_attention_q8", "paged_chunk_attention"),
    _register_fakes,
    headers=(_QUANT_CSRC / "panel_gemm.h", _QUANT_CSRC / "parallel_rows.h"),
)

#: The chunk kernel takes head dims that are multiples of this (whole 16-wide panels).
CHUNK_HEAD_DIM = 16


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor | QuantKV, v_pool: torch.Tensor | QuantKV,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over the paged pool: q (S, KV, G, hd), the G query heads that share each
    kv head; k_pool, v_pool (n_blocks, KV, block, hd), or an int8 pool's QuantKV (scales (n_blocks, KV,
    block)); block_tables (S, max_blocks) int32, sequence s's keys being the first ``context_lens[s]``
    rows of its blocks in table order; context_lens (S,) int32. With a ``window``, sequence s's query
    (at position ``context_lens[s] - 1``) sees only the last ``window`` of those keys, and table entries
    before them are not read (a sliding-window group's given-back blocks). Returns (S, KV, G, hd) in
    q's dtype, as SDPA over the gathered (dequantized) rows does. ``sinks`` (KV * G,) fp32: each query
    head's sink logit (gpt-oss), which joins its softmax's max and sum and carries no value."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    w = window or 0
    if isinstance(k_pool, QuantKV) and isinstance(v_pool, QuantKV):
        return torch.ops.localllm.paged_decode_attention_q8(
            q, k_pool.codes, k_pool.scales, v_pool.codes, v_pool.scales, block_tables, context_lens, scale, w, sinks)
    return torch.ops.localllm.paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale, w, sinks)


#: The decode kernel takes a model's attention sinks (``sinks=``): :func:`runtime.attention.paged` asks.
paged_decode_attention.takes_sinks = True  # type: ignore[attr-defined]


def paged_kernel(cache_dir: Path | None = None) -> PagedDecodeAttention | None:
    """:func:`paged_decode_attention` once localllm's CPU kernels are loaded (built under ``cache_dir``
    the first time); None where they cannot be built (the batch engine then attends with SDPA over
    gathered blocks; :mod:`localllm.native` warns)."""
    return paged_decode_attention if native.available(LIBRARY, cache_dir) else None


def paged_chunk_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                          first: int, q_pos: int, window: int | None, scale: float,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of one sequence over its keys where they lie in the pool: q (n, KV, G, hd) fp32, row i at
    position ``q_pos + i`` and seeing the keys up to its own (under a ``window``, only its last
    ``window``); k_pool, v_pool (n_blocks, KV, block, hd) fp32, fp16 or bf16, every key up to the last
    row's already written; blocks (nb,) long: the sequence's block table from its block ``first`` on
    (those before hold no key a row sees: :meth:`runtime.paged.PagedStep.first_block`); ``scale`` the
    scores'. Returns (n, KV, G, hd) fp32: SDPA's values over the gathered keys, to fp32 rounding. ``sinks``
    (KV * G,) fp32: each query head's sink logit (gpt-oss), where each row's online softmax starts."""
    bs = k_pool.shape[2]
    return torch.ops.localllm.paged_chunk_attention(q, k_pool, v_pool, blocks, first * bs, q_pos, window or 0, scale,
                                                    sinks)


paged_chunk_attention.takes_sinks = True  # type: ignore[attr-defined]


def chunk_kernel(head_dim: int, cache_dir: Path | None = None) -> PagedChunkAttention | None:
    """:func:`paged_chunk_attention` for a model of ``head_dim`` once localllm's CPU kernels are loaded;
    None where they cannot be built or the kernel does not take that head dim (prefill chunks then
    attend with SDPA over gathered blocks)."""
    if head_dim % CHUNK_HEAD_DIM or not native.available(LIBRARY, cache_dir):
        return None
    return paged_chunk_attention
