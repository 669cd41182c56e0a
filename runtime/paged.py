"""One batched step over the paged KV pool: what the model needs to know, built once per step.

The batch engine flattens every scheduled token of every sequence (prefill chunks and single decode
tokens alike) into one ``(1, N)`` batch, so that each linear layer reads its weights once per step.
Only attention is per sequence. A :class:`PagedStep` is what the model is handed as its ``cache``
argument for such a batch (``Transformer.forward(tokens, step)``):

* where each token sits (its position, its RoPE rows) and where its new key/value goes in the pool
  (block and row: the *slot mapping*);
* each sequence's query span in the batch, its context length after this step and its block table;
* which rows need logits (the last token of each sequence that samples this step).

A verify chunk (a decode token and its draft, speculative decoding) is a span per token: row i sees the
keys up to its own position, which the step has written before attention runs, so the whole chunk
goes to the decode kernel as that many single queries, and every row has logits.

Attention per sequence (:func:`runtime.attention.attend`) takes one of two kinds of kernel:

* a *decode* kernel (:data:`PagedDecodeAttention`, the CPU's :mod:`runtime.cpu_attention`) runs the
  sequences with one query this step, all of them in one call, each layer passing its own window (the
  kernel reads only the keys a query sees); the others (prefill chunks) go through the step's *chunk*
  kernel (:data:`PagedChunkAttention`, the CPU's), a call per chunk reading its blocks in place, or,
  without one, gather their keys/values from their blocks and run SDPA, causal within the chunk with
  all earlier context visible;
* a *span* kernel (:data:`PagedSpanAttention`, CUDA's :mod:`runtime.cuda_attention`) runs every span of
  the step in one call, prefill chunks over cached prefixes included, in tiles of consecutive rows of
  one sequence: nothing is gathered.

Without a kernel (or for soft-capped scores, which neither takes) every span runs SDPA over gathered
blocks: the tested reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from localllm.runtime.cache import QuantKV
from localllm.runtime.kv_pool import KVPool

if TYPE_CHECKING:
    from localllm.runtime.scheduler import Chunk

#: Attention of one query per sequence over its blocks: ``fn(q (S, KV, G, hd), k_pool, v_pool
#: (n_blocks, KV, block, hd) (tensors, or an int8 pool's QuantKV), block_tables (S, max_blocks) int32,
#: context_lens (S,) int32, window (None: every key; else each query sees its last ``window`` keys))
#: -> (S, KV, G, hd)``.
PagedDecodeAttention = Callable[
    [torch.Tensor, torch.Tensor | QuantKV, torch.Tensor | QuantKV, torch.Tensor, torch.Tensor, int | None],
    torch.Tensor]

#: Attention of every query row of a step over the paged pool: ``fn(q (N, KV, G, hd), k_pool, v_pool,
#: block_tables (S, max_blocks) int32, context_lens (S,) int32, window, tiles (T, 4) int32, tile_rows)
#: -> (N, KV, G, hd)``, each tile ``(sequence, first row, rows, position of the first row)`` of at most
#: ``tile_rows`` consecutive rows of one sequence, row i of it at that position + i seeing the keys up to
#: its own. Such a kernel has a ``tile_rows`` attribute: the rows per tile it takes in a step with a
#: prefill chunk (a step of single queries has tiles of one row).
PagedSpanAttention = Callable[
    [torch.Tensor, torch.Tensor | QuantKV, torch.Tensor | QuantKV, torch.Tensor, torch.Tensor, int | None,
     torch.Tensor, int],
    torch.Tensor]


#: Attention of one sequence's chunk of consecutive query rows over its blocks, read in place: ``fn(q
#: (n, KV, G, hd), k_pool, v_pool, blocks (nb,) long (the sequence's table from block ``first`` on),
#: first, q_pos (position of q's first row), window (None: every earlier key), scale) -> (n, KV, G,
#: hd)``, row i seeing the keys up to position q_pos + i. What a decode kernel's step runs its prefill
#: chunks through, where it has one (the CPU's :mod:`runtime.cpu_attention`).
PagedChunkAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int | None, float], torch.Tensor]


def takes_spans(kernel: object) -> bool:
    """Whether ``kernel`` is a :data:`PagedSpanAttention` (every span) rather than a decode kernel."""
    return getattr(kernel, "tile_rows", None) is not None


def span_tiles(spans: Sequence[tuple[int, int, int]], tile_rows: int) -> tuple[int, list[int]]:
    """A span kernel's rows per tile for ``spans`` (row, length, context) (1 when every span is a
    single query), and its metadata flat: every span's context, then each tile's (span, first row,
    rows, first position)."""
    rows = 1 if all(n == 1 for _, n, _ in spans) else tile_rows
    flat = [c for _, _, c in spans]
    for i, (row, n, c) in enumerate(spans):
        for a in range(0, n, rows):
            flat += [i, row + a, min(rows, n - a), c - n + a]
    return rows, flat


@dataclass(frozen=True)
class SeqSpan:
    """One sequence in a built step: its queries are rows ``row .. row + length - 1``."""

    row: int
    length: int
    context: int  # keys/values after this step: positions 0 .. context - 1
    blocks: torch.Tensor  # (ceil(context / block),) long, on the pool's device


class PagedLayer:
    """A :class:`PagedStep` seen from one layer: the step's metadata, that layer's pool tensors and its
    attention window (None: the whole context). ``k``, ``v``: tensors, or QuantKV for an int8 pool."""

    __slots__ = ("step", "k", "v", "window")

    def __init__(self, step: "PagedStep", k: torch.Tensor | QuantKV, v: torch.Tensor | QuantKV,
                 window: int | None = None) -> None:
        self.step, self.k, self.v, self.window = step, k, v, window


class PagedStep:
    """Per-step metadata of a batch over the paged pool (see the module's docstring), made by
    :meth:`build` from the scheduler's chunks, or by :meth:`decode_only` from tensors alone. In a pool
    of several layer groups, each group's blocks are a step of their own (:attr:`groups`; this step is
    the first), sharing positions, RoPE rows and logits rows; :meth:`layer` picks a layer's.

    The kernel's share of the step: the block tables (S_k, W) int32 and context lengths (S_k,) int32
    of the spans it runs (None: no span takes a kernel), their rows (S_k,) long (None: every row, in
    order), and a span kernel's tiles (T, 4) int32 with their rows per tile. The other spans
    (:attr:`sdpa_spans`) go through the chunk kernel or SDPA."""

    #: This step per layer group, when the pool has more than one (:meth:`build` sets it).
    groups: tuple["PagedStep", ...] = ()
    #: An int8 pool's key rotation (:func:`runtime.cache.key_rotation`), when the step is handed it
    #: as a tensor (the compiled step: a traced step may not make it); None: looked up.
    rotation: torch.Tensor | None = None
    #: A model whose first blocks live in CPU RAM (``--gpu-layers``): the same step built on the host
    #: (its tables, the CPU's kernels), and its input ids (1, N) there (:meth:`runtime.runner.ModelRunner.forward`).
    host: "PagedStep | None" = None
    ids: torch.Tensor | None = None

    def on(self, device: torch.device) -> "PagedStep":
        """This step as the layers on ``device`` read it: its host copy for the CPU's, where it has one."""
        return self.host if self.host is not None and device.type == "cpu" else self

    def __init__(
        self,
        pool: KVPool,
        positions: torch.Tensor,  # (N,) long
        cos: torch.Tensor,  # (N, hd) in the activation dtype
        sin: torch.Tensor,  # (N, hd)
        write_blocks: torch.Tensor,  # (N,) long: block of each token's new key/value
        write_rows: torch.Tensor,  # (N,) long: row within that block
        logits_rows: torch.Tensor | slice,  # (S_out,) long, or every row
        *,
        spans: Sequence[SeqSpan] = (),
        kernel: PagedDecodeAttention | PagedSpanAttention | None = None,
        chunk: PagedChunkAttention | None = None,  # what a decode kernel's step runs prefill chunks through
        tables: torch.Tensor | None = None,
        lens: torch.Tensor | None = None,
        kernel_rows: torch.Tensor | None = None,
        tiles: torch.Tensor | None = None,
        tile_rows: int = 1,
    ) -> None:
        self.pool = pool
        self.positions, self.cos, self.sin = positions, cos, sin
        self.write_blocks, self.write_rows = write_blocks, write_rows
        self.logits_rows = logits_rows
        self.spans = list(spans)
        self.kernel, self.chunk = kernel, chunk
        self.tables, self.lens, self.kernel_rows = tables, lens, kernel_rows
        self.tiles, self.tile_rows = tiles, tile_rows
        #: The spans no kernel takes: all without one, prefill chunks beside a decode kernel.
        self.sdpa_spans = (self.spans if tables is None else [] if tiles is not None
                           else [s for s in self.spans if s.length > 1])

    @classmethod
    def decode_only(cls, pool: KVPool, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    write_blocks: torch.Tensor, write_rows: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    kernel: PagedDecodeAttention | PagedSpanAttention, rotation: torch.Tensor | None = None,
                    tiles: torch.Tensor | None = None) -> "PagedStep":
        """A step of one layer group in which row i is sequence i's one query, every row through
        ``kernel`` and every row sampled, made from tensors alone, as the compiled step and CUDA graphs
        need (no per-sequence spans, nothing decided from values). ``tiles``: a span kernel's (B, 4),
        row i as tile i."""
        step = cls(pool, positions, cos, sin, write_blocks, write_rows, slice(None), kernel=kernel,
                   tables=tables, lens=lens, tiles=tiles)
        step.rotation = rotation
        return step

    @property
    def group_steps(self) -> tuple["PagedStep", ...]:
        """This step per layer group, in order (itself alone in a pool of one group)."""
        return self.groups or (self,)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def all_decode(self) -> bool:
        """Every row is one sequence's single query, all run by the kernel."""
        return self.tables is not None and self.kernel_rows is None and all(s.length == 1 for s in self.spans)

    def layer(self, index: int, window: int | None) -> PagedLayer:
        """Layer ``index``'s view of the step (its group's blocks), attending with ``window``."""
        step = self.groups[self.pool.group_of[index]] if self.groups else self
        return PagedLayer(step, self.pool.k[index], self.pool.v[index], window)

    def first_block(self, span: SeqSpan, window: int | None) -> int:
        """The first of ``span``'s blocks that holds a key its queries see under ``window`` (0 without one)."""
        if window is None or span.context <= window:
            return 0
        oldest = max(0, span.context - span.length - window + 1)  # the first query's oldest key
        return oldest // self.pool.block_size

    def mask(self, span: SeqSpan, window: int | None, first: int = 0) -> torch.Tensor | None:
        """SDPA's mask for ``span``'s queries over its context from block ``first`` on: None for plain
        causal attention from position 0 (or one query seeing everything), else (length, keys) bool,
        True = attend."""
        windowed = window is not None and span.context > window
        start = span.context - span.length
        if not windowed and (start == 0 or span.length == 1):
            return None
        device = self.positions.device
        q_pos = torch.arange(start, span.context, device=device)[:, None]
        k_pos = torch.arange(first * self.pool.block_size, span.context, device=device)[None, :]
        mask = k_pos <= q_pos
        if windowed:
            mask &= k_pos > q_pos - window
        return mask

    @classmethod
    def build(
        cls,
        pool: KVPool,
        chunks: Sequence[Chunk],
        cos_table: torch.Tensor,  # (max_seq, hd)
        sin_table: torch.Tensor,  # (max_seq, hd)
        kernel: PagedDecodeAttention | PagedSpanAttention | None = None,
        chunk: PagedChunkAttention | None = None,
    ) -> tuple["PagedStep", torch.Tensor]:
        """The step for the scheduler's ``chunks`` (rows in their order) and its input ids (1, N).

        Every index of the step goes to the device in one non-blocking copy: a blocking copy per tensor
        makes the host wait for the GPU at each (found by the CUDA dry run, tests/test_cuda_dryrun.py).
        The kernel's share rides along, so that no layer makes a table on the device span by span."""
        rows = _Rows.of(chunks, pool.block_size, 1 + max(pool.group_of, default=0))
        spans_kernel = kernel is not None and takes_spans(kernel)
        taken = [i for i, (_, n, _) in enumerate(rows.spans) if kernel is not None and (spans_kernel or n == 1)]
        N, S, G = len(rows.ids), len(rows.logits), len(rows.tables)
        # long: ids, positions, write rows, logits rows, the kernel's rows; per group its write blocks and
        # every span's blocks in turn
        kernel_rows = [] if spans_kernel or len(taken) == len(rows.spans) else [rows.spans[i][0] for i in taken]
        flat = [*rows.ids, *rows.positions, *rows.write_rows, *rows.logits, *kernel_rows]
        sizes = [N, N, N, S, len(kernel_rows)]
        for g in range(G):
            blocks = [b for t in rows.tables[g] for b in t]
            flat += [*rows.write_blocks[g], *blocks]
            sizes += [N, len(blocks)]
        # int32, as the kernels take them: lens (and a span kernel's tiles), each group's padded tables
        tile_rows, head, width = 1, [], 0
        if taken:
            if spans_kernel:
                tile_rows, head = span_tiles(rows.spans, kernel.tile_rows)  # type: ignore[union-attr]
            else:
                head = [rows.spans[i][2] for i in taken]
            width = max(len(rows.tables[0][i]) for i in taken)
            flat += head
            for g in range(G):
                for i in taken:
                    t = rows.tables[g][i]
                    flat += [*t, *[0] * (width - len(t))]
        uploaded = torch.tensor(flat, dtype=torch.long).to(cos_table.device, non_blocking=True)
        parts = uploaded[: sum(sizes)].split(sizes)
        ids, pos, wr, logits, krows = parts[:5]
        lens = tiles = None
        tables: list[torch.Tensor | None] = [None] * G
        if taken:
            n = len(taken)
            lens, tiles, *group_tables = uploaded[sum(sizes) :].to(torch.int32).split([n, len(head) - n, *[n * width] * G])
            tables = [t.view(n, width) for t in group_tables]
            tiles = tiles.view(-1, 4) if spans_kernel else None
        cos, sin = cos_table[pos], sin_table[pos]
        steps = []
        for g in range(G):
            blocks, at, spans = parts[6 + 2 * g], 0, []
            for (row, n, context), t in zip(rows.spans, rows.tables[g]):
                spans.append(SeqSpan(row, n, context, blocks[at : at + len(t)]))
                at += len(t)
            steps.append(cls(pool, pos, cos, sin, parts[5 + 2 * g], wr, logits, spans=spans, kernel=kernel,
                             chunk=chunk, tables=tables[g], lens=lens, kernel_rows=krows if kernel_rows else None,
                             tiles=tiles, tile_rows=tile_rows))
        if G > 1:
            steps[0].groups = tuple(steps)
        return steps[0], ids.view(1, N)


