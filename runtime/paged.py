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

import torch

from localllm.runtime.cache import QuantKV
from localllm.runtime.kv_pool import KVPool

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
class SeqChunk:
    """One sequence's part of a step, as the engine schedules it."""

    tokens: Sequence[int]  # the ids run this step
    start: int  # position of tokens[0]: the keys/values of positions < start are in the blocks
    blocks: Sequence[int]  # the sequence's block table, covering at least start + len(tokens) positions
    logits: bool  # whether the step returns logits for its last token
    #: The block tables of the pool's other layer groups (:func:`runtime.kv_pool.layer_groups`), in
    #: order; a sliding-window group's table holds -1 for blocks its window has left.
    more: tuple[Sequence[int], ...] = ()
    #: A verify chunk (speculative decoding: a decode token and its draft): every token is a query of
    #: its own, seeing the keys up to its position (the paged decode kernel's rows), with logits.
    verify: bool = False


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


@dataclass(frozen=True)
class Split:
    """Which spans of a step run through the paged kernel, and which through SDPA."""

    decode_rows: torch.Tensor | None  # (S_d,) long, None when every row is decode
    decode_tables: torch.Tensor | None  # (S_d, max_blocks) int32, None: no span takes the kernel
    decode_lens: torch.Tensor | None  # (S_d,) int32
    sdpa_spans: list[SeqSpan]  # spans run through SDPA over their gathered blocks
    #: A span kernel's tiles (T, 4) int32 over every span (the tables and lens are every span's), and
    #: their rows per tile; None: a decode kernel's split, or no kernel.
    tiles: torch.Tensor | None = None
    tile_rows: int = 1


