"""The CPU decode step compiled ahead of time with AOTInductor, kept on disk as a package.

Why not ``torch.compile``'s just-in-time path on the CPU: at batch 1 a SmolLM2 step takes ~6 ms, and
~0.7 ms of that is dynamo's own work on every call (the bytecode that gathers ~360 parameter and
cache tensors by attribute lookups, the guard checks, the autograd wrapper). An AOTInductor package is
a shared library with the same generated kernels, called straight from Python with a list of
tensors: ``scripts/compiled_vs_eager.py`` measures the difference.

The package holds **no weights**. Parameters, buffers and the sequence's cache (KV tensors and RoPE
tables, :class:`runtime.cache.SequenceCache`) are inputs of the exported step, handed over on every call
as they are (no copy; the cache is written in place). So a package is a few MB, serves any checkpoint
of the same structure and any cache of the same length, and nothing is held twice in memory.

The cache's length is a dynamic dimension of the export (from :data:`MIN_CACHE` positions to the
model's context), so one package serves every ``--ctx``: a model is built for once, not once per
context length. Caches with a sliding-window ring (Gemma 3) keep static shapes: a ring's length is
its window, and the packages are then per cache length. Their step also changes at the window (a
ring reads its filled prefix, then, once it has wrapped, all of it): one package covers the keys up
to the window, another those beyond (:func:`kv_ranges`).

It is keyed by what its generated code depends on: the model's structure (modules, kernels, tensor
shapes and dtypes; the cache's length only when it is static), the torch and Python versions, the
CPU's vector ISA and the thread count (inductor bakes ``num_threads`` into its OpenMP loops).

The step's attention is whatever the model runs eagerly (on the CPU :mod:`runtime.cpu_attention`'s
kernel, installed at load; SDPA where it could not be built). A package calls the kernel by name, so
packages are keyed by it too.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
import uuid
import warnings
from pathlib import Path

import torch
from torch import nn

from localllm.runtime.cache import SequenceCache
from localllm.runtime.compile import DecodeFn, INDUCTOR_OPTIONS, compile_unavailable_reason, inductor_cache_dir
from localllm.runtime.model import Transformer

#: Bumped when the exported step's calling convention changes, so old packages are not picked up.
FORMAT = 4

#: The shortest cache a length-generic package takes (shorter ones get a package of their own).
MIN_CACHE = 8
#: The shortest cache any package takes (shorter ones run eagerly).
MIN_STEP_CACHE = 4

#: torch.export's pytree code trips torch's own deprecation of ``isinstance(treespec, LeafSpec)``: a
#: warning meant for torch, which reached the user on the first --compile.
LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def model_tensors(model: Transformer) -> tuple[list[str], list[torch.Tensor]]:
    """Names and tensors of the model's parameters and buffers (each once)."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    names = sorted(named)
    return names, [named[n] for n in names]


def _cache_names(cache: SequenceCache) -> list[str]:
    """Names of ``cache.tensors()``, for package keys."""
    return [*(f"cache.{i}.{kv}" for i in range(len(cache.layers)) for kv in "kv"), "cos", "sin"]


def length_generic(model: Transformer, cache: SequenceCache) -> bool:
    """Whether ``cache``'s length can be a dynamic dimension of the package: every layer holds the
    whole sequence (no ring) and the length is within the exported range."""
    return (all(c.window is None for c in cache.layers)
            and MIN_CACHE <= cache.max_seq <= model.config.max_seq_len)


def kv_ranges(model: Transformer, cache: SequenceCache) -> list[tuple[int, int]]:
    """The ranges of keys attended to (``kv_len``, the position + 1) that one package each covers: one
    range for whole-sequence caches; for ring caches, one below each distinct window and one beyond.
    The lengths between run eagerly: 1, each window (a ring read whole before it wraps) and the
    cache's whole length (export specialises a slice that takes a whole tensor)."""
    top = (model.config.max_seq_len if length_generic(model, cache) else cache.max_seq) - 1
    bounds = sorted({c.window for c in cache.layers if c.window is not None and 2 <= c.window < top})
    lows = [2, *(w + 1 for w in bounds)]
    highs = [*(w - 1 for w in bounds), top]
    return [(lo, hi) for lo, hi in zip(lows, highs) if lo <= hi]


