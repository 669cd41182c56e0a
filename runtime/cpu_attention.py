"""The CPU decode step's attention: ``localllm::decode_attention`` (``csrc/decode_attention.cpp``, built
by :mod:`localllm.native` as :data:`LIBRARY`), one query per head over the cached keys.

Why a kernel of our own: torch's flash-attention CPU kernel costs 20-30 us a call on a decode step's
few hundred keys (blocking, buffers, GEMM set-up around ~0.1 MFLOP of work), 0.6-0.9 ms of a 5 ms
compiled SmolLM2 step; this one does the same arithmetic in a few us. ``loaders.load`` installs it in
every layer of a CPU model (:meth:`runtime.model.Transformer.set_decode_attention`), so eager and
compiled decode run the same attention and the compiled step stays the eager one fused. (With SDPA
left in eager decode, the two roundings drifted apart enough to change greedy tokens at near-ties.)

``localllm::paged_decode_attention`` is its batch-engine form: one query per sequence of a batch, each
over its own keys/values in the paged KV pool's blocks (:mod:`runtime.paged`); it rounds exactly as
``decode_attention`` over the same rows gathered.

``decode_attention_q8`` and ``paged_decode_attention_q8`` read an int8 KV cache (:class:`QuantKV`: int8
codes and an fp32 scale per token and kv head) where it lies, folding each row's scale into its dot
product (keys) or its softmax weight (values): no 16-bit copy of the cache is made. The Python entry
points below take either form and call the matching op.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from localllm import native
from localllm.runtime.cache import QuantKV
from localllm.runtime.model import DecodeAttention
from localllm.runtime.paged import PagedDecodeAttention


def _register_fakes() -> None:
    """The op's output shape for tracing (torch.export, torch.compile), without running it."""

    @torch.library.register_fake("localllm::decode_attention")
    def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("localllm::paged_decode_attention")
    def _paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("localllm::decode_attention_q8")
    def _attention_q8(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor,
                      v_scale: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("localllm::paged_decode_attention_q8")
    def _paged_q8(q: torch.Tensor, k_pool: torch.Tensor, k_scale: torch.Tensor, v_pool: torch.Tensor,
                  v_scale: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)


LIBRARY = native.NativeLibrary(
    "localllm_attention", (Path(__file__).resolve().parent / "csrc" / "decode_attention.cpp",),
    ("decode_attention", "paged_decode_attention", "decode_attention_q8", "paged_decode_attention_q8"),
    _register_fakes,
)


def decode_attention(q: torch.Tensor, k: torch.Tensor | QuantKV, v: torch.Tensor | QuantKV) -> torch.Tensor:
    """Softmax attention of one query per head: q (B, KV, G, hd), the G query heads that share each
    kv head; k, v (B, KV, L, hd), the cached keys and values (any strides), tensors of q's dtype or an
    int8 cache's QuantKV views (codes (B, KV, L, hd), scales (B, KV, L)). Returns (B, KV, G, hd) in q's
    dtype, as ``F.scaled_dot_product_attention(q, k, v)`` does (on the dequantized rows for int8)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(k, QuantKV) and isinstance(v, QuantKV):
        return torch.ops.localllm.decode_attention_q8(q, k.codes, k.scales, v.codes, v.scales, scale)
    return torch.ops.localllm.decode_attention(q, k, v, scale)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor | QuantKV, v_pool: torch.Tensor | QuantKV,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """One query per sequence over the paged pool: q (S, KV, G, hd); k_pool, v_pool (n_blocks, KV,
    block, hd), or an int8 pool's QuantKV (scales (n_blocks, KV, block)); block_tables (S, max_blocks)
    int32, sequence s's keys being the first ``context_lens[s]`` rows of its blocks in table order;
    context_lens (S,) int32. Returns (S, KV, G, hd) in q's dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(k_pool, QuantKV) and isinstance(v_pool, QuantKV):
        return torch.ops.localllm.paged_decode_attention_q8(
            q, k_pool.codes, k_pool.scales, v_pool.codes, v_pool.scales, block_tables, context_lens, scale)
    return torch.ops.localllm.paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale)


def paged_kernel(cache_dir: Path | None = None) -> PagedDecodeAttention | None:
    """:func:`paged_decode_attention` once localllm's CPU kernels are loaded; None where they cannot be
    built (the batch engine then attends with SDPA over gathered blocks)."""
    return paged_decode_attention if native.available(LIBRARY, cache_dir) else None


def kernel(cache_dir: Path | None = None) -> DecodeAttention | None:
    """:func:`decode_attention` once localllm's CPU kernels are loaded (built under ``cache_dir`` the
    first time); None where they cannot be built (decode then runs SDPA; :mod:`localllm.native` warns)."""
    return decode_attention if native.available(LIBRARY, cache_dir) else None
