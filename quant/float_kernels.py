"""localllm's CPU kernel for 16-bit float weights (``csrc/float_mm.cpp``): bf16 and fp16 weights as
stored, widened in registers as they stream in, for the few activation rows of a decode step; torch's
GEMM for more rows (a prefill).

A float model on the CPU holds its 16-bit linear layers as :class:`quant.linear.QuantLinear` of the
``bf16`` or ``fp16`` scheme (one path with the quantized layers: a kernel chosen and checked against
the reference when the layer is prepared), whose canonical tensor ``weight`` is the kernel's layout
as it is."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from localllm.quant.formats import FLOAT_SCHEMES
from localllm.quant.kernel_base import Kernel
from localllm.quant.native_ops import native_cpu_unsupported

#: ``localllm::float_isa()``'s paths, narrowest first (``csrc/float_mm.cpp``'s ``Isa``).
FLOAT_PORTABLE, FLOAT_AVX2, FLOAT_AVX512 = range(3)
#: Weights a prefill's GEMM widens at a time where the activations' dtype is not the weights' (an fp16
#: layer under bf16 activations): 1M (4 MB of fp32; 16 MB slices raised a SmolLM2 run's peak by 10%).
PANEL_ELEMENTS = 1 << 20


@functools.cache
def torch_bf16_gemm() -> bool:
    """Whether torch multiplies bf16 matrices through oneDNN on this CPU (AVX-512 and up); elsewhere
    (AVX2) its bf16 GEMM is a slow generic loop, several times slower than widening to fp32."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def panel_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, in) @ weight (out, in)^T through torch's GEMM, in x's dtype: at once where the dtypes agree
    (and torch has a fast GEMM for them), else in fp32 a slice of output rows at a time (so fp16 weights
    are never rounded to bf16, and a vocabulary head's fp32 copy never exists whole)."""
    if weight.dtype == x.dtype and (x.dtype != torch.bfloat16 or torch_bf16_gemm()):
        return F.linear(x, weight)
    out, inp = weight.shape
    rows = max(1, PANEL_ELEMENTS // inp)
    xf = x.float()
    y = x.new_empty((x.shape[0], out))
    for a in range(0, out, rows):
        y[:, a : a + rows] = F.linear(xf, weight[a : a + rows].float())
    return y


class FloatRowsCPU(Kernel):
    """bf16 weights (``bf16-rows-cpu``) or fp16 ones (``fp16-rows-cpu``) by fp32, bf16 or fp16
    activations with fp32 sums, up to :data:`GEMV_ROWS` activation rows through ``localllm::float_mm``
    (AVX2 + F16C, or AVX-512, chosen at run time), more through torch's GEMM (:func:`panel_linear`)."""

    name = "float-rows-cpu"
    device_type = "cpu"
    #: Activation rows up to which the row kernel runs (in passes of 4); above, torch's GEMM.
    GEMV_ROWS = 8

    @classmethod
    def unsupported(cls, layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def, override]
        if layer.scheme.name != cls.scheme:
            return f"runs {cls.scheme} weights only"
        return native_cpu_unsupported(target, act_dtype)

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        w = layer.weight
        return {"weight": w if w.is_contiguous() else w.contiguous()}

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        if x.shape[0] <= FloatRowsCPU.GEMV_ROWS:
            return torch.ops.localllm.float_mm(x, layer.weight)
        return panel_linear(x, layer.weight)


class Bf16RowsCPU(FloatRowsCPU):
    name = "bf16-rows-cpu"
    scheme = "bf16"


class Fp16RowsCPU(FloatRowsCPU):
    name = "fp16-rows-cpu"
    scheme = "fp16"


#: The float schemes these kernels run, and their weights' dtype.
ROW_SCHEMES = {k.scheme: FLOAT_SCHEMES[k.scheme] for k in (Bf16RowsCPU, Fp16RowsCPU)}
