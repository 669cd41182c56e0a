"""Decode-only steps on CUDA replayed from CUDA graphs, one captured per batch-size bucket.

A decode step of a small model on a GPU is a few hundred kernel launches, each a few microseconds of
Python and driver work, around milliseconds (or less) of weight reads: launched one by one, the host
is the bottleneck. A CUDA graph records the launches once and replays them with one call. As in vLLM
and nano-vllm:

* graphs are captured for 1, 2, 4, 8, 16 and 32 rows (up to the engine's ``max_running``); a step
  whose S rows are each a single query (decode rows, and verify chunks, whose every row is a query of
  its own) replays the smallest bucket B >= S; larger steps and steps with a prefill chunk run eagerly;
* every input lives in a static buffer the graph was captured with (ids, positions, write slots, the
  layer groups' block tables, context lengths); a step copies its tensors into the first S rows, all
  on the device (no host sync), and reads the first S rows of the graph's logits;
* the B - S padding rows repeat row 0's inputs: their keys and values are row 0's own, written to row
  0's slot, so no other sequence's block is touched and no spare block is needed; their logits are
  dropped (rows of equal inputs give equal bits in the GEMMs here; were they ever to differ in the
  last bit, row 0's cached key would carry that rounding, nothing worse);
* a graph is captured the first time its bucket is needed (lazily: an engine that never batches 16
  captures no 16), after one eager warm-up run of the same function (Triton's first compile and
  cuBLAS's workspace happen outside the capture); all graphs share one memory pool.

The function captured is the same step the CPU's compiled step exports
(:meth:`runtime.paged.PagedStep.decode_only`: a paged step made from tensors alone). ``capture``
is injectable: tests run it eagerly on the CPU (the static buffers' and the padding's numerics
against eager steps) and under the fake-CUDA dry run (what a bucket's step launches).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from localllm.runtime.kv_pool import KVPool
from localllm.runtime.model import Transformer
from localllm.runtime.paged import PagedDecodeAttention, PagedSpanAttention, PagedStep, takes_spans

#: Batch sizes graphs are captured for.
BUCKETS = (1, 2, 4, 8, 16, 32)

#: Runs ``fn`` as a graph would: returns ``(replay, output)``, ``replay()`` rerunning what ``fn``
#: launched (over the same static buffers) and refreshing ``output``.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """The buckets an engine of ``max_batch`` sequences captures: every one below it and the first at
    or above it (capped at the largest)."""
    out = []
    for b in BUCKETS:
        out.append(b)
        if b >= max_batch:
            break
    return tuple(out)


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in for :func:`cuda_capture` that reruns ``fn`` on each replay (CPU tests, dry run)."""
    out = fn()

    def replay() -> None:
        out.copy_(fn())

    return replay, out


