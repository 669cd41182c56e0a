"""``torch.compile`` of the one-token decode step, with an eager fallback.

At batch 1 a decode step of a small model is mostly per-op overhead (hundreds of tiny elementwise
ops around the matmuls); inductor fuses them into a few generated kernels. Compilation costs tens of
seconds the first time and is cached on disk (inductor's FX graph cache) for later processes.
Prefill stays eager: it is a few large matmuls, already compute bound.

Nothing here changes the process's settings: inductor's options are passed per compiled function,
and its cache folder (an environment variable inductor reads) is set only while compiling.
"""

from __future__ import annotations

import functools
import getpass
import os
import tempfile
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm import native
from localllm.runtime.cache import SequenceCache
from localllm.runtime.model import Transformer

#: ``step(model, cache, token (B, 1), input_pos (1,), pos) -> logits (B, vocab)``, as
#: :func:`runtime.generate.forward_one_token`.
DecodeFn = Callable[[Transformer, SequenceCache, torch.Tensor, torch.Tensor, int], torch.Tensor]

#: Inductor options of every compiled step. Round every intermediate to its dtype as eager does
#: (inductor otherwise keeps fused bf16 math in fp32). Logits then match eager's bit for bit for most
#: steps; a fused reduction (an RMSNorm's mean) summed in another order can still move a bf16 value by
#: one ulp now and then, so greedy output only differs where the top two logits are (nearly) tied.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


@functools.cache
def _inductor_default_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


@contextmanager
def inductor_cache_dir(folder: Path | None) -> Iterator[None]:
    """Inductor's cache folder is ``folder`` within the block (unless the user chose one with
    ``TORCHINDUCTOR_CACHE_DIR``); the environment is as it was afterwards. Inductor reads the folder
    from the environment only, and only when it compiles. (It also writes its default there whenever
    it looks the folder up, as importing transformers does: that value is not a user's choice.)"""
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


def compile_unavailable_reason(device: torch.device, tracing: bool = True) -> str | None:
    """Why compilation cannot work here, or None.

    ``tracing=False`` leaves out the check that needs ``torch._dynamo`` imported (over a second of a
    start): loading an AOT package built earlier traces nothing.
    """
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if device.type == "cpu" and native.compiler() is None:
        return "no C++ compiler (g++) for inductor's CPU code"
    if not tracing:
        return None
    try:
        import torch._dynamo as dynamo

        if not dynamo.is_dynamo_supported():
            return "torch.compile does not support this Python"
    except ImportError:
        return "torch._dynamo is missing"
    return None