def _cache_dims(cache: SequenceCache, length: object) -> list[dict[int, object]]:
    """For each of ``cache.tensors()``, its dimension that is the cache's length (K/V (B, KV, L, hd):
    axis 2; cos/sin (L, rotary): axis 0), mapped to ``length``."""
    return [*({2: length} for _ in range(2 * len(cache.layers))), {0: length}, {0: length}]


def _shape_key(t: torch.Tensor, length_axis: int | None) -> str:
    """A tensor's shape and strides for a package key, the cache's length (when dynamic) as ``L``."""
    shape: list[object] = list(t.shape)
    stride: list[object] = list(t.stride())
    if length_axis is not None:
        n = shape[length_axis]
        shape[length_axis] = "L"
        stride = [f"{s // n}L" if i < length_axis and s % n == 0 else s for i, s in enumerate(stride)]
    return f"{tuple(shape)} {tuple(stride)} {t.dtype}"


class _Bound(nn.Module):
    """``base`` bound to the model, as a module ``functional_call`` can run with other tensors."""

    def __init__(self, model: Transformer, base: DecodeFn) -> None:
        super().__init__()
        self.model = model
        self.base = base

    def forward(self, cache: SequenceCache, token: torch.Tensor, input_pos: torch.Tensor, pos: int) -> torch.Tensor:
        return self.base(self.model, cache, token, input_pos, pos)


class _Step(nn.Module):
    """The decode step as a function of its tensors: what gets exported. (The model is held in a list,
    not as a submodule, so that export lifts none of its weights into the package.)"""

    def __init__(self, model: Transformer, base: DecodeFn, names: list[str]) -> None:
        super().__init__()
        self._bound = [_Bound(model, base)]
        self._names = [f"model.{n}" for n in names]

    def forward(self, token: torch.Tensor, input_pos: torch.Tensor, span: torch.Tensor,
                tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # token (1, 1), input_pos (1,); span (kv_len,) carries the number of keys to attend to in its
        # shape, a dynamic dimension of the export (a Python int would be baked in as a constant).
        # tensors: the model's parameters and buffers, then the cache's (SequenceCache.tensors()).
        n = len(self._names)
        params = dict(zip(self._names, tensors[:n]))
        cache = SequenceCache.from_tensors(tensors[n:])
        return torch.func.functional_call(self._bound[0], params, (cache, token, input_pos, span.shape[0] - 1),
                                          strict=False, tie_weights=True)


def attention_name(model: Transformer) -> str:
    """The model's decode attention, as named in package keys."""
    k = model.decode_kernel
    return "sdpa" if k is None else f"{k.__module__}.{k.__qualname__}"


def package_key(model: Transformer, names: list[str], tensors: list[torch.Tensor],
                length_axes: list[int | None] | None = None) -> str:
    """What the generated code depends on, hashed (see the module docstring). ``length_axes``: for
    each tensor, its axis that is the cache's dynamic length (None: every dimension is fixed)."""
    axes = length_axes or [None] * len(tensors)
    h = hashlib.sha256()
    parts = [
        f"format {FORMAT}", f"attention {attention_name(model)}", torch.__version__, sys.version.split()[0],
        platform.machine(),
        torch.backends.cpu.get_cpu_capability(), f"threads {torch.get_num_threads()}",
        repr(model.config), repr(model),  # the modules, with each QuantLinear's scheme and kernel
        *(f"{n} {_shape_key(t, a)}" for n, t, a in zip(names, tensors, axes, strict=True)),
    ]
    for p in parts:
        h.update(p.encode() + b"\0")
    return h.hexdigest()[:24]


def build_package(model: Transformer, cache: SequenceCache, base: DecodeFn, path: Path,
                  kv_range: tuple[int, int] | None = None) -> None:
    """Export ``base`` for ``model`` and caches shaped as ``cache``, for ``kv_range`` keys attended to
    (default: the first of :func:`kv_ranges`), and compile it to the AOTInductor package ``path``.

    Written under a temporary name and renamed, so a crash or a concurrent build never leaves a
    half-written package under the final name.
    """
    from torch.export import Dim

    lo, hi = kv_range or kv_ranges(model, cache)[0]
    names, tensors = model_tensors(model)
    tensors += cache.tensors()
    dev = model.device
    example = (torch.zeros(1, 1, dtype=torch.long, device=dev), torch.tensor([lo - 1], device=dev),
               torch.empty(lo, dtype=torch.int8, device=dev), tuple(tensors))
    # kv_len = the cache's length is left out: export specialises the slice that reads the whole cache.
    fixed: list[dict[int, object] | None] = [None] * (len(tensors) - len(cache.tensors()))
    if length_generic(model, cache):
        length = Dim("cache_len", min=MIN_CACHE, max=model.config.max_seq_len)
        dims = tuple(fixed + _cache_dims(cache, length))
    else:
        dims = tuple(None for _ in tensors)
    span_dims = {0: Dim("kv_len", min=lo, max=hi)} if hi > lo else {}  # one length: a static shape
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, category=FutureWarning)
        program = torch.export.export(_Step(model, base, names), example, dynamic_shapes=({}, {}, span_dims, dims))
    write_package(program, path)


