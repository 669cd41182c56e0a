"""The batch engine's compiled decode step: the one place that knows which step a model needs, where
its packages live, how they are built (now, or in the background) and loaded, and what a failed
build leaves behind.

In a step where every running sequence decodes one token (the engine's steady state, and the whole of
a single stream's generation after its prompt) the eager forward spends about a third of a batch-1
step in per-op overhead around the matmuls. This step is that forward exported with the batch size,
the block tables' width and the pool's size as dynamic dimensions, and compiled with AOTInductor: a
shared library with the same generated kernels, called straight from Python with a list of tensors
(no dynamo guards or bytecode per call, which cost ~0.7 ms of a ~6 ms batch-1 step under
``torch.compile``). One package per model structure (and thread count, and range of batch sizes the
quantized kernels treat alike: :func:`batch_ranges`) serves every batch, context length and pool
budget. A model with sliding-window layers (Gemma 3) is the same: the paged kernel takes each
layer's window and each layer group's block table is an input, so the step is the same code at
every length.

The package holds **no weights**: the model's parameters and the pool's K/V tensors are inputs,
handed over on every call (the pool is written in place). So a package is a few MB and nothing is
held twice in memory. It is keyed by what its generated code depends on: the model's structure
(modules, kernels, tensor shapes and dtypes), the pool's layout, the torch and Python versions, the
CPU's vector ISA and the thread count (inductor bakes ``num_threads`` into its OpenMP loops).

Steps with a prefill chunk, sequences that do not sample, or a model the step does not cover
(:func:`unsupported`) run eagerly. An int8 pool is handed over as each layer's codes and scales and
its key rotation; the step quantizes the new rows as the eager one does.

Building: ``localllm compile`` builds ahead (:func:`build`); a run that finds no package runs
eagerly and then has :func:`start_background_build` call the launcher the command layer hands it (a
detached ``localllm compile`` at the lowest CPU priority). Every build in a home, ``run --compile``'s
too, holds the home's build lock (:func:`build_lock`) while it compiles, so two builds never share
inductor's cache folder at once; a second waits, then skips what the first built. A build that
fails leaves a mark beside each package it could not build (:class:`FailedBuild`: the reason, when,
how often, and the versions it was built with) and its full output in the build log; runs start it
again after a back-off that grows with the failures (:data:`RETRY_AFTER_S`), at once when localllm,
torch or the compiler changed, and say meanwhile which steps run eagerly and why
(:attr:`StepLookup.note`). ``LOCALLLM_BACKGROUND_BUILD=0`` turns the background builds off (the
tests do).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from localllm import native
from localllm.paths import home
from localllm.quant.experts import QuantExperts, ReferenceExperts
from localllm.runtime.build_failures import (FailedBuild, config_digest, eager_note, failure_marker, log_failure,
                                             read_failure, record_failure)
from localllm.runtime.cache import QuantKV, key_rotation
from localllm.runtime.kv_pool import KVPool
from localllm.runtime.model import Transformer, cache_rope_tables
from localllm.runtime.paged import PagedDecodeAttention, PagedStep
from localllm.runtime.speculate import MAX_DRAFT

#: Bumped when the exported step's calling convention changes, or what a kernel's tensors hold (7: an
#: int4z layer's tile offsets hold -z), so old packages are not picked up.
FORMAT = 7
#: The largest batch and block-table width a package takes (the engine's limits are far below).
MAX_BATCH = 1024
MAX_TABLE = 1 << 16
#: Inductor options: round every intermediate to its dtype as eager does (inductor otherwise keeps
#: fused bf16 math in fp32), so compiled logits match eager's but for a reduction's order now and then.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
#: torch.export's pytree code trips torch's own deprecation of ``isinstance(treespec, LeafSpec)``: a
#: warning meant for torch, which reached the user on the first build.
LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
#: The environment switch of background builds ("0": off).
ENV_SWITCH = "LOCALLLM_BACKGROUND_BUILD"


def aot_dir() -> Path:
    """Where packages live: ``<home>/inductor/aot``."""
    return home() / "inductor" / "aot"


# Why not / where ----------------------------------------------------------------------------------
def compile_unavailable_reason(device: torch.device) -> str | None:
    """Why a step cannot be compiled on ``device`` here, or None."""
    if device.type != "cpu":
        return "it is built for the CPU only"
    if native.compiler() is None:
        return "no C++ compiler (g++) for inductor's CPU code"
    return None


def unsupported(model: Transformer, pool: KVPool, kernel: PagedDecodeAttention | None) -> str | None:
    """Why the compiled step cannot run ``model`` over ``pool`` (None: it can)."""
    if model.device.type != "cpu":
        return "it is built for the CPU only"
    if kernel is None:
        return "it needs localllm's paged attention kernel"
    if any(layer.attn.softcap is not None for layer in model.layers):
        return "soft-capped attention does not take the paged kernel"
    if any(layer.attn.sinks is not None for layer in model.layers):
        return "attention with sinks (gpt-oss) is not traced through the paged kernel yet"
    if any(isinstance(m, QuantExperts) and m.kernel in (None, ReferenceExperts) for m in model.modules()):
        # the reference loops over the experts a step routes to (data): one native call traces, by its fake
        return "its Mixture-of-Experts layers run on the reference expert kernel"
    return None


@functools.cache
def _inductor_default_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


@contextmanager
def inductor_cache_dir(folder: Path | None) -> Iterator[None]:
    """Inductor's cache folder is ``folder`` within the block (unless the user chose one with
    ``TORCHINDUCTOR_CACHE_DIR``); the environment is as it was afterwards. Inductor reads the folder
    from the environment only, and only when it compiles."""
    key = "TORCHINDUCTOR_CACHE_DIR"
    saved = os.environ.get(key)
    if saved is not None and os.path.abspath(saved) != _inductor_default_dir():
        folder = None
    if folder is None:
        yield
        return
    os.environ[key] = str(folder)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


# The traced step ----------------------------------------------------------------------------------
class _PoolView:
    """The K/V tensors of a pool as a traced step sees them (``KVPool``'s ``k``, ``v``, ``block_size``,
    ``group_of``)."""

    def __init__(self, k: list[Any], v: list[Any], block_size: int, group_of: list[int]) -> None:
        self.k, self.v, self.block_size, self.group_of = k, v, block_size, group_of


class _Step(nn.Module):
    """The decode-only step as a function of its tensors: what gets exported (the model is held in a
    list, so that export lifts none of its weights into the package)."""

    def __init__(self, model: Transformer, names: list[str], pool: KVPool, kernel: PagedDecodeAttention) -> None:
        super().__init__()
        self._model = [model]
        self._names = names
        self._block_size = pool.block_size
        self._group_of = list(pool.group_of)
        self._slots = pool_slots(pool)
        self._n_groups = 1 + max(pool.group_of, default=0)
        self._kernel = kernel
        self._quantized = pool.kv_dtype == "int8"  # each K or V is two tensors (codes, scales)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                write_rows: torch.Tensor, lens: torch.Tensor, groups: tuple[torch.Tensor, ...],
                tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # ids (1, B); positions, write_rows (B,) long; cos, sin (B, rope); lens (B,) int32; groups: per
        # layer group its write blocks (B,) long and block tables (B, W) int32. tensors: the model's
        # parameters and buffers, then each slot's K and V pools (an int8 pool's K codes, K scales,
        # V codes, V scales, then its key rotation (hd, hd)): pool_slots maps layers to slots.
        n = len(self._names)
        params = dict(zip(self._names, tensors[:n]))
        kv: list[Any] = list(tensors[n:])
        rotation = None
        if self._quantized:
            rotation = kv.pop()
            kv = [QuantKV(c, sc) for c, sc in zip(kv[0::2], kv[1::2])]
        ks, vs = kv[0::2], kv[1::2]
        pool = _PoolView([ks[j] for j in self._slots], [vs[j] for j in self._slots], self._block_size, self._group_of)
        steps = [PagedStep.decode_only(pool, positions, cos, sin, groups[2 * g], write_rows,  # type: ignore[arg-type]
                                       groups[2 * g + 1], lens, self._kernel, rotation) for g in range(self._n_groups)]
        if self._n_groups > 1:
            steps[0].groups = tuple(steps)
        logits = torch.func.functional_call(self._model[0], params, (ids, steps[0]), strict=False, tie_weights=True)
        return logits[0]  # (B, vocab)


def batch_ranges(model: Transformer) -> list[tuple[int, int]]:
    """The batch sizes one package each covers. A quantized linear picks its kernel by the number of
    rows (``Kernel.row_limit`` of each layer: row kernels up to it, the panel GEMM above), a choice
    export bakes in; and a batch of one is a shape of its own to export. So: 1, then the spans
    between the thresholds."""
    cuts = sorted({n for m in model.modules() if not isinstance(m, QuantExperts)  # one path for any rows
                   and (k := getattr(m, "kernel", None)) is not None
                   and isinstance(n := k.row_limit(m), int) and 1 <= n < MAX_BATCH})
    los = [1, 2, *(c + 1 for c in cuts if c >= 2)]
    his = [1, *(c for c in cuts if c >= 2), MAX_BATCH]
    return list(zip(los, his))


def model_tensors(model: Transformer) -> tuple[list[str], list[torch.Tensor]]:
    """Names and tensors of the model's parameters and buffers (each once)."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    names = sorted(named)
    return names, [named[n] for n in names]