@dataclass
class _Rows:
    """A step's rows on the host, as :meth:`PagedStep.build` uploads them."""

    ids: list[int]
    positions: list[int]
    write_rows: list[int]  # each token's row within its block
    write_blocks: list[list[int]]  # per layer group, each token's block
    logits: list[int]  # the rows whose logits the step returns
    spans: list[tuple[int, int, int]]  # per span: first row, rows, context after the step
    tables: list[list[list[int]]]  # per layer group, per span: the blocks its context covers

    @classmethod
    def of(cls, chunks: Sequence[Chunk], bs: int, n_groups: int) -> "_Rows":
        r = cls([], [], [], [[] for _ in range(n_groups)], [], [], [[] for _ in range(n_groups)])
        for c in chunks:
            tokens, own = c.tokens, c.tables
            n, end = len(tokens), c.start + len(tokens)
            if n < 1 or len(own) != n_groups or any(len(t) * bs < end for t in own):
                raise ValueError(f"a chunk of {n} tokens at {c.start} does not fit its tables of "
                                 f"{[len(t) for t in own]} blocks ({n_groups} layer groups, {bs}-token blocks)")
            row = len(r.ids)
            r.ids.extend(tokens)
            # a verify chunk is a span per token: row i's context ends at its own position
            ends = [c.start + i + 1 for i in range(n)] if c.verify else [end]
            for e in ends:
                r.spans.append((row + e - c.start - (1 if c.verify else n), 1 if c.verify else n, e))
                for g, t in enumerate(own):
                    r.tables[g].append(list(t[: -(-e // bs)]))
            if c.verify:
                r.logits.extend(range(row, row + n))
            elif c.samples:
                r.logits.append(row + n - 1)
            r.positions.extend(range(c.start, end))
            r.write_rows.extend(p % bs for p in range(c.start, end))
            for g, t in enumerate(own):
                r.write_blocks[g].extend(t[p // bs] for p in range(c.start, end))
        return r
