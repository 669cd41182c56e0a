"""Matmul kernels for quantized weights, and the choice among them per device.

Each kernel turns a :class:`quant.linear.QuantLinear`'s canonical tensors into the layout it wants
(``prepare``) and multiplies activations with them (``matmul``) without building the full-precision
weight of the model. The pure-torch reference (dequantize a slice of one layer's rows at a time,
multiply, drop it) runs everywhere; the fast kernels are checked against it when a layer is prepared
and dropped with a warning if they disagree, so a kernel that misbehaves on some GPU or build
degrades to slow, never to wrong. Each kernel says why it cannot run a layer
(:meth:`Kernel.unsupported`), which is what the one-line warning about a slow fallback names.

=====================  ======  ============================================  =====================
kernel                 scheme  where                                         activations
=====================  ======  ============================================  =====================
int4-tinygemm-cpu      int4    CPU (``torch._weight_int4pack_mm_for_cpu``)   bf16
int4-triton-cuda       int4    CUDA, Triton (``quant.int_triton``)           bf16 / fp16 / fp32
int4-tinygemm-cuda     int4    CUDA sm80+ (``torch._weight_int4pack_mm``)    bf16
int8-triton-cuda       int8    CUDA, Triton (``quant.int_triton``)           bf16 / fp16 / fp32
int8-weight-only       int8    per-channel (``torch._weight_int8pack_mm``)   bf16 / fp16 / fp32
int8-group-cpu         int8    grouped, CPU (``localllm::int8_group_mm``)    bf16 / fp16 / fp32
int4z-group-cpu        int4z   CPU, as int4-group-cpu (-z, times s in fp32)  bf16 / fp16 / fp32
int4z-triton-cuda      int4z   CUDA, as int4-triton-cuda (fp32 offsets)      bf16 / fp16 / fp32
int4-q8-cpu            int4    CPU, AVX2 / VNNI, opt-in (``int4_q8_mm``)     int8 per 32 (from fp32)
int8-q8-cpu            int8    CPU, AVX2 / VNNI, opt-in (``int8_q8_mm``)     int8 per 32 (from fp32)
gguf-q8-cpu            gguf    CPU, opt-in: Q5_0, Q4_K, Q6_K as the above    int8 per 32 (from fp32)
gguf-blocks-cpu        gguf    CPU (``localllm::gguf_mm``): a GGUF's blocks  bf16 / fp16 / fp32
gguf-blocks-cuda       gguf    CUDA, Triton (``quant.gguf_triton``)          bf16 / fp16 / fp32
nf4-bitsandbytes       nf4     bitsandbytes ``matmul_4bit`` (CPU and CUDA)   bf16 / fp16 / fp32
bf16-rows-cpu          bf16    CPU (``localllm::float_mm``; panels above 16) fp32 / bf16 / fp16
fp16-rows-cpu          fp16    CPU, F16C / AVX-512 (as bf16-rows-cpu)        fp32 / bf16 / fp16
reference              all     dequantize one layer, ``F.linear``            any
=====================  ======  ============================================  =====================

The kernels live in modules by what runs them: :mod:`quant.kernel_base` (the interface, and the
layout a layer records), :mod:`quant.reference`, :mod:`quant.aten_kernels` (torch's own ops),
:mod:`quant.cuda_kernels` (Triton), :mod:`quant.tile_kernels` and :mod:`quant.q8_kernels`
(localllm's C++ on tiles of codes), :mod:`quant.gguf_cpu` (a GGUF's blocks, and their repacked
tiles), :mod:`quant.bnb_kernel`, :mod:`quant.float_kernels` (16-bit float weights);
:mod:`quant.native_ops` holds the C++ library and its ops' fakes.
This module is the registry: the order of preference, the choice for a layer, and the check
against the reference. The kernels' names are importable from here as well.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from localllm.quant.aten_kernels import Int4TinygemmCPU, Int4TinygemmCUDA, Int8WeightOnly
from localllm.quant.bnb_kernel import Nf4Bitsandbytes
from localllm.quant.cuda_kernels import GGUFBlocksCUDA, Int4TritonCUDA, Int4ZerosTritonCUDA, Int8TritonCUDA
from localllm.quant.float_kernels import Bf16RowsCPU, Fp16RowsCPU
from localllm.quant.gguf_cpu import BLOCKS_LAYOUT, INT4K_TILES, INT5_TILES, INT6K_TILES, REPACKED, GGUFBlocksCPU
from localllm.quant.kernel_base import Kernel, Layout
from localllm.quant.native_ops import LIBRARY, OPS, gguf_dequantize
from localllm.quant.q8_kernels import (Q8_AVX2, Q8_AVX512_VNNI, Q8_AVX_VNNI, Q8_PORTABLE, GGUFQ8CPU, Int4Q8CPU,
                                       Int8Q8CPU)
from localllm.quant.reference import REFERENCE_ELEMENTS, Reference, reference_linear
from localllm.quant.target import Target
from localllm.quant.tile_kernels import Int4GroupCPU, Int4ZerosCPU, Int8GroupCPU

if TYPE_CHECKING:
    from localllm.quant.linear import QuantLinear

__all__ = [
    "BLOCKS_LAYOUT", "BY_NAME", "Bf16RowsCPU", "Fp16RowsCPU", "GGUFBlocksCPU", "GGUFBlocksCUDA", "GGUFQ8CPU",
    "INT4K_TILES", "INT5_TILES",
    "INT6K_TILES", "Int4GroupCPU", "Int4Q8CPU", "Int4TinygemmCPU", "Int4TinygemmCUDA", "Int4TritonCUDA",
    "Int4ZerosCPU", "Int4ZerosTritonCUDA", "Int8GroupCPU", "Int8Q8CPU", "Int8TritonCUDA", "Int8WeightOnly", "KERNELS", "Kernel", "LIBRARY", "Layout",
    "Nf4Bitsandbytes", "OPS", "Q8_AVX2", "Q8_AVX512_VNNI", "Q8_AVX_VNNI", "Q8_PORTABLE", "REFERENCE_ELEMENTS",
    "REFERENCE_ROWS", "REPACKED", "Reference", "WARNED", "agrees_with_reference", "candidates", "gguf_dequantize",
    "reference_linear", "warn_once", "why_not_fast",
]

#: Output rows the check against the reference samples in a larger layer.
REFERENCE_ROWS = 1024

#: In order of preference; the first that supports a layer (and passes its check) is used.
KERNELS: tuple[type[Kernel], ...] = (
    Int4TritonCUDA, Int4TinygemmCUDA, Int4TinygemmCPU, Int4GroupCPU, Int4ZerosCPU, Int4ZerosTritonCUDA, Int8GroupCPU, Int8TritonCUDA, Int8WeightOnly,
    GGUFBlocksCPU, GGUFBlocksCUDA,
    Nf4Bitsandbytes, Bf16RowsCPU, Fp16RowsCPU, Int4Q8CPU, Int8Q8CPU, GGUFQ8CPU, Reference
)
BY_NAME = {k.name: k for k in KERNELS}


def candidates(layer: "QuantLinear", target: "Target | torch.device", act_dtype: torch.dtype) -> list[type[Kernel]]:
    """The kernels that can run ``layer`` on ``target`` (a :class:`quant.target.Target`; a bare device
    is resolved with :meth:`Target.of`), in order of preference."""
    target = Target.of(target)
    return [k for k in KERNELS if not k.opt_in and k.unsupported(layer, target, act_dtype) is None]


def why_not_fast(layer: "QuantLinear", target: "Target | torch.device", act_dtype: torch.dtype) -> list[str]:
    """Why each fast kernel of the layer's scheme cannot run it here ("int4-tinygemm-cpu needs
    bfloat16 activations, not float32"): what a warning about the slow reference names. Kernels made
    for another device are named only when none is made for this one (grouped int8 on CUDA)."""
    target = Target.of(target)
    fast = [k for k in KERNELS if k is not Reference and not k.opt_in and k.scheme == layer.scheme.name]
    if any(k.device_type == target.type for k in fast):
        fast = [k for k in fast if k.device_type in (None, target.type)]
    reasons = []
    for k in fast:
        why = k.unsupported(layer, target, act_dtype)
        if why is not None:
            reasons.append(f"{k.name} {why}")
    return reasons


def agrees_with_reference(layer: "QuantLinear", kernel: type[Kernel], tensors: dict[str, torch.Tensor]) -> bool:
    """Run ``kernel`` and the reference on the same random input; True when they agree closely.

    The kernel computes every output; the reference only a sample of :data:`REFERENCE_ROWS` rows
    spread over them (first and last included): a wrong layout shows in any of them, and a
    vocabulary head is not dequantized whole at every start."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, layer.in_features, generator=g).to(device=layer.device, dtype=layer.act_dtype)
    canonical = layer.canonical()
    rows = None
    if layer.out_features > REFERENCE_ROWS:
        rows = torch.linspace(0, layer.out_features - 1, REFERENCE_ROWS).round().long().unique()
        canonical = {k: v[rows.to(v.device)] for k, v in canonical.items()}
    with torch.no_grad():
        want = reference_linear(canonical, layer.scheme, x.float())
        del canonical
        saved = {k: getattr(layer, k, None) for k in tensors}
        saved_layout = layer.layout
        for k, v in tensors.items():
            setattr(layer, k, v)
        layer.layout = kernel.layout_for(layer)  # as prepare will record it
        try:
            got = kernel.matmul(layer, x).float()
        except RuntimeError as e:
            warn_once(f"kernel {kernel.name} fails on {layer.scheme.label()} layers here "
                      f"({str(e).splitlines()[0] if str(e) else type(e).__name__})")
            return False
        finally:
            layer.layout = saved_layout
            for k, v in saved.items():
                if v is None:
                    delattr(layer, k)
                else:
                    setattr(layer, k, v)
    if rows is not None:
        got = got[:, rows.to(got.device)]
    err = (got - want).norm() / want.norm().clamp(min=1e-6)
    return bool(err < 2e-2)  # bf16 activations and scales cost ~0.5%; a wrong layout costs ~100%


#: The warnings :func:`warn_once` has given in this process.
WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """A warning given once a process: a model's 200 layers falling back for one reason are one line."""
    if message not in WARNED:
        WARNED.add(message)
        warnings.warn(message, stacklevel=3)