def pool_slots(pool: KVPool) -> list[int]:
    """Each layer's slot: the index of its K/V tensors among the pool's distinct ones (layers in the
    same slot of different layer groups share a tensor, :mod:`runtime.kv_pool`)."""
    first: dict[int, int] = {}
    for k in pool.k:
        key = id(k.codes if isinstance(k, QuantKV) else k)
        first.setdefault(key, len(first))
    return [first[id(k.codes if isinstance(k, QuantKV) else k)] for k in pool.k]


def _pool_tensors(pool: KVPool) -> tuple[list[str], list[torch.Tensor]]:
    """The pool's distinct K/V tensors, each once: an input handed over twice would be two aliases of
    one mutated tensor, which export cannot take."""
    slots = pool_slots(pool)
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for j in range(max(slots, default=-1) + 1):
        layer = slots.index(j)
        for part, x in (("k", pool.k[layer]), ("v", pool.v[layer])):
            if isinstance(x, QuantKV):  # codes (n_blocks, KV, block, hd) int8, scales (n_blocks, KV, block)
                names += [f"pool.{j}.{part}.codes", f"pool.{j}.{part}.scales"]
                tensors += [x.codes, x.scales]
            else:
                names.append(f"pool.{j}.{part}")
                tensors.append(x)  # (n_blocks, KV, block, hd): the number of blocks is dynamic
    if pool.kv_dtype == "int8":  # an input, as weights are: a step that made it would hold it
        hd = tensors[0].shape[-1]
        names.append("pool.rotation")
        tensors.append(key_rotation(hd, torch.float32, tensors[0].device))  # (hd, hd)
    return names, tensors