class PagedStep:
    """Per-step metadata of a batch over the paged pool (see the module's docstring). In a pool of
    several layer groups, each group's blocks are a step of their own (:attr:`groups`; this step is
    the first), sharing positions, RoPE rows and logits rows; :meth:`layer` picks a layer's."""

    #: This step per layer group, when the pool has more than one (:meth:`build` sets it).
    groups: tuple["PagedStep", ...] = ()
    #: An int8 pool's key rotation (:func:`runtime.cache.key_rotation`), when the step is handed it
    #: as a tensor (the compiled step: a traced step may not make it); None: looked up.
    rotation: torch.Tensor | None = None
    #: What the prefill chunks of a decode kernel's step attend through (None: SDPA over gathered blocks).
    chunk: PagedChunkAttention | None = None

    def __init__(
        self,
        pool: KVPool,
        positions: torch.Tensor,  # (N,) long
        cos: torch.Tensor,  # (N, hd) in the activation dtype
        sin: torch.Tensor,  # (N, hd)
        write_blocks: torch.Tensor,  # (N,) long: block of each token's new key/value
        write_rows: torch.Tensor,  # (N,) long: row within that block
        spans: list[SeqSpan],
        logits_rows: torch.Tensor,  # (S_out,) long
        kernel: PagedDecodeAttention | PagedSpanAttention | None = None,
        # a span kernel's lens (S,), tiles (T, 4), rows per tile and block tables (S, W), int32 (build)
        span_meta: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None = None,
        chunk: PagedChunkAttention | None = None,
        # a decode kernel's split of a step of single queries, made by build from its one upload
        decode_split: Split | None = None,
    ) -> None:
        self.pool = pool
        self.chunk = chunk
        self._span_meta = span_meta
        self.positions, self.cos, self.sin = positions, cos, sin
        self.write_blocks, self.write_rows = write_blocks, write_rows
        self.spans = spans
        self.logits_rows = logits_rows
        self.kernel = kernel
        self._splits: dict[bool, Split] = {} if decode_split is None else {True: decode_split}
        own = self.split()
        self.sdpa_spans = own.sdpa_spans
        self.decode_rows, self.decode_tables, self.decode_lens = own.decode_rows, own.decode_tables, own.decode_lens

    def split(self, use_kernel: bool = True) -> Split:
        """The spans the kernel runs (a decode kernel: those of one query; a span kernel: all; either
        takes any window) and those SDPA runs (made once per step; ``use_kernel=False``: SDPA for all,
        as soft-capped scores need)."""
        if use_kernel in self._splits:
            return self._splits[use_kernel]
        spans = self.spans
        if use_kernel and self.kernel is not None and takes_spans(self.kernel):
            split = self._span_split()
            self._splits[use_kernel] = split
            return split
        fits = [s.length == 1 and self.kernel is not None and use_kernel for s in spans]
        decode = [s for s, f in zip(spans, fits) if f]
        rows = tables = lens = None
        if decode:
            device = self.positions.device
            width = max(len(s.blocks) for s in decode)
            tables = torch.zeros(len(decode), width, dtype=torch.int32, device=device)
            for i, s in enumerate(decode):
                tables[i, : len(s.blocks)] = s.blocks
            host_lens = torch.tensor([s.context for s in decode], dtype=torch.int32)
            lens = host_lens.to(device, non_blocking=True)  # non-blocking uploads: see build
            if len(decode) != self.positions.shape[0]:
                host_rows = torch.tensor([s.row for s in decode], dtype=torch.long)
                rows = host_rows.to(device, non_blocking=True)
        split = Split(rows, tables, lens, [s for s, f in zip(spans, fits) if not f])
        self._splits[use_kernel] = split
        return split

    def _span_split(self) -> Split:
        """A span kernel's split: every span, with the lens, tiles and tables :meth:`build` uploaded
        with the step's indices."""
        if self._span_meta is None:
            raise ValueError("a span kernel's step is made by PagedStep.build (its tiles ride with the indices)")
        lens, tiles, rows, tables = self._span_meta
        return Split(None, tables, lens, [], tiles, rows)

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
        return self.decode_tables is not None and self.decode_rows is None and all(s.length == 1 for s in self.spans)

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
        chunks: Sequence[SeqChunk],
        cos_table: torch.Tensor,  # (max_seq, hd)
        sin_table: torch.Tensor,  # (max_seq, hd)
        kernel: PagedDecodeAttention | PagedSpanAttention | None = None,
        chunk: PagedChunkAttention | None = None,
    ) -> tuple["PagedStep", torch.Tensor]:
        """The step for ``chunks`` (rows in their order) and its input ids (1, N)."""
        device = cos_table.device
        bs = pool.block_size
        n_groups = 1 + max(pool.group_of, default=0)  # every chunk brings a table for each
        ids: list[int] = []
        positions: list[int] = []
        wrows: list[int] = []
        wblocks: list[list[int]] = [[] for _ in range(n_groups)]  # per group
        tables: list[list[int]] = [[] for _ in range(n_groups)]  # per group, every sequence's block ids in turn
        spans_at: list[tuple[int, int, int, list[int], int]] = []  # row, length, context, first in `tables`, blocks
        logits_rows: list[int] = []
        for c in chunks:
            n = len(c.tokens)
            end = c.start + n
            own = [c.blocks, *c.more]
            if n < 1 or len(own) != n_groups or any(len(t) * bs < end for t in own):
                raise ValueError(f"a chunk of {n} tokens at {c.start} does not fit its tables of "
                                 f"{[len(t) for t in own]} blocks ({n_groups} layer groups, {bs}-token blocks)")
            row = len(ids)
            ids.extend(c.tokens)
            used = -(-end // bs)
            at = [len(t) for t in tables]
            if c.verify:  # a span per token: row i's context ends at its own position
                spans_at.extend((row + i, 1, c.start + i + 1, at, -(-(c.start + i + 1) // bs)) for i in range(n))
                logits_rows.extend(range(row, row + n - 1))  # the last row's is added below
            else:
                spans_at.append((row, n, end, at, used))
            for p in range(c.start, end):
                positions.append(p)
                wrows.append(p % bs)
            for g, t in enumerate(own):
                wblocks[g].extend(t[p // bs] for p in range(c.start, end))
                tables[g].extend(t[:used])
            if c.logits or c.verify:
                logits_rows.append(row + n - 1)
        # Every index of the step goes to the device in one non-blocking copy. A blocking copy per
        # tensor (torch.tensor(..., device="cuda")) makes the host wait for the GPU at each: 6 and one
        # per sequence every step (found by the CUDA dry run, tests/test_cuda_dryrun.py).
        N, S = len(ids), len(logits_rows)
        flat = [*ids, *positions, *wrows, *logits_rows]
        sizes = [N, N, N, S]
        for g in range(n_groups):
            flat += [*wblocks[g], *tables[g]]
            sizes += [N, len(tables[g])]
        # The kernel's metadata rides along, so that the step makes no table on the device span by span
        # for each layer group (once a decode step's largest cost on the host): a span kernel's lens and
        # tiles (the same for every group), or a decode kernel's lens in a step of single queries (a
        # decode or a verify step: every span through it), then each group's block tables padded to one
        # width.
        spans_kernel = kernel is not None and takes_spans(kernel)
        single = kernel is not None and not spans_kernel and all(n == 1 for _, n, *_ in spans_at)
        tile_rows, width, head = 0, 0, []
        if spans_kernel:
            tile_rows, head = span_tiles([a[:3] for a in spans_at], kernel.tile_rows)  # type: ignore[union-attr]
        elif single:
            head = [context for _, _, context, *_ in spans_at]
        if spans_kernel or single:
            width = max(used for *_, used in spans_at)
            flat += head
            for g in range(n_groups):
                for *_, a, used in spans_at:
                    flat += [*tables[g][a[g] : a[g] + used], *[0] * (width - used)]
        uploaded = torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
        parts = uploaded[: sum(sizes)].split(sizes)
        ids_t, pos, wr, rows = parts[:4]
        metas: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None] = [None] * n_groups
        splits: list[Split | None] = [None] * n_groups
        if spans_kernel or single:
            n_spans = len(spans_at)
            tail = uploaded[sum(sizes) :].to(torch.int32)  # (lens, tiles, tables per group) as the kernel takes them
            lens_t, tiles_t, *group_tables = tail.split([n_spans, len(head) - n_spans, *[n_spans * width] * n_groups])
            group_tables = [t.view(n_spans, width) for t in group_tables]
            if spans_kernel:
                metas = [(lens_t, tiles_t.view(-1, 4), tile_rows, t) for t in group_tables]
            else:
                splits = [Split(None, t, lens_t, []) for t in group_tables]
        cos, sin = cos_table[pos], sin_table[pos]
        steps = []
        for g in range(n_groups):
            wb, blocks = parts[4 + 2 * g], parts[5 + 2 * g]
            spans = [SeqSpan(row, n, end, blocks[a[g] : a[g] + used]) for row, n, end, a, used in spans_at]
            steps.append(cls(pool, pos, cos, sin, wb, wr, spans, rows, kernel, metas[g], chunk, splits[g]))
        if n_groups > 1:
            steps[0].groups = tuple(steps)
        return steps[0], ids_t.view(1, N)
