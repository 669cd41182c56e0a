"""``torch.compile`` of the one-token decode step, with an eager fallback.

At batch 1 a decode step of a small model is mostly per-op overhead (hundreds of tiny elementwise
ops around the matmuls); inductor fuses them into a few generated kernels. Compilation costs tens of
seconds the first time and is cached on disk (inductor's FX graph cache) for later processes.
Prefill stays eager: it is a few large matmuls, already compute bound.
"""

from __future__ import annotations

import getpass
import os
import tempfile
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm import native
from localllm.runtime.model import Transformer

DecodeFn = Callable[[Transformer, torch.Tensor, torch.Tensor, int], torch.Tensor]


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


def _static_step(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return model(token, input_pos, static=True)[:, -1]


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


def compiled_decode(base: DecodeFn, device: torch.device, cache_dir: Path | None = None,
                    cpp_wrapper: bool = True, aot: bool = True) -> DecodeFn:
    """``base`` compiled with inductor and run under inference mode; eager ``base`` (with a warning
    saying why) when compilation is unavailable or fails.

    On the CPU the step is compiled ahead of time with AOTInductor (:mod:`runtime.aot`; its packages
    are kept under ``cache_dir/aot``) unless ``aot=False``; if that fails, ``torch.compile`` is tried,
    then eager. The returned function compiles lazily on its first call (the model's caches must be
    set up by then). ``cpp_wrapper=False`` keeps inductor's Python wrapper for the ``torch.compile``
    path on the CPU (for measuring what it costs).
    """
    aot = aot and device.type == "cpu"
    reason = compile_unavailable_reason(device, tracing=not aot)  # the AOT step checks when it builds
    if reason:
        warnings.warn(f"running eagerly: {reason}")
        return torch.inference_mode()(base)
    if cache_dir is not None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    aot_dir = None
    if aot:
        aot_dir = (cache_dir or Path(tempfile.gettempdir()) / f"localllm-{getpass.getuser()}") / "aot"
    return CompiledStep(base, lambda: _torch_compiled(base, device, cpp_wrapper), aot_dir)


def _torch_compiled(base: DecodeFn, device: torch.device, cpp_wrapper: bool) -> DecodeFn:
    """``base`` through ``torch.compile`` (compiled on its first call). Made only when needed: creating
    it imports much of dynamo and inductor, over a second of a start the AOT path does not spend."""
    reason = compile_unavailable_reason(device)
    if reason:
        raise RuntimeError(reason)
    import torch._inductor.config as inductor_config

    # Round every intermediate to its dtype as eager does (inductor otherwise keeps fused bf16 math
    # in fp32). Logits then match eager's bit for bit for most steps; a fused reduction (an RMSNorm's
    # mean) summed in another order can still move a bf16 value by one ulp now and then, so greedy
    # output only differs where the top two logits are (nearly) tied.
    inductor_config.emulate_precision_casts = True
    if device.type == "cuda":
        # CUDA graphs replay one recorded launch sequence per shape: attend over the whole cache
        # with a mask (static shapes; the position only as a tensor) so one graph serves every step.
        graph = torch.compile(_own_code(_static_step), mode="reduce-overhead", dynamic=False, fullgraph=True)

        def compiled(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, pos: int) -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's output may be overwritten
            return graph(model, token, input_pos)

        return compiled
    # Positions grow every step: compile for symbolic lengths once rather than once per length.
    # cpp_wrapper: the generated graph calls its kernels from C++ rather than from a Python
    # wrapper; at batch 1 (some 300 kernel calls a step) that saves ~5% of a SmolLM2 step
    # (scripts/compiled_vs_eager.py measures it).
    return torch.compile(_own_code(base), dynamic=True, fullgraph=False,
                         options={**_GUARD_OPTIONS, "cpp_wrapper": cpp_wrapper})


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


class CompiledStep:
    """A decode step that runs the best way available: the AOTInductor package (CPU, when ``aot_dir``
    is given), else the ``torch.compile`` function (made by ``make_compiled`` when first needed), else
    eager ``base``; each failure says so in a warning and moves down one level. Called like
    :func:`runtime.generate.forward_one_token`."""

    def __init__(self, base: DecodeFn, make_compiled: Callable[[], DecodeFn], aot_dir: Path | None) -> None:
        self.base, self.aot_dir = base, aot_dir
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
    def kind(self) -> str:
        """"aot", "torch.compile" or "eager" (what the next call runs; "aot" before the first call)."""
        if self.fn is self.base:
            return "eager"
        return "torch.compile" if self.fn is not None and self.fn is self._compiled else "aot"

    def __call__(self, model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, pos: int) -> torch.Tensor:
        if self.fn is None:
            from localllm.runtime.aot import AotDecode

            try:  # outside inference mode: export traces the model
                self.fn = AotDecode(model, self.base, self.aot_dir)  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - an export/AOT failure must degrade, not crash
                warnings.warn(f"AOTInductor failed ({_first_line(e)}); using torch.compile")
                self.fn = self.compiled
        try:
            with torch.inference_mode():
                return self.fn(model, token, input_pos, pos)
        except Exception as e:  # noqa: BLE001 - any compiler failure must degrade to eager, not crash
            if self.fn is self.base:
                raise
            if self.fn is not self._compiled:  # the AOT step failed at run time
                warnings.warn(f"AOTInductor step failed ({_first_line(e)}); using torch.compile")
                self.fn = self.compiled
                return self(model, token, input_pos, pos)
            warnings.warn(f"torch.compile failed ({_first_line(e)}); running eagerly")
            self.fn = self.base
            with torch.inference_mode():
                return self.base(model, token, input_pos, pos)


@dataclass
class Drift:
    """How a decode step's logits differ from the eager step's when both are fed the same tokens."""

    steps: int  # logits compared: the prefill's, then one per fed token
    identical: int  # leading steps equal bit for bit
    max_abs: float  # worst |logit difference| over all steps
    mean_abs: float  # mean over steps of the mean |logit difference|
    top1: int  # steps whose argmax agree


def forced_logits(model: Transformer, prompt: list[int], fed: list[int], step: DecodeFn) -> list[torch.Tensor]:
    """fp32 logits (1, vocab) of an eager prefill of ``prompt``, then of ``step`` fed ``fed`` one token
    at a time (teacher forcing: the step's own choices do not steer what comes next)."""
    from localllm.runtime.generate import prefill

    out = [prefill(model, torch.tensor([prompt], device=model.device)).float()]
    for i, t in enumerate(fed):
        pos = len(prompt) + i
        token = torch.tensor([[t]], device=model.device)
        out.append(step(model, token, torch.tensor([pos], device=model.device), pos).float())
    return out


def decode_drift(model: Transformer, prompt: list[int], fed: list[int], step: DecodeFn) -> Drift:
    """Feed ``fed`` after ``prompt`` through eager decode and through ``step`` (:func:`forced_logits`)
    and compare the logits."""
    from localllm.runtime.generate import decode_one_token

    want, got = forced_logits(model, prompt, fed, decode_one_token), forced_logits(model, prompt, fed, step)
    diffs = [(w - g).abs() for w, g in zip(want, got)]
    same = [bool(d.max() == 0) for d in diffs]
    return Drift(
        steps=len(want),
        identical=same.index(False) if False in same else len(same),
        max_abs=max(d.max().item() for d in diffs),
        mean_abs=sum(d.mean().item() for d in diffs) / len(diffs),
        top1=sum(int(w.argmax()) == int(g.argmax()) for w, g in zip(want, got)),
    )