def write_package(program: torch.export.ExportedProgram, path: Path) -> None:
    """Compile an exported step that takes the model's tensors as inputs to the AOTInductor package
    ``path``: under a temporary name, then renamed, so a crash or a concurrent build never leaves a
    half-written package under the final name."""
    sig = program.graph_signature
    held = [*sig.parameters, *sig.buffers, *(n for n, t in program.constants.items() if t.numel() > 1)]
    if held:  # weights baked into the package would be stale copies, and held twice
        raise RuntimeError(f"the exported step holds model tensors of its own ({', '.join(held[:3])}...)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{uuid.uuid4().hex}.tmp.pt2")  # the packager wants .pt2
    from torch._inductor import aoti_compile_and_package

    try:
        # Round every intermediate to its dtype as eager does (see runtime.compile).
        with warnings.catch_warnings():
            # a Q8_0 head's fp16 scales beside bf16 activations: inductor says so, and handles it
            warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")
            warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, category=FutureWarning)
            aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=INDUCTOR_OPTIONS)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def package_paths(model: Transformer, cache: SequenceCache, cache_dir: Path
                  ) -> tuple[list[tuple[tuple[int, int], Path]], list[torch.Tensor]]:
    """Where the packages for ``model`` and caches shaped as ``cache`` live under ``cache_dir`` (built
    or not), one per range of :func:`kv_ranges`; and the runners' tensor arguments after (token,
    position, span)."""
    names, tensors = model_tensors(model)
    axes: list[int | None] = [None] * len(tensors)
    names += _cache_names(cache)
    tensors += cache.tensors()
    if length_generic(model, cache):
        axes += [next(iter(d)) for d in _cache_dims(cache, None)]
    else:
        axes += [None] * (len(tensors) - len(axes))
    key = package_key(model, names, tensors, axes)
    ranges = kv_ranges(model, cache)
    if len(ranges) == 1:
        return [(ranges[0], cache_dir / f"decode-{key}.pt2")], tensors
    return [((lo, hi), cache_dir / f"decode-{key}-kv{lo}-{hi}.pt2") for lo, hi in ranges], tensors


