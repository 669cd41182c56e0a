"""localllm's CPU kernels for 16-bit float weights: bf16 and fp16 weights as stored, widened in
registers as they stream in: ``csrc/float_mm.cpp`` for the few activation rows of a decode step, the
fp32 panel GEMM (``csrc/panel_gemm.h``, through ``gguf_gemm``: an fp16 or bf16 weight's rows are
GGUF F16 and BF16 rows byte for byte) for more rows (a prefill).

A float model on the CPU holds its 16-bit linear layers as :class:`quant.linear.QuantLinear` of the
``bf16`` or ``fp16`` scheme (one path with the quantized layers: a kernel chosen and checked against
the reference when the layer is prepared), whose canonical tensor ``weight`` is the kernel's layout
as it is."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from localllm.quant.formats import FLOAT_SCHEMES, GGUF_BLOCKS
from localllm.quant.kernel_base import Kernel
from localllm.quant.native_ops import native_cpu_unsupported

#: ``localllm::float_isa()``'s paths, narrowest first (``csrc/float_mm.cpp``'s ``Isa``).
FLOAT_PORTABLE, FLOAT_AVX2, FLOAT_AVX512 = range(3)
#: The GGML type id whose rows a 16-bit weight's rows are (``gguf_gemm``'s ``type``).
GGML_TYPE = {torch.float16: GGUF_BLOCKS["F16"][0], torch.bfloat16: GGUF_BLOCKS["BF16"][0]}


@functools.cache
def torch_bf16_gemm() -> bool:
    """Whether torch multiplies bf16 matrices through oneDNN on this CPU (AVX-512 and up: AMX and
    AVX-512-BF16 multiply bf16 directly); elsewhere (AVX2) its bf16 GEMM is a slow generic loop."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def many_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, in) @ weight (out, in)^T for many rows, in x's dtype: torch's GEMM where x and the weight
    are bf16 and torch multiplies bf16 natively, else fp32 panels of the weight (16 rows by 256
    columns widened at a time, in L1, each multiplied by every activation row): fp16 weights are never
    rounded to bf16, and no widened copy of a weight is ever made."""
    if weight.dtype == x.dtype == torch.bfloat16 and torch_bf16_gemm():
        return F.linear(x, weight)
    return torch.ops.localllm.gguf_gemm(x, weight.view(torch.uint8), GGML_TYPE[weight.dtype], weight.shape[1])


class FloatRowsCPU(Kernel):
    """bf16 weights (``bf16-rows-cpu``) or fp16 ones (``fp16-rows-cpu``) by fp32, bf16 or fp16
    activations with fp32 sums, up to :data:`GEMV_ROWS` activation rows through ``localllm::float_mm``
    (AVX2 + F16C, or AVX-512, chosen at run time; each weight read once per 4 rows), more through
    :func:`many_rows`."""

    name = "float-rows-cpu"
    device_type = "cpu"
    #: Activation rows up to which the row kernel runs (in passes of 4); above, the panel GEMM, whose
    #: widening of every weight costs more than the row kernel's passes up to here.
    GEMV_ROWS = 16

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
        return many_rows(x, layer.weight)


class Bf16RowsCPU(FloatRowsCPU):
    name = "bf16-rows-cpu"
    scheme = "bf16"


class Fp16RowsCPU(FloatRowsCPU):
    name = "fp16-rows-cpu"
    scheme = "fp16"


#: The float schemes these kernels run, and their weights' dtype.
ROW_SCHEMES = {k.scheme: FLOAT_SCHEMES[k.scheme] for k in (Bf16RowsCPU, Fp16RowsCPU)}