# Dynamo re-checks every module attribute of the model before each call (about 1 ms a token for a
# 30-layer model on a CPU). The model's structure and parameters do not change once it is loaded, so
# those guards are skipped; tensor shapes and dtypes are still checked.
_GUARD_OPTIONS = (
    {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe") else {}
)


def _static_step(model: Transformer, cache: SequenceCache, token: torch.Tensor, input_pos: torch.Tensor
                 ) -> torch.Tensor:
    return model(token, cache, input_pos, static=True)[:, -1]


def _own_code(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object.

    Dynamo keeps compiled graphs on the code object, and with the module guards skipped (above) a
    graph compiled for one model would be taken for another of different structure (a float head
    then an int8 one: "KeyError: 'weight'"). A code object per compiled step keeps each model's
    graphs apart, and each step's recompilations within its own limit.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_compiled")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def ready_decode(base: DecodeFn, device: torch.device, cache_dir: Path) -> "CompiledStep | None":
    """The decode step from an AOTInductor package already built under ``cache_dir/aot`` (by set-up,
    ``pull``, a background build or an earlier ``--compile``), else eager ``base``: nothing is compiled
    now. None where no package could serve (not the CPU). The step looks its package up on its first
    call, for the cache it is given; :attr:`CompiledStep.missing` then says whether one was there."""
    if device.type != "cpu":
        return None
    return CompiledStep(base, lambda: base, cache_dir / "aot", cache_dir, build=False)


def compiled_decode(base: DecodeFn, device: torch.device, cache_dir: Path | None = None,
                    cpp_wrapper: bool = True, aot: bool = True) -> DecodeFn:
    """``base`` compiled with inductor and run under inference mode; eager ``base`` (with a warning
    saying why) when compilation is unavailable or fails.

    On the CPU the step is compiled ahead of time with AOTInductor (:mod:`runtime.aot`; its packages
    are kept under ``cache_dir/aot``) unless ``aot=False``; if that fails, ``torch.compile`` is tried,
    then eager. The returned function compiles lazily on its first call, for the shapes of the cache
    it is given (a step serves one cache best: another one means finding or building its package).
    ``cpp_wrapper=False`` keeps inductor's Python wrapper for the ``torch.compile`` path on the CPU
    (for measuring what it costs). ``cache_dir`` also holds inductor's own cache while it compiles.
    """
    aot = aot and device.type == "cpu"
    reason = compile_unavailable_reason(device, tracing=not aot)  # the AOT step checks when it builds
    if reason:
        warnings.warn(f"running eagerly: {reason}")
        return torch.inference_mode()(base)
    aot_dir = None
    if aot:
        aot_dir = (cache_dir or Path(tempfile.gettempdir()) / f"localllm-{getpass.getuser()}") / "aot"
    return CompiledStep(base, lambda: _torch_compiled(base, device, cpp_wrapper), aot_dir, cache_dir)


def _torch_compiled(base: DecodeFn, device: torch.device, cpp_wrapper: bool) -> DecodeFn:
    """``base`` through ``torch.compile`` (compiled on its first call). Made only when needed: creating
    it imports much of dynamo and inductor, over a second of a start the AOT path does not spend."""
    reason = compile_unavailable_reason(device)
    if reason:
        raise RuntimeError(reason)
    if device.type == "cuda":
        from torch._inductor import list_mode_options

        # CUDA graphs replay one recorded launch sequence per shape: attend over the whole cache
        # with a mask (static shapes; the position only as a tensor) so one graph serves every step.
        # (mode="reduce-overhead" as options, which torch.compile cannot take together with a mode.)
        graph = torch.compile(_own_code(_static_step), dynamic=False, fullgraph=True,
                              options={**list_mode_options("reduce-overhead", False), **INDUCTOR_OPTIONS})
        marked: weakref.WeakSet[SequenceCache] = weakref.WeakSet()

        def compiled(model: Transformer, cache: SequenceCache, token: torch.Tensor, input_pos: torch.Tensor,
                     pos: int) -> torch.Tensor:
            if cache not in marked:
                # The cache is written in place and read at fixed addresses by the graph: inputs that
                # are not marked would be copied into the graph's own buffers at every replay.
                for t in cache.tensors():
                    torch._dynamo.mark_static_address(t)
                marked.add(cache)
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's output may be overwritten
            return graph(model, cache, token, input_pos)

        return compiled
    # Positions grow every step: compile for symbolic lengths once rather than once per length.
    # cpp_wrapper: the generated graph calls its kernels from C++ rather than from a Python
    # wrapper; at batch 1 (some 300 kernel calls a step) that saves ~5% of a SmolLM2 step
    # (scripts/compiled_vs_eager.py measures it).
    return torch.compile(_own_code(base), dynamic=True, fullgraph=False,
                         options={**_GUARD_OPTIONS, **INDUCTOR_OPTIONS, "cpp_wrapper": cpp_wrapper})


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


class CompiledStep:
    """A decode step that runs the best way available: the AOTInductor package (CPU, when ``aot_dir``
    is given), else the ``torch.compile`` function (made by ``make_compiled`` when first needed), else
    eager ``base``; each failure says so in a warning and moves down one level. Called like
    :func:`runtime.generate.forward_one_token`.

    ``build=False``: a package that is not on disk is not built; the step runs eagerly and
    :attr:`missing` is set (no warning: that is the normal first run of a model)."""

    def __init__(self, base: DecodeFn, make_compiled: Callable[[], DecodeFn], aot_dir: Path | None,
                 inductor_dir: Path | None = None, build: bool = True) -> None:
        self.base, self.aot_dir, self.inductor_dir = base, aot_dir, inductor_dir
        self.build = build
        #: No package was found and building was not asked for.
        self.missing = False
        #: ... and an earlier build of it failed (:func:`runtime.aot.failure_marker`).
        self.failed_before = False
        self._make_compiled = make_compiled
        self._compiled: DecodeFn | None = None
        #: What runs now; None until the first call builds the AOT step.
        self.fn: DecodeFn | None = None if aot_dir is not None else self.compiled

    @property
    def compiled(self) -> DecodeFn:
        if self._compiled is None:
            self._compiled = self._make_compiled()
        return self._compiled

    @property
    def _next_level(self) -> str:
        return "using torch.compile" if self.build else "running eagerly"

    @property
    def kind(self) -> str:
        """"aot", "torch.compile" or "eager" (what the next call runs; "aot" before the first call)."""
        if self.fn is self.base:
            return "eager"
        return "torch.compile" if self.fn is not None and self.fn is self._compiled else "aot"

    def __call__(self, model: Transformer, cache: SequenceCache, token: torch.Tensor, input_pos: torch.Tensor,
                 pos: int) -> torch.Tensor:
        if self.fn is None:
            from localllm.runtime.aot import AotDecode, PackageMissing

            try:  # outside inference mode: export traces the model
                self.fn = AotDecode(model, cache, self.base, self.aot_dir,  # type: ignore[arg-type]
                                    self.inductor_dir, build=self.build)
            except PackageMissing as e:
                from localllm.runtime.aot import failure_marker

                self.fn, self.missing = self.base, True
                self.failed_before = failure_marker(e.path).exists()
            except Exception as e:  # noqa: BLE001 - an export/AOT failure must degrade, not crash
                warnings.warn(f"AOTInductor failed ({_first_line(e)}); {self._next_level}")
                self.fn = self.compiled
        try:
            with torch.inference_mode():
                if self.fn is self._compiled:  # any call may (re)compile
                    with inductor_cache_dir(self.inductor_dir):
                        return self.fn(model, cache, token, input_pos, pos)
                return self.fn(model, cache, token, input_pos, pos)
        except Exception as e:  # noqa: BLE001 - any compiler failure must degrade to eager, not crash
            if self.fn is self.base:
                raise
            if self.fn is not self._compiled:  # the AOT step failed at run time
                warnings.warn(f"AOTInductor step failed ({_first_line(e)}); {self._next_level}")
                self.fn = self.compiled
                return self(model, cache, token, input_pos, pos)
            warnings.warn(f"torch.compile failed ({_first_line(e)}); running eagerly")
            self.fn = self.base
            with torch.inference_mode():
                return self.base(model, cache, token, input_pos, pos)


@dataclass
class Drift:
    """How a decode step's logits differ from the eager step's when both are fed the same tokens."""

    steps: int  # logits compared: the prefill's, then one per fed token
    identical: int  # leading steps equal bit for bit
    max_abs: float  # worst |logit difference| over all steps
    mean_abs: float  # mean over steps of the mean |logit difference|
    top1: int  # steps whose argmax agree


def forced_logits(model: Transformer, cache: SequenceCache, prompt: list[int], fed: list[int], step: DecodeFn
                  ) -> list[torch.Tensor]:
    """fp32 logits (1, vocab) of an eager prefill of ``prompt`` into ``cache``, then of ``step`` fed
    ``fed`` one token at a time (teacher forcing: the step's own choices do not steer what comes next)."""
    from localllm.runtime.generate import prefill

    out = [prefill(model, cache, torch.tensor([prompt], device=model.device)).float()]
    for i, t in enumerate(fed):
        pos = len(prompt) + i
        token = torch.tensor([[t]], device=model.device)
        out.append(step(model, cache, token, torch.tensor([pos], device=model.device), pos).float())
    return out


def decode_drift(model: Transformer, cache: SequenceCache, prompt: list[int], fed: list[int], step: DecodeFn
                 ) -> Drift:
    """Feed ``fed`` after ``prompt`` through eager decode and through ``step`` (:func:`forced_logits`),
    one after the other in ``cache``, and compare the logits."""
    from localllm.runtime.generate import decode_one_token

    want = forced_logits(model, cache, prompt, fed, decode_one_token)
    got = forced_logits(model, cache, prompt, fed, step)
    diffs = [(w - g).abs() for w, g in zip(want, got)]
    same = [bool(d.max() == 0) for d in diffs]
    return Drift(
        steps=len(want),
        identical=same.index(False) if False in same else len(same),
        max_abs=max(d.max().item() for d in diffs),
        mean_abs=sum(d.mean().item() for d in diffs) / len(diffs),
        top1=sum(int(w.argmax()) == int(g.argmax()) for w, g in zip(want, got)),
    )