class PackageMissing(RuntimeError):
    """No package is built for this model yet (and building was not asked for); ``path`` is the first
    missing one."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


def failure_marker(package: Path) -> Path:
    """The file that records a failed build of ``package`` (its text says why), so that runs do not start
    the same failing build again; a new torch or localllm changes the package's name, and so tries again."""
    return package.with_suffix(".failed")


def load_runner(path: Path):  # type: ignore[no-untyped-def]
    """The package's runner (``.run(list of tensors) -> list of tensors``).

    Straight from torch's C++ loader when it takes the package: a few ms, where the Python
    ``aoti_load_package`` first imports inductor (about a second of every start).
    """
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except (AttributeError, RuntimeError):
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(path)).loader


class AotDecode:
    """The decode step of one model through its AOTInductor package (built on first use if missing).

    Called like :func:`runtime.generate.forward_one_token`. The tensors are looked up once; given
    another model, cache or attention kernel, the package for the new shapes is found or built on the
    next call (loaded runners are kept, so going back to an earlier cache costs no load). The
    positions no package takes (the first and the cache's last) run eagerly.
    """

    def __init__(self, model: Transformer, cache: SequenceCache, base: DecodeFn, cache_dir: Path,
                 inductor_dir: Path | None = None, build: bool = True) -> None:
        self.base = base
        self.build = build  # False: raise PackageMissing rather than build a missing package
        self.cache_dir = cache_dir
        self.inductor_dir = inductor_dir  # inductor's own cache while building
        self.build_s = 0.0  # time spent exporting and compiling (0 when the package was on disk)
        self._runners: dict[Path, object] = {}
        self._bind(model, cache)

    def _bind(self, model: Transformer, cache: SequenceCache) -> None:
        if cache.max_seq < MIN_STEP_CACHE:
            raise ValueError(f"the decode step needs a cache of {MIN_STEP_CACHE} positions or more")
        paths, tensors = package_paths(model, cache, self.cache_dir)
        missing = [(rng, path) for rng, path in paths if not path.exists()]
        if missing and not self.build:
            raise PackageMissing(f"no decode step is built for this model yet ({missing[0][1].name})", missing[0][1])
        for rng, path in missing:
            reason = compile_unavailable_reason(model.device)
            if reason:
                raise RuntimeError(reason)
            t0 = time.perf_counter()
            with inductor_cache_dir(self.inductor_dir):
                build_package(model, cache, self.base, path, rng)
            self.build_s += time.perf_counter() - t0
        self.path = paths[0][1]
        for _, path in paths:
            if path not in self._runners:
                self._runners[path] = load_runner(path)
        #: (first kv_len, last kv_len, runner) of each package.
        self._ranges = [(lo, hi, self._runners[path]) for (lo, hi), path in paths]
        self._model, self._cache = model, cache
        # The runner's argument list, made once: a step only sets its first three entries
        # (token, position, span) rather than building a list of ~360 tensors every token.
        self._args: list[torch.Tensor | None] = [None, None, None, *tensors]
        self._kernel = model.decode_kernel
        self._span = torch.empty(cache.max_seq, dtype=torch.int8, device=model.device)

    def __call__(self, model: Transformer, cache: SequenceCache, token: torch.Tensor, input_pos: torch.Tensor,
                 pos: int) -> torch.Tensor:
        if model is not self._model or cache is not self._cache or model.decode_kernel is not self._kernel:
            with torch.inference_mode(False):
                self._bind(model, cache)
        if not 1 <= pos < cache.max_seq - 1:  # kv_len 1 or max_seq: outside the exported ranges
            return self.base(model, cache, token, input_pos, pos)
        lo, hi, runner = self._ranges[0]  # the only one, but for ring caches
        if not lo <= pos + 1 <= hi:
            runner = next((r for lo, hi, r in self._ranges if lo <= pos + 1 <= hi), None)
            if runner is None:
                return self.base(model, cache, token, input_pos, pos)
        args = self._args
        args[0], args[1], args[2] = token, input_pos, self._span[: pos + 1]
        return runner.run(args)[0]
