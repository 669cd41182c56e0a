"""Kernels that are torch's own ops: tinygemm's int4 on the CPU and on CUDA, and int8 weight-only."""

from __future__ import annotations

import torch

from localllm.quant.formats import unpack_int4
from localllm.quant.kernel_base import Kernel, dtype_name


class Int4TinygemmCPU(Kernel):
    name = "int4-tinygemm-cpu"
    scheme = "int4"
    device_type = "cpu"
    #: Output rows repacked at a time (a multiple of the packer's 64-row blocks, which it packs
    #: independently): the int32 codes the packer takes are 8x the packed bytes, never for a whole layer.
    PACK_ROWS = 4096

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "int4":
            return "runs int4 weights only"
        if target.type != "cpu":
            return "runs on the CPU only"
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return f"needs a newer torch than {torch.__version__}"
        if act_dtype != torch.bfloat16:
            return f"needs bfloat16 activations, not {dtype_name(act_dtype)}"
        if layer.in_features % layer.scheme.group_size or layer.out_features % 16:
            return f"needs widths that are multiples of the group and of 16 ({layer.out_features}x{layer.in_features})"
        return None

    @staticmethod
    def _scales_and_zeros(layer) -> torch.Tensor:  # type: ignore[no-untyped-def]
        # tinygemm dequantizes as (q - 8) * scale + zero: zero = offset + 8 * scale. (in/g, out, 2) bf16.
        s, o = layer.scales.float(), layer.offsets.float()
        return torch.stack([s, o + 8 * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    @staticmethod
    def prepare(layer, rows: int | None = None):  # type: ignore[no-untyped-def]
        rows = rows or Int4TinygemmCPU.PACK_ROWS
        out, half = layer.qweight.shape
        packed = torch.empty((out, half), dtype=torch.uint8, device=layer.qweight.device)
        for a in range(0, out, rows):
            q = unpack_int4(layer.qweight[a : a + rows]).to(torch.int32)  # (rows, in)
            packed[a : a + rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        return {"packed": packed, "scales_zeros": Int4TinygemmCPU._scales_and_zeros(layer)}

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, layer.scheme.group_size, layer.scales_zeros)


class Int4TinygemmCUDA(Kernel):
    name = "int4-tinygemm-cuda"
    scheme = "int4"
    device_type = "cuda"
    #: k-tiles of 16 inputs packed together, widest first: 8 (16-byte loads) where the input width is a
    #: multiple of 128, else 4 or 2 (int4mm.cu takes all three): SmolLM2's 576-wide layers pack by 4.
    INNER_K_TILES = (8, 4, 2)

    @staticmethod
    def inner_k_tiles(in_features: int) -> int | None:
        """The widest packing whose k-tiles divide the input width, or None (not a multiple of 32)."""
        return next((t for t in Int4TinygemmCUDA.INNER_K_TILES if in_features % (16 * t) == 0), None)

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "int4":
            return "runs int4 weights only"
        if target.type != "cuda":
            return "runs on CUDA GPUs only"
        capability = target.capability
        if capability is None:
            return "needs a GPU of compute capability 8.0 or newer (this one's is unknown)"
        if capability < (8, 0):
            return f"needs a GPU of compute capability 8.0 or newer (this one has {capability[0]}.{capability[1]})"
        if act_dtype != torch.bfloat16:
            return f"needs bfloat16 activations, not {dtype_name(act_dtype)}"
        if Int4TinygemmCUDA.inner_k_tiles(layer.in_features) is None or layer.out_features % 8:
            return (f"needs input widths that are multiples of 32 and outputs of 8 "
                    f"({layer.out_features}x{layer.in_features})")
        return None

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        q = unpack_int4(layer.qweight)  # (out, in) uint8 codes
        hi_first = (q[:, 0::2] << 4) | q[:, 1::2]  # the CUDA packer wants the even column in the high nibble
        tiles = Int4TinygemmCUDA.inner_k_tiles(layer.in_features)
        return {
            "packed": torch.ops.aten._convert_weight_to_int4pack(hi_first.contiguous(), tiles),
            "scales_zeros": Int4TinygemmCPU._scales_and_zeros(layer),
        }

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.aten._weight_int4pack_mm(x, layer.packed, layer.scheme.group_size, layer.scales_zeros)


class Int8WeightOnly(Kernel):
    name = "int8-weight-only"
    scheme = "int8"

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "int8":
            return "runs int8 weights only"
        if layer.scheme.group_size is not None:
            return "needs one scale per output channel, not per group"
        if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            return f"needs a newer torch than {torch.__version__}"
        if target.type != "cpu" and act_dtype not in (torch.bfloat16, torch.float16):
            return f"needs bfloat16 or float16 activations on {target.type}, not {dtype_name(act_dtype)}"
        return None

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return {"qweight": layer.qweight, "kscales": layer.scales.to(layer.act_dtype)}

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.kscales)

    @staticmethod
    def rows_of(layer, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """(n,) row ids -> (n, in) fp32 weights, q * scale, from the codes and the kernel's scales."""
        return layer.qweight[tokens].float() * layer.kscales[tokens].float().unsqueeze(-1)
