"""LoadSpec: how a model is to be loaded, the one value every load path passes.

``run``, ``compile``, ``serve`` and ``bench`` make one from what they were told; the memory plan plans
for it (:func:`loaders.memory_plan.check_memory`), :func:`loaders.load.load_model` loads by it, and a
background build of the compiled decode step loads the model the same way from it, since a package is
keyed by the loaded model's modules, kernels and tensor shapes and by the KV pool's type.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from localllm.runtime.cache import DEFAULT_KV_DTYPE
from localllm.loaders.calibrate import DEFAULT_CALIBRATION

if TYPE_CHECKING:
    from localllm.quant.target import Target


@dataclass(frozen=True)
class LoadSpec:
    """A model reference and the options it is loaded with."""

    #: What the user typed: a stored ``NAME[:SCHEME]``, a model folder, a ``.gguf`` file, 'smollm2'.
    ref: str
    #: ``auto``, ``cpu``, ``cuda``, ``cuda:N``; or a :class:`quant.target.Target` a caller decided on.
    device: str | Target = "auto"
    #: The activations' dtype: ``auto``, ``fp32``, ``fp16``, ``bf16``.
    dtype: str = "auto"
    #: The weight scheme (None: the checkpoint's own) and its group size (None: the scheme's default).
    quant: str | None = None
    group_size: int | None = None
    #: The output head's scheme (None: the checkpoint's choice; False: 16-bit).
    quantize_head: str | bool | None = None
    #: A matmul kernel forced by name (None: the fastest that works).
    kernel: str | None = None
    #: The KV pool's type (:data:`runtime.cache.KV_DTYPES`).
    kv_dtype: str = DEFAULT_KV_DTYPE
    #: int4 from float weights: ``awq`` (data-aware, :mod:`loaders.calibrate`) or ``none`` (round to nearest).
    calibration: str = DEFAULT_CALIBRATION
    #: On a GPU, a MoE model's experts in CPU RAM (:mod:`loaders.placement`): all of them (``--cpu-moe``),
    #: the first N layers' (``--n-cpu-moe N``), or as the memory plan decides (neither given).
    cpu_moe: bool = False
    n_cpu_moe: int | None = None
    #: On a GPU, the last N transformer blocks there and the first ones in CPU RAM (``--gpu-layers N``,
    #: llama.cpp's ``-ngl``), or as the memory plan decides (None: all when the model fits).
    gpu_layers: int | None = None

    @classmethod
    def of(cls, spec: LoadSpec | str, **options: Any) -> LoadSpec:
        """``spec`` with ``options`` (LoadSpec's fields by name) set; a reference alone is a LoadSpec of
        it with these options."""
        if isinstance(spec, LoadSpec):
            return replace(spec, **options) if options else spec
        return cls(spec, **options)