def _pool_axis(name: str) -> int | None:
    """A pool tensor's dynamic axis: its blocks (0); none for the key rotation."""
    return None if name == "pool.rotation" else 0


def _shape_key(t: torch.Tensor, axis: int | None) -> str:
    """A tensor's shape and strides for a package key, its dynamic axis (if any) as ``N``."""
    shape: list[object] = list(t.shape)
    stride: list[object] = list(t.stride())
    if axis is not None:
        n = shape[axis]
        shape[axis] = "N"
        stride = [f"{s // n}N" if i < axis and n and s % n == 0 else s for i, s in enumerate(stride)]
    return f"{tuple(shape)} {tuple(stride)} {t.dtype}"


def package_key(model: Transformer, kernel: PagedDecodeAttention, pool: KVPool, names: list[str],
                tensors: list[torch.Tensor], axes: list[int | None]) -> str:
    """What the generated code depends on, hashed (see the module's docstring)."""
    h = hashlib.sha256()
    parts = [
        f"format {FORMAT}", f"attention {kernel.__module__}.{kernel.__qualname__}", torch.__version__,
        sys.version.split()[0], platform.machine(), torch.backends.cpu.get_cpu_capability(),
        f"threads {torch.get_num_threads()}", f"groups {pool.group_of} slots {pool_slots(pool)}", repr(model.config),
        repr(model),
        *(f"{n} {_shape_key(t, a)}" for n, t, a in zip(names, tensors, axes, strict=True)),
    ]
    for p in parts:
        h.update(p.encode() + b"\0")
    return h.hexdigest()[:24]


