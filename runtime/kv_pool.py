"""The paged KV pool: every sequence's keys and values, in fixed-size blocks allocated once.

One pair of tensors per layer, ``(n_blocks, kv_heads, block_size, head_dim)`` for keys and for values;
for an int8 pool (``kv_dtype="int8"``) each is a :class:`runtime.cache.QuantKV`: int8 codes of that
shape and fp32 scales ``(n_blocks, kv_heads, block_size)``, one per token and kv head.
A sequence owns no tensor of its own, only a list of block ids (its block table, kept by
:mod:`runtime.block_manager`): token ``p`` of a sequence lives in block ``table[p // block_size]`` at row
``p % block_size``. The pool belongs to the batch engine (:mod:`runtime.batch`), never to the model,
which reads and writes it through the per-step metadata it is given (:mod:`runtime.paged`).

The number of blocks comes from a memory budget in bytes, so the pool's size is known, and said,
before anything runs: :meth:`KVPool.plan` gives the numbers, :meth:`KVPool.allocate` the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.errors import LocalLLMError
from localllm.runtime.cache import DEFAULT_KV_DTYPE, QuantKV, check_kv_dtype, empty_kv, readable
from localllm.runtime.config import ModelConfig

#: Tokens per block. 16 keeps the waste of a sequence's last, partly filled block small; 32 halves
#: the block-table work per token. Other sizes work but are not tuned.
BLOCK_SIZES = (16, 32)
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class PoolPlan:
    """The pool's numbers, before (or without) allocating it."""

    n_blocks: int
    block_size: int
    bytes_per_block: int  # keys and values of every layer
    budget_bytes: int
    dtype: torch.dtype  # the activations' (a 16-bit pool's elements)
    kv_dtype: str = DEFAULT_KV_DTYPE  # "16bit" or "int8"

    @property
    def tokens(self) -> int:
        """Token positions the pool holds, across all sequences."""
        return self.n_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.n_blocks * self.bytes_per_block

    def describe(self) -> str:
        """One line, e.g. ``KV pool: 728 blocks x 16 tokens = 11648 tokens, 256.0 MiB (bfloat16)``."""
        dtype = "int8 + fp32 scales" if self.kv_dtype == "int8" else str(self.dtype).removeprefix("torch.")
        return (f"KV pool: {self.n_blocks} blocks x {self.block_size} tokens = {self.tokens} tokens, "
                f"{self.bytes / 2**20:.1f} MiB ({dtype})")


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str = DEFAULT_KV_DTYPE) -> int:
    """Bytes of one block: keys and values of ``block_size`` tokens in every layer."""
    per_value = "int8" if kv_dtype == "int8" else torch.empty((), dtype=dtype).element_size()
    return config.kv_cache_bytes(block_size, per_value)


def plan_pool(config: ModelConfig, budget_bytes: int, dtype: torch.dtype,
              block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str = DEFAULT_KV_DTYPE) -> PoolPlan:
    """As many blocks as ``budget_bytes`` holds. Refuses a budget that holds no block, with the numbers."""
    check_kv_dtype(kv_dtype)
    if block_size < 1:
        raise LocalLLMError(f"a KV block of {block_size} tokens is not possible",
                            f"use one of {', '.join(map(str, BLOCK_SIZES))}")
    per_block = block_bytes(config, block_size, dtype, kv_dtype)
    n_blocks = budget_bytes // per_block
    if n_blocks < 1:
        raise LocalLLMError(
            f"a KV cache budget of {budget_bytes} bytes holds no block: one block of {block_size} tokens "
            f"takes {per_block} bytes for this model",
            f"give the KV cache at least {per_block} bytes (more to serve long or many requests)",
        )
    return PoolPlan(n_blocks, block_size, per_block, budget_bytes, dtype, kv_dtype)


class KVPool:
    """The allocated pool: ``k[layer]`` and ``v[layer]``, ``(n_blocks, kv_heads, block_size, head_dim)``
    (tensors, or :class:`runtime.cache.QuantKV` for an int8 pool)."""

    def __init__(self, plan: PoolPlan, k: list[torch.Tensor | QuantKV], v: list[torch.Tensor | QuantKV]) -> None:
        self.plan = plan
        self.k, self.v = k, v

    @classmethod
    def allocate(cls, config: ModelConfig, plan: PoolPlan, device: torch.device) -> "KVPool":
        """Zeroed tensors for ``plan`` on ``device`` (zeros: a block's unused rows are never read,
        but stay finite should a kernel touch them)."""
        shape = (plan.n_blocks, config.n_kv_heads, plan.block_size, config.head_dim)
        k = [empty_kv(shape, plan.kv_dtype, plan.dtype, device) for _ in range(config.n_layers)]
        v = [empty_kv(shape, plan.kv_dtype, plan.dtype, device) for _ in range(config.n_layers)]
        return cls(plan, k, v)

    @property
    def n_blocks(self) -> int:
        return self.plan.n_blocks

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype

    @property
    def kv_dtype(self) -> str:
        return self.plan.kv_dtype

    def gather(self, layer: int, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first ``length`` keys and values of ``layer`` (see :func:`gather`)."""
        return gather(self.k[layer], self.v[layer], blocks, length, self.plan.dtype)


def _gather_rows(pool: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """(n_blocks, KV, bs, ...) -> (1, KV, length, ...): the rows of ``blocks`` in table order (a copy)."""
    rows = pool.index_select(0, blocks)  # (n, KV, bs, ...)
    n, kv, bs = rows.shape[:3]
    return rows.transpose(0, 1).reshape(1, kv, n * bs, *rows.shape[3:])[:, :, :length]


def gather(k_pool: torch.Tensor | QuantKV, v_pool: torch.Tensor | QuantKV, blocks: torch.Tensor,
           length: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``length`` keys and values as contiguous (1, kv_heads, length, head_dim)
    tensors, copied from the pool tensors (n_blocks, kv_heads, block, head_dim) through its block ids
    ``blocks`` (n,) long (the SDPA path's input, and tests'). An int8 pool's rows are dequantized to
    ``dtype`` (these rows only: the pool itself stays int8)."""
    out = []
    for pool in (k_pool, v_pool):
        if isinstance(pool, QuantKV):
            rows = QuantKV(_gather_rows(pool.codes, blocks, length), _gather_rows(pool.scales, blocks, length))
            out.append(readable(rows, dtype or torch.float32))
        else:
            out.append(_gather_rows(pool, blocks, length))
    return out[0], out[1]
