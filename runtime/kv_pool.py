"""The paged KV pool: every sequence's keys and values, in fixed-size blocks allocated once.

One pair of tensors per layer, ``(n_blocks, kv_heads, block_size, head_dim)`` for keys and for values;
for an int8 pool (``kv_dtype="int8"``) each is a :class:`runtime.cache.QuantKV`: int8 codes of that
shape and fp32 scales ``(n_blocks, kv_heads, block_size)``, one per token and kv head.
A sequence owns no tensor of its own, only a list of block ids (its block table, kept by
:mod:`runtime.block_manager`): token ``p`` of a sequence lives in block ``table[p // block_size]`` at row
``p % block_size``. The pool belongs to the batch engine (:mod:`runtime.batch`), never to the model,
which reads and writes it through the per-step metadata it is given (:mod:`runtime.paged`).

Layers with a sliding window (Gemma 3: five of every six) need only their window's keys, so their
blocks are given back as the window moves on. For that a model whose layers differ in window has its
layers split into *groups* of one window each (:func:`layer_groups`), every group as many layers (the
fewest any window has, a kind's last group possibly shorter), and a block holds those layers' keys
and values for ``block_size`` tokens: blocks of every group come from the one free list, and a
sequence holds a block table per group. Layer ``l`` is slot ``j`` of its group; the pool has one
tensor per slot, which all groups' blocks index (``k[l]`` is that slot's tensor). A model whose layers
all share one window (or none) is one group of every layer, a block per token range as above.

The number of blocks comes from a memory budget in bytes, so the pool's size is known, and said,
before anything runs: :meth:`KVPool.plan` gives the numbers, :meth:`KVPool.allocate` the tensors.

This module is also where KV cache bytes are counted, for the pool and for anyone sizing one (the
memory plan, ``show``, the benchmarks): :func:`row_bytes`, :func:`cache_bytes`, :func:`sequence_bytes`,
:func:`block_bytes`, :func:`sequence_pool_bytes`, :func:`sequence_pool_plan`, all over a KV type of
:data:`runtime.cache.KV_DTYPES` and the activations' dtype; and :func:`device_bytes`, what
:meth:`KVPool.allocate` puts on each device of a split model.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from localllm.errors import LocalLLMError
from localllm.runtime.cache import (DEFAULT_KV_DTYPE, QuantKV, check_kv_dtype, empty_kv, head_row_bytes, kv_label,
                                    readable)
from localllm.runtime.config import ModelConfig

#: Tokens per block. 16 keeps the waste of a sequence's last, partly filled block small; 32 halves
#: the block-table work per token. Other sizes work but are not tuned.
BLOCK_SIZES = (16, 32)
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class LayerGroup:
    """Layers whose keys and values share block tables: one attention window (None: all positions)."""

    layers: tuple[int, ...]
    window: int | None


def layer_groups(config: ModelConfig) -> tuple[LayerGroup, ...]:
    """The model's layers in groups of one window each, full-context groups first (see the module's
    docstring): one group of every layer when they all share a window."""
    kinds: dict[int | None, list[int]] = {}
    for i in range(config.n_layers):
        kinds.setdefault(config.layer_window(i), []).append(i)
    size = min(len(layers) for layers in kinds.values())
    groups = []
    for window, layers in sorted(kinds.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)):
        groups += [LayerGroup(tuple(layers[a : a + size]), window) for a in range(0, len(layers), size)]
    return tuple(groups)


def window_blocks(window: int, block_size: int, queries: int = 1) -> int:
    """Blocks a sliding-window layer group holds at most while ``queries`` consecutive positions run:
    the window behind the first query, the queries, and a partial block at each end."""
    return (window + queries - 2) // block_size + 2


@dataclass(frozen=True)
class PoolPlan:
    """The pool's numbers, before (or without) allocating it."""

    n_blocks: int
    block_size: int
    bytes_per_block: int  # keys and values of every layer
    budget_bytes: int
    dtype: torch.dtype  # the activations' (a 16-bit pool's elements)
    kv_dtype: str = DEFAULT_KV_DTYPE  # "16bit", "fp16" or "int8"
    groups: tuple[LayerGroup, ...] = ()  # () before grouping was planned: one group of every layer

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window: a block table per group."""
        return tuple(g.window for g in self.groups) or (None,)

    @property
    def tokens(self) -> int:
        """Token positions the pool holds for one sequence alone (its every group's blocks counted;
        sliding-window groups hold their window only, so a pool of such layers alone has no bound
        but the model's)."""
        return capacity_tokens(self.n_blocks, self.block_size, self.windows)

    @property
    def bytes(self) -> int:
        return self.n_blocks * self.bytes_per_block

    def describe(self) -> str:
        """One line, e.g. ``KV pool: 728 blocks x 16 tokens = 11648 tokens, 256.0 MiB (bfloat16)``."""
        dtype = kv_label(self.kv_dtype, self.dtype)
        if len(self.windows) == 1 and self.windows[0] is None:
            return (f"KV pool: {self.n_blocks} blocks x {self.block_size} tokens = {self.tokens} tokens, "
                    f"{self.bytes / 2**20:.1f} MiB ({dtype})")
        sliding = sorted({w for w in self.windows if w is not None})
        full = sum(1 for w in self.windows if w is None)
        return (f"KV pool: {self.n_blocks} blocks x {self.block_size} tokens of {len(self.groups[0].layers)} "
                f"layers, {self.bytes / 2**20:.1f} MiB ({dtype}); {len(self.windows)} layer group"
                f"{'s' if len(self.windows) > 1 else ''} "
                f"({full} full-context, {len(self.windows) - full} holding only their "
                f"{'/'.join(map(str, sliding))}-token window)")


def capacity_tokens(n_blocks: int, block_size: int, windows: tuple[int | None, ...], queries: int = 1,
                    limit: int = 1 << 30) -> int:
    """The most positions one sequence can hold alone in ``n_blocks`` blocks (at most ``limit``),
    running up to ``queries`` positions a step (a prefill chunk: a window group holds its window
    behind them)."""
    def need(tokens: int) -> int:
        blocks = -(-tokens // block_size)
        return sum(blocks if w is None else min(blocks, window_blocks(w, block_size, queries)) for w in windows)

    lo, hi = 0, min(limit, n_blocks * block_size)
    if all(w is not None for w in windows) and need(limit) <= n_blocks:
        return limit
    while lo < hi:  # the largest token count that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= n_blocks else (lo, mid - 1)
    return lo


# KV bytes -----------------------------------------------------------------------------------------
def row_bytes(config: ModelConfig, dtype: torch.dtype, kv_dtype: str = DEFAULT_KV_DTYPE) -> int:
    """Bytes of one token's keys (or values) in one layer: every kv head's row
    (:func:`runtime.cache.head_row_bytes`; ``dtype``: the activations')."""
    return config.n_kv_heads * head_row_bytes(kv_dtype, dtype, config.head_dim)  # type: ignore[operator]


def cache_bytes(config: ModelConfig, tokens: int, dtype: torch.dtype, kv_dtype: str = DEFAULT_KV_DTYPE,
                batch: int = 1) -> int:
    """Bytes of ``batch`` caches of ``tokens`` positions' keys and values in every layer."""
    return 2 * config.n_layers * row_bytes(config, dtype, kv_dtype) * tokens * batch


def sequence_bytes(config: ModelConfig, tokens: int, dtype: torch.dtype, kv_dtype: str = DEFAULT_KV_DTYPE,
                   batch: int = 1, layers: Collection[int] | None = None) -> int:
    """As :func:`cache_bytes`, a sliding layer holding at most its window (the pool gives its other
    blocks back, give or take a partial block at each end): what ``batch`` sequences of ``tokens``
    positions keep; ``layers``: in those layers alone (a split model's CPU blocks)."""
    which = range(config.n_layers) if layers is None else layers
    per_layer = [min(tokens, w) if (w := config.layer_window(i)) else tokens for i in which]
    return 2 * sum(per_layer) * row_bytes(config, dtype, kv_dtype) * batch


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str = DEFAULT_KV_DTYPE) -> int:
    """Bytes of ``block_size`` tokens' keys and values in every layer (a pool budget of ``n`` of these
    holds ``n`` blocks of a model without windows, at least as many tokens with them)."""
    return cache_bytes(config, block_size, dtype, kv_dtype)


def sequence_pool_bytes(config: ModelConfig, dtype: torch.dtype, ctx: int, kv_dtype: str = DEFAULT_KV_DTYPE,
                        chunk_tokens: int | None = None) -> int:
    """Pool bytes that hold one sequence of ``ctx`` positions, prefilled ``chunk_tokens`` (default all of
    them) a step: every full-context layer group's blocks for the whole context, each sliding group's
    for its window behind a chunk."""
    per_group = plan_pool(config, 1 << 62, dtype, DEFAULT_BLOCK_SIZE, kv_dtype).bytes_per_block
    blocks = -(-ctx // DEFAULT_BLOCK_SIZE)
    queries = min(ctx, chunk_tokens or ctx)
    need = sum(blocks if g.window is None else min(blocks, window_blocks(g.window, DEFAULT_BLOCK_SIZE, queries))
               for g in layer_groups(config))
    return need * per_group


def plan_pool(config: ModelConfig, budget_bytes: int, dtype: torch.dtype,
              block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str = DEFAULT_KV_DTYPE) -> PoolPlan:
    """As many blocks as ``budget_bytes`` holds. Refuses a budget that holds no block, with the numbers."""
    kv_dtype = check_kv_dtype(kv_dtype)
    if block_size < 1:
        raise LocalLLMError(f"a KV block of {block_size} tokens is not possible",
                            f"use one of {', '.join(map(str, BLOCK_SIZES))}")
    groups = layer_groups(config)
    per_block = 2 * len(groups[0].layers) * row_bytes(config, dtype, kv_dtype) * block_size
    n_blocks = budget_bytes // per_block
    if n_blocks < 1:
        raise LocalLLMError(
            f"a KV cache budget of {budget_bytes} bytes holds no block: one block of {block_size} tokens "
            f"takes {per_block} bytes for this model",
            f"give the KV cache at least {per_block} bytes (more to serve long or many requests)",
        )
    return PoolPlan(n_blocks, block_size, per_block, budget_bytes, dtype, kv_dtype, groups)


def _slot_keys(config: ModelConfig, plan: PoolPlan, device: torch.device | Sequence[torch.device]
               ) -> tuple[list[tuple[int, torch.device]], list[int]]:
    """Each layer's (slot, device): the pool tensor pair it reads (:meth:`KVPool.allocate` makes one
    per distinct key), and each layer's group."""
    groups = plan.groups or (LayerGroup(tuple(range(config.n_layers)), None),)
    devices = [device] * config.n_layers if isinstance(device, torch.device) else list(device)
    if len(devices) != config.n_layers:
        raise LocalLLMError(f"a KV pool placed on {len(devices)} devices for {config.n_layers} layers",
                            "give one device, or one per layer")
    slot_of, group_of = [0] * config.n_layers, [0] * config.n_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            slot_of[layer], group_of[layer] = j, g
    return [(slot_of[i], devices[i]) for i in range(config.n_layers)], group_of


def device_bytes(config: ModelConfig, plan: PoolPlan,
                 device: torch.device | Sequence[torch.device]) -> dict[torch.device, int]:
    """Bytes :meth:`KVPool.allocate` puts on each device for ``plan`` (``device``: as it takes it).

    Every tensor holds all ``plan.n_blocks`` blocks, since the block ids come from one free list. A
    slot whose layers (one per group) live on both devices of a split model therefore has a full
    tensor on each: a split model of several layer groups (Gemma 3) keeps nearly its whole pool on
    each device, and only a model of one group (every layer its own slot) shares it out by layer."""
    keys, _ = _slot_keys(config, plan, device)
    tensor = plan.n_blocks * plan.block_size * row_bytes(config, plan.dtype, plan.kv_dtype)  # keys or values
    out: dict[torch.device, int] = {}
    for _, dev in set(keys):
        out[dev] = out.get(dev, 0) + 2 * tensor
    return out


def sequence_chunk(config: ModelConfig, ctx: int) -> int:
    """Prompt tokens a one-sequence engine of ``ctx`` positions prefills per step
    (:func:`runtime.engine.sequence_engine`): all of them, or a sliding window's worth at most."""
    return min([ctx, *(g.window for g in layer_groups(config) if g.window is not None)])


def sequence_pool_plan(config: ModelConfig, dtype: torch.dtype, ctx: int, kv_dtype: str = DEFAULT_KV_DTYPE,
                       batch: int = 1) -> PoolPlan:
    """The pool a run of ``batch`` sequences of ``ctx`` positions allocates: each sequence's
    :func:`sequence_pool_bytes`, prefilled :func:`sequence_chunk` tokens a step (what the memory plan
    counts: every group's blocks whole, a sliding group's window behind a chunk, a kind's shorter last
    group in blocks of the full slot count)."""
    budget = sequence_pool_bytes(config, dtype, ctx, kv_dtype, sequence_chunk(config, ctx)) * batch
    return plan_pool(config, budget, dtype, DEFAULT_BLOCK_SIZE, kv_dtype)


def sequence_pool_device_bytes(config: ModelConfig, dtype: torch.dtype, ctx: int,
                               device: torch.device | Sequence[torch.device], kv_dtype: str = DEFAULT_KV_DTYPE,
                               batch: int = 1) -> dict[torch.device, int]:
    """Per device, the bytes of :func:`sequence_pool_plan`'s pool placed as ``device`` says: the memory
    plan's count for a split model, from the same :func:`device_bytes` that sizes :meth:`KVPool.allocate`."""
    return device_bytes(config, sequence_pool_plan(config, dtype, ctx, kv_dtype, batch), device)


class KVPool:
    """The allocated pool: ``k[layer]`` and ``v[layer]``, ``(n_blocks, kv_heads, block_size, head_dim)``
    (tensors, or :class:`runtime.cache.QuantKV` for an int8 pool), indexed by the block ids of the
    layer's group (``group_of[layer]``); layers in the same slot of different groups share a tensor."""

    def __init__(self, plan: PoolPlan, k: list[torch.Tensor | QuantKV], v: list[torch.Tensor | QuantKV],
                 group_of: list[int] | None = None) -> None:
        self.plan = plan
        self.k, self.v = k, v
        self.group_of = group_of or [0] * len(k)

    @classmethod
    def allocate(cls, config: ModelConfig, plan: PoolPlan, device: torch.device | Sequence[torch.device]) -> "KVPool":
        """Zeroed tensors for ``plan`` on ``device`` (zeros: a block's unused rows are never read,
        but stay finite should a kernel touch them). ``device`` may name each layer's device (a model
        whose first blocks live in CPU RAM: :meth:`runtime.model.Transformer.layer_devices`): each
        layer's keys and values are then on its own device, a slot that layers on both devices share
        having a tensor on each (:func:`device_bytes` counts them)."""
        shape = (plan.n_blocks, config.n_kv_heads, plan.block_size, config.head_dim)
        keys, group_of = _slot_keys(config, plan, device)
        ks: dict[tuple[int, torch.device], torch.Tensor | QuantKV] = {}
        vs: dict[tuple[int, torch.device], torch.Tensor | QuantKV] = {}
        for key in keys:  # a slot's tensor on each device its layers live on
            if key not in ks:
                ks[key] = empty_kv(shape, plan.kv_dtype, plan.dtype, key[1])
                vs[key] = empty_kv(shape, plan.kv_dtype, plan.dtype, key[1])
        return cls(plan, [ks[k] for k in keys], [vs[k] for k in keys], group_of)

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
    ``dtype`` (these rows only: the pool itself stays int8), an fp16 pool's widened to it."""
    out = []
    for pool in (k_pool, v_pool):
        if isinstance(pool, QuantKV):
            rows = QuantKV(_gather_rows(pool.codes, blocks, length), _gather_rows(pool.scales, blocks, length))
            out.append(readable(rows, dtype or torch.float32))
        else:
            rows = _gather_rows(pool, blocks, length)
            out.append(rows if dtype is None else readable(rows, dtype))
    return out[0], out[1]