def package_paths(model: Transformer, pool: KVPool, kernel: PagedDecodeAttention, cache_dir: Path | None = None
                  ) -> tuple[list[tuple[tuple[int, int], Path]], list[torch.Tensor]]:
    """Where the packages for ``model`` over pools shaped as ``pool`` live (built or not), one per range
    of :func:`batch_ranges`; and the runners' tensor arguments after the step's own."""
    names, tensors = model_tensors(model)
    pool_names, pool_tensors = _pool_tensors(pool)
    key = package_key(model, kernel, pool, [*(f"model.{n}" for n in names), *pool_names], [*tensors, *pool_tensors],
                      [*([None] * len(tensors)), *(_pool_axis(n) for n in pool_names)])
    folder = cache_dir or aot_dir()
    paths = [((lo, hi), folder / f"paged-decode-{key}-b{lo}-{hi}.pt2") for lo, hi in batch_ranges(model)]
    return paths, [*tensors, *pool_tensors]


def failed_builds(config: Any) -> list[FailedBuild]:
    """The failed builds of packages for models of ``config`` that are still missing (``show``)."""
    digest = config_digest(config)
    found = [read_failure(m.with_suffix(".pt2")) for m in sorted(aot_dir().glob("*.failed"))]
    return [f for f in found if f is not None and f.config == digest and not f.package.exists()]


class PackageMissing(RuntimeError):
    """No package is built for this model yet (and building was not asked for); ``path`` is the first
    missing one, ``missing`` all of them."""

    def __init__(self, message: str, path: Path, missing: list[Path] | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.missing = missing or [path]


def _example(model: Transformer, pool: KVPool, B: int, tensors: list[torch.Tensor]) -> tuple:
    dev = model.device
    cos, _ = cache_rope_tables(model.config, 2, torch.device("cpu"))
    rope = cos.shape[-1]  # the global tables' columns, and the local ones' beside them (Gemma 3)
    n_groups = 1 + max(pool.group_of, default=0)
    groups = []
    for _ in range(n_groups):
        groups += [torch.arange(B, device=dev), torch.zeros(B, 2, dtype=torch.int32, device=dev)]
    return (torch.zeros(1, B, dtype=torch.long, device=dev), torch.arange(3, 3 + B, device=dev),
            torch.zeros(B, rope, dtype=model.dtype, device=dev), torch.zeros(B, rope, dtype=model.dtype, device=dev),
            torch.arange(3, 3 + B, device=dev), torch.full((B,), 4, dtype=torch.int32, device=dev),
            tuple(groups), tuple(tensors))


def build_package(model: Transformer, pool: KVPool, kernel: PagedDecodeAttention, path: Path,
                  batch: tuple[int, int]) -> None:
    """Export the decode-only step for ``model`` over pools shaped as ``pool``, for batches of
    ``batch`` (lo, hi) sequences, and compile it to ``path``: under a temporary name, then renamed, so
    a crash or a concurrent build never leaves a half-written package under the final name."""
    from torch.export import Dim

    names, tensors = model_tensors(model)
    pool_names, pool_tensors = _pool_tensors(pool)
    lo, hi = batch
    B = max(lo, 2) if hi > lo else lo  # export specialises a dynamic dimension whose example is 0 or 1
    example = _example(model, pool, B, [*tensors, *pool_tensors])
    b = Dim("batch", min=lo, max=hi) if hi > lo else None
    rows = {0: b} if b is not None else {}
    width = Dim("table_width", min=1, max=MAX_TABLE)  # every group's table is as wide (runtime.paged)
    blocks = Dim("pool_blocks", min=2, max=1 << 24)
    groups = tuple(d for _ in range(len(example[6]) // 2) for d in (rows, {**rows, 1: width}))
    dims = (
        {1: b} if b is not None else {}, rows, rows, rows, rows, rows, groups,
        tuple([None] * len(tensors) + [None if _pool_axis(n) is None else {0: blocks} for n in pool_names]),
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, category=FutureWarning)
        program = torch.export.export(_Step(model, names, pool, kernel), example, dynamic_shapes=dims)
    sig = program.graph_signature
    held = [*sig.parameters, *sig.buffers, *(n for n, t in program.constants.items() if t.numel() > 1)]
    if held:  # weights baked into the package would be stale copies, and held twice
        raise RuntimeError(f"the exported step holds model tensors of its own ({', '.join(held[:3])}...)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{uuid.uuid4().hex}.tmp.pt2")  # the packager wants .pt2
    from torch._inductor import aoti_compile_and_package

    try:
        with warnings.catch_warnings():
            # a Q8_0 head's fp16 scales beside bf16 activations: inductor says so, and handles it
            warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")
            warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, category=FutureWarning)
            aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=INDUCTOR_OPTIONS)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_runner(path: Path):  # type: ignore[no-untyped-def]
    """The package's runner (``.run(list of tensors) -> list of tensors``): straight from torch's C++
    loader when it takes the package (a few ms, where the Python ``aoti_load_package`` first imports
    inductor, about a second of every start)."""
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except (AttributeError, RuntimeError):
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(path)).loader


