"""The batch engine's decode step compiled ahead of time: :mod:`runtime.aot` for the paged KV pool.

In a step where every running sequence decodes one token (the engine's steady state, and the whole of
a single stream's generation after its prompt) the eager forward spends about a third of a batch-1
step in per-op overhead around the matmuls. This step is that forward exported with the batch size,
the block tables' width and the pool's size as dynamic dimensions, and compiled with AOTInductor:
one package per model structure (and thread count) serves every batch, context and pool budget.

As in :mod:`runtime.aot`, the package holds no weights: the model's parameters and the pool's K/V
tensors are inputs, handed over on every call (the pool is written in place). Steps with a prefill
chunk, sequences that do not sample, or a model the step does not cover (:func:`unsupported`: sliding
windows, soft-capped attention, no paged kernel) run eagerly, as before. An int8 pool is handed over as
each layer's codes and scales; the step quantizes the new rows as the eager one does.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from localllm.runtime import aot
from localllm.runtime.cache import QuantKV, key_rotation
from localllm.runtime.compile import compile_unavailable_reason, inductor_cache_dir
from localllm.runtime.kv_pool import KVPool
from localllm.runtime.model import Transformer, rope_tables
from localllm.runtime.paged import PagedDecodeAttention, PagedStep, Split

#: The largest batch and block-table width a package takes (the engine's limits are far below).
MAX_BATCH = 1024
MAX_TABLE = 1 << 16


def unsupported(model: Transformer, pool: KVPool, kernel: PagedDecodeAttention | None) -> str | None:
    """Why the compiled step cannot run ``model`` over ``pool`` (None: it can)."""
    if model.device.type != "cpu":
        return "it is built for the CPU only"
    if kernel is None:
        return "it needs localllm's paged attention kernel"
    if any(layer.attn.window is not None for layer in model.layers) or model.config.sliding_window:
        return "sliding-window layers choose their attention per sequence"
    if any(layer.attn.softcap is not None for layer in model.layers):
        return "soft-capped attention does not take the paged kernel"
    return None


class _PoolView:
    """The K/V tensors of a pool as a traced step sees them (``KVPool``'s ``k``, ``v``, ``block_size``)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], block_size: int) -> None:
        self.k, self.v, self.block_size = k, v, block_size


class DecodeOnlyStep(PagedStep):
    """A :class:`PagedStep` in which row i is sequence i's one query, every row through the paged kernel
    and every row sampled: made from tensors alone, as the exported step needs (no per-sequence spans,
    nothing decided from values)."""

    def __init__(self, pool: _PoolView | KVPool, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 write_blocks: torch.Tensor, write_rows: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 kernel: PagedDecodeAttention, rotation: torch.Tensor | None = None) -> None:
        self.pool = pool  # type: ignore[assignment]
        self.rotation = rotation
        self.positions, self.cos, self.sin = positions, cos, sin
        self.write_blocks, self.write_rows = write_blocks, write_rows
        self.spans = []
        self.logits_rows = slice(None)  # type: ignore[assignment]  # every row, in order
        self.kernel = kernel
        self.sliding_window = None
        own = Split(None, tables, lens, [])
        self._splits = {(None, True): own}
        self.sdpa_spans = []
        self.decode_rows, self.decode_tables, self.decode_lens = None, tables, lens

    def split(self, window: int | None, use_kernel: bool = True) -> Split:
        if window is not None or not use_kernel:
            raise ValueError("a decode-only step has no sliding windows and always takes the kernel")
        return self._splits[(None, True)]


class _Step(nn.Module):
    """The decode-only step as a function of its tensors: what gets exported (the model is held in a
    list, so that export lifts none of its weights into the package)."""

    def __init__(self, model: Transformer, names: list[str], block_size: int, kernel: PagedDecodeAttention,
                 quantized: bool) -> None:
        super().__init__()
        self._model = [model]
        self._names = names
        self._block_size = block_size
        self._kernel = kernel
        self._quantized = quantized  # an int8 pool: each K or V is two tensors (codes, scales)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                write_blocks: torch.Tensor, write_rows: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # ids (1, B); positions, write_blocks, write_rows (B,) long; cos, sin (B, hd); tables (B, W) int32;
        # lens (B,) int32. tensors: the model's parameters and buffers, then each layer's K and V pools
        # (an int8 pool's K codes, K scales, V codes, V scales, then its key rotation (hd, hd)).
        n = len(self._names)
        params = dict(zip(self._names, tensors[:n]))
        kv: list[Any] = list(tensors[n:])
        rotation = None
        if self._quantized:
            rotation = kv.pop()
            kv = [QuantKV(c, sc) for c, sc in zip(kv[0::2], kv[1::2])]
        pool = _PoolView(kv[0::2], kv[1::2], self._block_size)
        step = DecodeOnlyStep(pool, positions, cos, sin, write_blocks, write_rows, tables, lens, self._kernel,
                              rotation)
        logits = torch.func.functional_call(self._model[0], params, (ids, step), strict=False, tie_weights=True)
        return logits[0]  # (B, vocab)


def batch_ranges(model: Transformer) -> list[tuple[int, int]]:
    """The batch sizes one package each covers. A quantized linear picks its kernel by the number of
    rows (``GEMV_ROWS``: row kernels below, the panel GEMM above), a choice export bakes in; and a
    batch of one is a shape of its own to export. So: 1, then the spans between the thresholds."""
    cuts = sorted({k.GEMV_ROWS for m in model.modules() if (k := getattr(m, "kernel", None)) is not None
                   and isinstance(getattr(k, "GEMV_ROWS", None), int) and 1 <= k.GEMV_ROWS < MAX_BATCH})
    los = [1, 2, *(c + 1 for c in cuts if c >= 2)]
    his = [1, *(c for c in cuts if c >= 2), MAX_BATCH]
    return list(zip(los, his))


def _pool_tensors(pool: KVPool) -> tuple[list[str], list[torch.Tensor]]:
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for i, (k, v) in enumerate(zip(pool.k, pool.v)):
        for part, x in (("k", k), ("v", v)):
            if isinstance(x, QuantKV):  # codes (n_blocks, KV, block, hd) int8, scales (n_blocks, KV, block)
                names += [f"pool.{i}.{part}.codes", f"pool.{i}.{part}.scales"]
                tensors += [x.codes, x.scales]
            else:
                names.append(f"pool.{i}.{part}")
                tensors.append(x)  # (n_blocks, KV, block, hd): the number of blocks is dynamic
    if pool.plan.kv_dtype == "int8":  # an input, as weights are: a step that made it would hold it
        hd = tensors[0].shape[-1]
        names.append("pool.rotation")
        tensors.append(key_rotation(hd, torch.float32, tensors[0].device))  # (hd, hd)
    return names, tensors


def _pool_axis(name: str) -> int | None:
    """A pool tensor's dynamic axis: its blocks (0); none for the key rotation."""
    return None if name == "pool.rotation" else 0


def package_paths(model: Transformer, pool: KVPool, cache_dir: Path
                  ) -> tuple[list[tuple[tuple[int, int], Path]], list[torch.Tensor]]:
    """Where the packages for ``model`` over pools shaped as ``pool`` live under ``cache_dir`` (built or
    not), one per range of :func:`batch_ranges`; and the runners' tensor arguments after the step's eight."""
    names, tensors = aot.model_tensors(model)
    axes: list[int | None] = [None] * len(tensors)
    pool_names, pool_tensors = _pool_tensors(pool)
    key = aot.package_key(model, [*(f"model.{n}" for n in names), *pool_names], [*tensors, *pool_tensors],
                          [*axes, *(_pool_axis(n) for n in pool_names)])
    paths = [((lo, hi), cache_dir / f"paged-decode-{key}-b{lo}-{hi}.pt2") for lo, hi in batch_ranges(model)]
    return paths, [*tensors, *pool_tensors]


def build_package(model: Transformer, pool: KVPool, kernel: PagedDecodeAttention, path: Path,
                  batch: tuple[int, int]) -> None:
    """Export the decode-only step for ``model`` over pools shaped as ``pool``, for batches of
    ``batch`` (lo, hi) sequences, and compile it to ``path``."""
    from torch.export import Dim

    names, tensors = aot.model_tensors(model)
    pool_names, pool_tensors = _pool_tensors(pool)
    dev = model.device
    lo, hi = batch
    B = max(lo, 2) if hi > lo else lo  # export specialises a dynamic dimension whose example is 0 or 1
    rope = _rope_width(model)
    example = (torch.zeros(1, B, dtype=torch.long, device=dev), torch.arange(3, 3 + B, device=dev),
               torch.zeros(B, rope, dtype=model.dtype, device=dev), torch.zeros(B, rope, dtype=model.dtype, device=dev),
               torch.arange(B, device=dev), torch.arange(3, 3 + B, device=dev),
               torch.zeros(B, 2, dtype=torch.int32, device=dev), torch.full((B,), 4, dtype=torch.int32, device=dev),
               (*tensors, *pool_tensors))
    b = Dim("batch", min=lo, max=hi) if hi > lo else None
    rows = {0: b} if b is not None else {}
    width = Dim("table_width", min=1, max=MAX_TABLE)
    blocks = Dim("pool_blocks", min=2, max=1 << 24)
    dims = (
        {1: b} if b is not None else {}, rows, rows, rows, rows, rows, {**rows, 1: width}, rows,
        tuple([None] * len(tensors) + [None if _pool_axis(n) is None else {0: blocks} for n in pool_names]),
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=aot.LEAFSPEC_WARNING, category=FutureWarning)
        step = _Step(model, names, pool.block_size, kernel, pool.plan.kv_dtype == "int8")
        program = torch.export.export(step, example, dynamic_shapes=dims)
    aot.write_package(program, path)


def _rope_width(model: Transformer) -> int:
    """Columns of the step's cos / sin rows (the engine's RoPE tables)."""
    cos, _ = rope_tables(model.config, 2, torch.device("cpu"))
    return cos.shape[-1]


class PagedAotDecode:
    """The batch engine's decode-only step through its AOTInductor packages, looked up (or, with
    ``build``, built) once for the engine's model and pool, for batches of up to ``max_batch``
    sequences. Raises :class:`runtime.aot.PackageMissing` when one is missing and ``build`` is False;
    RuntimeError when the step cannot run this model or cannot be built here."""

    def __init__(self, model: Transformer, pool: KVPool, kernel: PagedDecodeAttention, cache_dir: Path,
                 max_batch: int, inductor_dir: Path | None = None, build: bool = False) -> None:
        why = unsupported(model, pool, kernel)
        if why:
            raise RuntimeError(f"the compiled batch step cannot run this model: {why}")
        paths, tensors = package_paths(model, pool, cache_dir)
        paths = [(rng, p) for rng, p in paths if rng[0] <= max_batch]
        self.build_s = 0.0
        missing = [(rng, p) for rng, p in paths if not p.exists()]
        if missing and not build:
            raise aot.PackageMissing(f"no batch decode step is built for this model yet ({missing[0][1].name})",
                                     missing[0][1])
        for rng, path in missing:
            reason = compile_unavailable_reason(model.device)
            if reason:
                raise RuntimeError(reason)
            t0 = time.perf_counter()
            with inductor_cache_dir(inductor_dir), torch.inference_mode(False):
                build_package(model, pool, kernel, path, rng)
            self.build_s += time.perf_counter() - t0
        self.paths = [p for _, p in paths]
        #: (smallest batch, largest batch, runner) of each package.
        self._runners = [(lo, hi, aot.load_runner(p)) for (lo, hi), p in paths]
        # The runner's arguments, made once: a step sets the first eight.
        self._args: list[torch.Tensor | None] = [None] * 8 + tensors

    def takes(self, step: PagedStep) -> bool:
        """Whether ``step`` is one the packages compute: every row a sampled single query on the kernel,
        and as many rows as a package takes."""
        return (step.all_decode and step.logits_rows.shape[0] == step.num_tokens
                and step.num_tokens <= self._runners[-1][1])

    def __call__(self, ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """Logits (B, vocab) of a step :meth:`takes`."""
        B = step.num_tokens
        runner = next(r for lo, hi, r in self._runners if lo <= B <= hi)
        args = self._args
        args[:8] = [ids, step.positions, step.cos, step.sin, step.write_blocks, step.write_rows,
                    step.decode_tables, step.decode_lens]
        return runner.run(args)[0]
