"""Triton, where it is installed, for localllm's CUDA kernels (``runtime.cuda_attention``,
``quant.gguf_triton``): a base leaf both layers import.

torch's CUDA builds install Triton; localllm does not depend on it, and only CUDA engines (and the
tests, through the dev extra) import the modules that use it. Without a GPU, a process started with
``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors in Triton's interpreter: the kernels'
checks on any machine (``tests/conftest.py`` turns it on where there is no GPU).
"""

from __future__ import annotations

import os
from typing import Any

try:
    import triton
except ImportError:
    triton = None


def available() -> bool:
    """Whether Triton is here."""
    return triton is not None


def jit(fn: Any) -> Any:
    """``triton.jit`` where Triton is installed (the kernels are never launched without it). Kernels are
    decorated at module level, where Triton before 3.4 looks their names (``tl``) up."""
    return triton.jit(fn) if triton is not None else fn


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` when it was first
    imported: Triton reads it then, for its own library functions too)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(x: Any, what: str) -> None:
    """Refuse CPU tensors unless the interpreter is on (a compiled Triton kernel needs CUDA ones)."""
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"the Triton {what} kernel runs on CUDA tensors, or on CPU tensors in a process "
                           "started with TRITON_INTERPRET=1")