class CompiledDecode:
    """The batch engine's decode-only step through its AOTInductor packages, looked up (or, with
    ``build``, built) once for the engine's model and pool, for batches of up to ``max_batch``
    sequences. Without ``build`` the packages on disk serve the batch sizes they cover (a server
    whose batch package is still being built runs its lone streams compiled) and :attr:`missing` lists
    the others; :class:`PackageMissing` when none is built. RuntimeError when the step cannot run this
    model or cannot be built here."""

    def __init__(self, model: Transformer, pool: KVPool, kernel: PagedDecodeAttention, max_batch: int,
                 build: bool = False, cache_dir: Path | None = None, load_batch: int = 0,
                 want_batch: int = 0) -> None:
        why = unsupported(model, pool, kernel)
        if why:
            raise RuntimeError(f"the compiled step cannot run this model: {why}")
        every, tensors = package_paths(model, pool, kernel, cache_dir)
        paths = [(rng, p) for rng, p in every if rng[0] <= max_batch]
        # Packages of more rows than sequences (verify steps: each sequence's drafts are rows of their
        # own) serve where built, up to load_batch rows; build=True does not wait for them.
        drafts = [(rng, p) for rng, p in every if max_batch < rng[0] <= load_batch]
        self.build_s = 0.0
        #: Packages not built: of this engine's batch sizes (``build=False`` only), and of verify steps of
        #: up to ``want_batch`` rows (what a background build of :func:`wanted_batch` adds).
        self.missing = [p for _, p in paths if not p.exists()]
        if self.missing and not build and len(self.missing) == len(paths):
            raise PackageMissing(f"no decode step is built for this model yet ({self.missing[0].name})",
                                 self.missing[0], self.missing + [p for (lo, _), p in drafts
                                                                  if lo <= want_batch and not p.exists()])
        todo = [(rng, p) for rng, p in paths if build and not p.exists()]
        if todo:
            reason = compile_unavailable_reason(model.device)
            if reason:
                raise RuntimeError(reason)
            with build_lock().acquire(timeout=-1):  # one build at a time in a home: it may have built these
                for rng, path in todo:
                    if path.exists():
                        continue
                    t0 = time.perf_counter()
                    with inductor_cache_dir(home() / "inductor"), torch.inference_mode(False):
                        build_package(model, pool, kernel, path, rng)
                    self.build_s += time.perf_counter() - t0
                    failure_marker(path).unlink(missing_ok=True)  # an earlier failure, fixed since
        if build:
            self.missing = []
        self.missing += [p for (lo, _), p in drafts if lo <= want_batch and not p.exists()]
        paths = [(rng, p) for rng, p in paths + drafts if p.exists()]
        self.paths = [p for _, p in paths]
        #: (smallest batch, largest batch, runner) of each package.
        self._runners = [(lo, hi, load_runner(p)) for (lo, hi), p in paths]
        self._n_groups = 1 + max(pool.group_of, default=0)
        # The runner's arguments, made once: a step sets the first ones.
        self._head = 6 + 2 * self._n_groups
        self._args: list[torch.Tensor | None] = [None] * self._head + tensors

    def _runner(self, batch: int):  # type: ignore[no-untyped-def]
        return next((r for lo, hi, r in self._runners if lo <= batch <= hi), None)

    def takes(self, step: PagedStep) -> bool:
        """Whether ``step`` is one the packages compute: every row a sampled single query on the kernel,
        and as many rows as a built package takes."""
        return (step.all_decode and step.logits_rows.shape[0] == step.num_tokens
                and self._runner(step.num_tokens) is not None)

    def __call__(self, ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """Logits (B, vocab) of a step :meth:`takes`."""
        runner = self._runner(step.num_tokens)
        args = self._args
        args[:6] = [ids, step.positions, step.cos, step.sin, step.write_rows, step.lens]
        for g, s in enumerate(step.group_steps):
            args[6 + 2 * g], args[7 + 2 * g] = s.write_blocks, s.tables
        return runner.run(args)[0]


@dataclass
class StepLookup:
    """What :func:`find_step` found for an engine."""

    step: CompiledDecode | None  # None: decode steps run eagerly
    seconds: float = 0.0  # building (``build``) or loading the packages
    #: Some package this engine's batch sizes need is not built, and it was never tried or its failed
    #: build is due for a retry (:class:`FailedBuild`): a build would serve (the batch sizes the built
    #: ones cover run compiled meanwhile).
    needs_build: bool = False
    #: Why (some) decode steps run eagerly although a compiled step was asked for: the step cannot run
    #: the model, building it failed now, or an earlier build failed (and when it is tried again).
    note: str | None = None
    error: str | None = None  # a build that failed now: its full output (the compiler's, a traceback)


def wanted_batch(max_running: int, speculate: bool) -> int:
    """The batch sizes (query rows) an engine of ``max_running`` sequences wants packages for, and its
    background builds cover: its own, and with speculation a lone sequence's verify steps too (up to
    ``1 + MAX_DRAFT`` rows), which run eagerly otherwise, at about twice a compiled step's time.
    Larger batches' verify steps stay eager until ``localllm compile --batch`` builds them: in those
    steps drafts rarely pay."""
    return max(max_running, 1 + MAX_DRAFT) if speculate else max_running


def find_step(model: Transformer, pool: KVPool, kernel: PagedDecodeAttention | None, max_batch: int,
              build: bool, load_batch: int = 0, want_batch: int = 0) -> StepLookup:
    """The compiled decode step for ``model`` over ``pool``: loaded when built, built now with
    ``build``, else nothing (with :attr:`StepLookup.needs_build` saying whether a build would serve).
    ``load_batch``, ``want_batch``: as for :class:`CompiledDecode`."""
    why = unsupported(model, pool, kernel)
    if why is not None:
        return StepLookup(None, note=f"decode steps run eagerly: {why}")
    assert kernel is not None
    t0 = time.perf_counter()
    try:
        step = CompiledDecode(model, pool, kernel, max_batch, build=build, load_batch=load_batch,
                              want_batch=want_batch)
    except PackageMissing as e:  # a build that failed before is started again after its back-off
        needs, note = eager_note(e.missing)
        return StepLookup(None, time.perf_counter() - t0, needs_build=needs, note=note)
    except (RuntimeError, OSError) as e:  # no compiler, the build failed, a full disk: eager, saying why
        return StepLookup(None, time.perf_counter() - t0, note=f"decode steps run eagerly: {first_line(e)}",
                          error="".join(traceback.format_exception(e)))
    needs, note = eager_note(step.missing)
    return StepLookup(step, time.perf_counter() - t0, needs_build=needs, note=note)


def first_line(e: BaseException) -> str:
    """An exception's first line, its type named (inductor's compile errors say only "C++ compile
    error" there; the compiler's output follows)."""
    text = str(e).strip()
    first = text.splitlines()[0].strip() if text else ""
    name = type(e).__name__
    return first if first.startswith(name) else f"{name}: {first}" if first else name


# Building ahead, and in the background ------------------------------------------------------------
def _lock_path() -> Path:
    folder = aot_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / ".build.lock"


def build_lock() -> Any:
    """The home's build lock (a ``filelock.FileLock``: ``.acquire(timeout=...)``), held by every build
    while it compiles. One object per home in a process, so a build that holds it may take it again
    (:func:`build` around the engine's own build); the kernel releases it when a build dies."""
    from filelock import FileLock

    return FileLock(_lock_path(), is_singleton=True)


def yield_cpu() -> None:
    """Run this process (and the threads and processes it starts from now on: the compiler's) only
    when nothing else wants the CPU: Linux's SCHED_IDLE, and nice 19 where that is refused. A build
    in the background then takes the cores a user's run leaves idle, not a share of its time (at nice
    19 alone it still takes a slice, which a run whose threads meet at every layer pays for in full)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        pass
    if hasattr(os, "nice"):
        try:
            os.nice(19 - os.nice(0))
        except OSError:
            pass


def background_builds_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") not in ("0", "")


#: Starts a build of a model's packages for batches of up to its argument, in a process of its own
#: that outlives the caller (the command layer's: the runtime knows no command line).
BuildLauncher = Callable[[int], None]


def start_background_build(launch: BuildLauncher, batch: int = 1) -> bool:
    """Have ``launch`` start a background build of the packages for batches of up to ``batch``
    sequences, when background builds are on, a compiler is here and no build holds the lock (the
    command layer's launcher runs ``localllm compile --if-idle``: :func:`build` with ``background``, at
    the lowest CPU priority, stopped whenever an engine generates). False when it was not started.
    The caller says so on stderr: the build outlives it."""
    from filelock import Timeout

    if not background_builds_enabled() or compile_unavailable_reason(torch.device("cpu")):
        return False
    try:  # a build in progress holds the lock: do not queue a second behind it
        with build_lock().acquire(timeout=0):
            pass
    except Timeout:
        return False
    launch(batch)
    return True


@dataclass
class BuildResult:
    """What :func:`build` did."""

    built: bool  # packages were built now
    already: bool = False  # every package was there
    busy: bool = False  # another build held the lock (``wait=False``)
    seconds: float = 0.0
    error: str | None = None  # why it failed, one line (recorded beside the missing packages)
    logged: bool = False  # the failure's full output is in the build log


def build(model: Transformer, batch: int = 1, kv_dtype: str = "16bit", wait: bool = True,
          background: bool = False) -> BuildResult:
    """Build ``model``'s missing decode-step packages for batches of up to ``batch`` query rows over
    ``kv_dtype`` pools, whatever earlier failures their marks record, under the build lock
    (``wait=False``: leave at once if another build holds it). A failure is recorded beside each
    package still missing (:func:`record_failure`) and its full output appended to the build log; a
    package built clears its mark. ``background``: give the CPU way first (:func:`yield_cpu`), so the
    build never competes with a user's run on a small machine."""
    from filelock import Timeout

    from localllm.runtime.batch import BatchEngine
    from localllm.runtime.kv_pool import DEFAULT_BLOCK_SIZE, block_bytes

    if background:
        yield_cpu()
    # the packages serve any pool size: the smallest pool will do to find or build them
    budget = 4 * block_bytes(model.config, DEFAULT_BLOCK_SIZE, model.dtype, kv_dtype)
    lock = build_lock()
    try:
        lock.acquire(timeout=-1 if wait else 0)
    except Timeout:
        return BuildResult(False, busy=True)
    try:
        engine = BatchEngine(model, kv_budget_bytes=budget, max_running=batch, kv_dtype=kv_dtype)
        why = unsupported(model, engine.pool, engine.kernel)
        if why is not None:
            return BuildResult(False, error=f"decode steps run eagerly: {why}")
        assert engine.kernel is not None  # else unsupported says so
        paths = [p for (lo, _), p in package_paths(model, engine.pool, engine.kernel)[0] if lo <= batch]
        if all(p.exists() for p in paths):
            for path in paths:
                failure_marker(path).unlink(missing_ok=True)
            return BuildResult(False, already=True)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            lookup = find_step(model, engine.pool, engine.kernel, batch, build=True)
        seconds = time.perf_counter() - t0
        if lookup.step is not None:
            return BuildResult(True, seconds=seconds)
        why = "; ".join([(lookup.note or "the step runs eagerly").removeprefix("decode steps run eagerly: "),
                         *(str(w.message) for w in said if "deprecated" not in str(w.message))])
        missing = [p for p in paths if not p.exists()]
        record_failure(missing, why, config_digest(model.config))
        return BuildResult(False, seconds=seconds, error=why, logged=log_failure(missing, lookup.error or why))
    finally:
        lock.release()