class CudaCapture:
    """Captures into CUDA graphs sharing one memory pool (the real :data:`Capture`)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: Triton compiles, cuBLAS sets up, outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a capture happens mid-serving, on the engine's thread; another thread's CUDA
        # calls (a second model's engine, a load) must not invalidate it
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out


class GraphedDecode:
    """Decode-only steps of one engine through CUDA graphs (see the module's docstring)."""

    def __init__(self, model: Transformer, pool: KVPool, kernel: PagedDecodeAttention | PagedSpanAttention,
                 cos_table: torch.Tensor, sin_table: torch.Tensor, max_batch: int,
                 capture: Capture | None = None) -> None:
        self.model, self.pool, self.kernel = model, pool, kernel
        self.cos_table, self.sin_table = cos_table, sin_table  # (max_seq, rot)
        self.buckets = buckets_for(max_batch)
        self.capture = capture
        self.capture_s = 0.0  # time spent capturing so far
        B, device = self.buckets[-1], cos_table.device
        max_blocks = -(-cos_table.shape[0] // pool.block_size)
        self.n_groups = 1 + max(pool.group_of, default=0)
        self.rotation = None
        if pool.kv_dtype == "int8":  # made before any capture (it is made on first use otherwise)
            from localllm.runtime.cache import key_rotation

            self.rotation = key_rotation(model.config.head_dim, torch.float32, device)  # type: ignore[arg-type]
        # Static inputs, sized for the largest bucket; bucket b's graph reads their first b rows.
        self.ids = torch.zeros(1, B, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        self.write_rows = torch.zeros(B, dtype=torch.long, device=device)
        self.lens = torch.ones(B, dtype=torch.int32, device=device)
        self.write_blocks = torch.zeros(self.n_groups, B, dtype=torch.long, device=device)
        self.tables = torch.zeros(self.n_groups, B, max_blocks, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets captured so far."""
        return tuple(sorted(self._graphs))

    def bucket(self, n: int) -> int | None:
        """The bucket a step of ``n`` sequences replays (None: more than the largest)."""
        return next((b for b in self.buckets if b >= n), None)

    def takes(self, step: PagedStep) -> bool:
        """Whether ``step`` is one the graphs replay: every row a sampled single query on the kernel,
        no more rows than the largest bucket, tables no wider than the static ones."""
        width = self.tables.shape[2]
        return (step.all_decode and step.logits_rows.shape[0] == step.num_tokens
                and self.bucket(step.num_tokens) is not None
                and all(s.tables.shape[1] <= width for s in step.group_steps))  # type: ignore[union-attr]

    def forward(self, b: int) -> torch.Tensor:
        """The step of bucket ``b`` over the static buffers' first ``b`` rows -> logits (b, vocab): what
        a graph captures."""
        positions, write_rows, lens = self.positions[:b], self.write_rows[:b], self.lens[:b]
        cos, sin = self.cos_table[positions], self.sin_table[positions]
        tiles = None
        if takes_spans(self.kernel):  # row i is tile i: (sequence i, row i, one row, its position)
            rows = torch.arange(b, dtype=torch.int32, device=lens.device)
            tiles = torch.stack([rows, rows, torch.ones_like(rows), lens - 1], 1)  # (b, 4)
        steps = [PagedStep.decode_only(self.pool, positions, cos, sin, self.write_blocks[g, :b], write_rows,
                                       self.tables[g, :b], lens, self.kernel, self.rotation, tiles)
                 for g in range(self.n_groups)]
        if self.n_groups > 1:
            steps[0].groups = tuple(steps)
        return self.model(self.ids[:, :b], steps[0])[0]

    def __call__(self, ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """Logits (S, vocab) of a step :meth:`takes`: its inputs copied into the static buffers (the
        padding rows repeating row 0's), its bucket's graph replayed (captured first if it is new)."""
        S = step.num_tokens
        b = self.bucket(S)
        assert b is not None
        groups = step.group_steps
        self.ids[:, :S].copy_(ids)
        self.positions[:S].copy_(step.positions)
        self.write_rows[:S].copy_(step.write_rows)
        self.lens[:S].copy_(step.lens)  # type: ignore[arg-type]
        for g, s in enumerate(groups):
            self.write_blocks[g, :S].copy_(s.write_blocks)
            self.tables[g, :S, : s.tables.shape[1]].copy_(s.tables)  # type: ignore[union-attr]
        if b > S:  # padding: row 0 again (its key and value rewritten with themselves)
            for t in (self.ids[0], self.positions, self.write_rows, self.lens, *self.write_blocks, *self.tables):
                t[S:b].copy_(t[:1].expand_as(t[S:b]))
        if b not in self._graphs:
            t0 = time.perf_counter()
            if self.capture is None:  # made at the first capture: every graph in its one pool
                self.capture = CudaCapture()
            self._graphs[b] = self.capture(lambda: self.forward(b))
            self.capture_s += time.perf_counter() - t0
        replay, logits = self._graphs[b]
        replay()
        return logits[:S]


def describe(graphs: GraphedDecode) -> str:
    """``--verbose``'s words for an engine's graphs."""
    got = ", ".join(map(str, graphs.captured)) or "none yet"
    return (f"CUDA graphs for batch sizes {', '.join(map(str, graphs.buckets))} "
            f"(captured: {got}; {graphs.capture_s:.2f} s)")
