"""localllm's Triton kernels on CUDA: int4 and int8 from their canonical tensors
(:mod:`quant.int_triton`), and a GGUF tensor's own blocks (:mod:`quant.gguf_triton`). Triton is
imported only when a CUDA target asks."""

from __future__ import annotations

import importlib.util

import torch

from localllm.quant.kernel_base import Kernel
from localllm.quant.target import Target


def triton_unsupported(target: Target, act_dtype: torch.dtype) -> str | None:
    """Why localllm's Triton kernels cannot run on ``target`` with ``act_dtype`` activations, or None."""
    if target.type != "cuda":
        return "runs on CUDA only"
    if importlib.util.find_spec("triton") is None:
        return "needs Triton (torch's CUDA builds install it)"
    capability = target.capability
    if act_dtype == torch.bfloat16 and (capability is None or capability < (8, 0)):
        have = "this one's is unknown" if capability is None else f"this one has {capability[0]}.{capability[1]}"
        return f"needs a GPU of compute capability 8.0 or newer for bfloat16 activations ({have})"
    return None


class _IntTritonCUDA(Kernel):
    """int4 or int8 weights on CUDA from their canonical tensors as they are (:mod:`quant.int_triton`):
    a few rows split the input width across the SMs, prefill runs tensor-core tiles."""

    device_type = "cuda"

    @classmethod
    def unsupported(cls, layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def,override]
        if layer.scheme.name != cls.scheme:
            return f"runs {cls.scheme} weights only"
        return triton_unsupported(target, act_dtype)

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return dict(layer.canonical())

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        from localllm.quant.int_triton import int_mm

        offsets = layer.offsets if layer.scheme.name == "int4" else None  # canonical int8 has none
        return int_mm(x, layer.qweight, layer.scales, offsets, layer.scheme.group_size)


class Int4TritonCUDA(_IntTritonCUDA):
    """Taken before tinygemm, whose prefill the first GPU run measured at eleven times fp16's (the
    GPU table of docs/benchmarks.md); ``--kernel int4-tinygemm-cuda`` still picks that one, and
    ``scripts/linear_gpu.py`` times both."""

    name = "int4-triton-cuda"
    scheme = "int4"


class Int8TritonCUDA(_IntTritonCUDA):
    """Per channel or per group: torch's ``_weight_int8pack_mm`` decoded at 3% of an H200's bandwidth
    and took 28 s over a 2,000-token prompt of a 7B model on the first GPU run."""

    name = "int8-triton-cuda"
    scheme = "int8"


class GGUFBlocksCUDA(Kernel):
    """A GGUF tensor's blocks on CUDA (the ``gguf`` scheme): a Triton kernel decodes each block in
    registers as it multiplies (:mod:`quant.gguf_triton`); the bytes stay as the file has them."""

    name = "gguf-blocks-cuda"
    scheme = "gguf"
    device_type = "cuda"

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "gguf":
            return "runs GGUF blocks only"
        if target.type != "cuda":
            return "runs on CUDA only"
        if importlib.util.find_spec("triton") is None:
            return "needs Triton (torch's CUDA builds install it)"
        from localllm.quant.gguf_triton import TYPES  # imports Triton: only for a CUDA target

        if layer.scheme.gguf_type not in TYPES:
            return f"has no Triton decoder for {layer.scheme.gguf_type}"
        return None

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return {"blocks": layer.blocks}  # the file's bytes as they are

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        from localllm.quant.gguf_triton import gguf_mm

        return gguf_mm(x, layer.blocks, layer.scheme.gguf_type, layer.in_features)


class Int4ZerosTritonCUDA(Kernel):
    """int4 with integer zero points (``int4z``: GPTQ, AWQ, compressed-tensors) on the int4 Triton
    kernel, exactly: its offsets ``-z * s`` made in fp32 (exact there, not in fp16), which the kernel
    loads as it loads int4's fp16 ones (``q * s + o`` in fp32, then the activation dtype)."""

    name = "int4z-triton-cuda"
    scheme = "int4z"
    device_type = "cuda"

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "int4z":
            return "runs int4 weights with zero points only"
        return triton_unsupported(target, act_dtype)

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        c = layer.canonical()
        offsets = -c["zeros"].float() * c["scales"].float()  # (out, groups): exact in fp32
        return {"qweight": c["qweight"], "scales": c["scales"], "offsets": offsets}

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        from localllm.quant.int_triton import int_mm

        return int_mm(x, layer.qweight, layer.scales, layer.offsets, layer.scheme.group_size)
