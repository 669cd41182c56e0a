"""localllm's exact CPU kernels on int8 and int4 codes in tiles of 16 rows (``csrc/tile_mm.cpp``):
fp32 accumulation of the products with the exact weights."""

from __future__ import annotations

import torch

from localllm.quant import tiles
from localllm.quant.kernel_base import Kernel, dtype_name
from localllm.quant.native_ops import native_cpu_unsupported


class Int8GroupCPU(Kernel):
    """int8 with a scale per group of inputs (a GGUF's Q8_0 blocks exactly) through localllm's C++
    kernel (``csrc/tile_mm.cpp``), with fp32 activations and fp32 accumulation: the product with the
    exact weights, without re-rounding. It also runs per-channel int8 (one scale a row), which torch's
    int8 kernel multiplies 4x slower in fp32 than in bf16. Up to :data:`GEMV_ROWS` activation rows
    (a decode or verify step) share each decoded column of codes; more (a prefill, a quality window's
    every position through the head) go through fp32 panels of the exact weights (``int8_group_gemm``,
    ``csrc/panel_gemm.h``).

    Layout (:meth:`pack`, which :class:`Int8Q8CPU` shares): ``packed`` uint8 (tiles of 16 rows, in/4,
    64), dword j of quad c holding row 16t + j's codes of columns 4c .. 4c + 3, each plus 128;
    ``tile_scales`` fp16 (tiles, in/group or 1, 16). A tied model's embedding reads its rows back
    (:meth:`rows_of`)."""

    name = "int8-group-cpu"
    scheme = "int8"
    device_type = "cpu"
    #: Activation rows up to which the register kernel runs; above, the panel GEMM.
    GEMV_ROWS = 8

    @staticmethod
    def dot_group(layer) -> int:  # type: ignore[no-untyped-def]
        """Inputs the kernel sums before scaling: the scheme's group, or for per-channel scales 32 (16)."""
        g = layer.scheme.group_size
        return g if g is not None else (32 if layer.in_features % 32 == 0 else 16)

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        g = layer.scheme.group_size
        if layer.scheme.name != "int8":
            return "runs int8 weights only"
        why = native_cpu_unsupported(target, act_dtype)
        if why is not None:
            return why
        if g is None and act_dtype != torch.float32:  # int8-weight-only is as fast with 16-bit ones
            return f"runs per-channel int8 with float32 activations only, not {dtype_name(act_dtype)}"
        if g is None and layer.in_features % 16:
            return f"needs an input width that is a multiple of 16 ({layer.in_features})"
        if g is not None and g % 16:
            return "needs scales per group of a multiple of 16 inputs"
        return None

    @staticmethod
    def pack(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical int8 tensors (``qweight``, ``scales`` per row or per group) -> this layout."""
        packed = tiles.dword_tiles(canonical["qweight"], lambda q: (q.to(torch.int16) + 128).to(torch.uint8))  # codes + 128
        scales = canonical["scales"].half()
        return {"packed": packed, "tile_scales": tiles.tiles(scales if scales.dim() == 2 else scales.view(-1, 1))}

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return Int8GroupCPU.pack(layer.canonical())

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        ops = torch.ops.localllm
        op = ops.int8_group_mm if x.shape[0] <= Int8GroupCPU.GEMV_ROWS else ops.int8_group_gemm
        return op(x, layer.packed, layer.tile_scales, Int8GroupCPU.dot_group(layer), layer.out_features)

    @staticmethod
    def rows_of(layer, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """(n,) row ids -> (n, in) fp32 weights, q * scale (exact in fp32), from the kernel's layout."""
        codes, s = tiles.tile_rows(layer, tokens)  # (n, in/4, 4) codes + 128, (n, in/group or 1)
        q = (codes.flatten(1).to(torch.int16) - 128).float()  # (n, in)
        return (q.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)


class Int4GroupCPU(Kernel):
    """int4 with an fp16 scale and offset per group (the canonical format: a GGUF's Q4_0 / Q4_1 blocks
    exactly, or weights quantized to int4) through localllm's C++ kernel (``csrc/tile_mm.cpp``),
    with fp32 accumulation: the product with the exact weights, up to summation order. A decode step
    of one or a few sequences decodes the codes in registers and, where the CPU has AVX2 or AVX-512,
    multiplies them by the activations rounded to int16 per 32 columns (steps of 2^-16 of their
    largest, ``tile_rows_q16``); more than
    :data:`GEMV_ROWS` rows (a batched step, a prefill) go through fp32 panels of the exact weights
    (``int4_group_gemm``, ``csrc/panel_gemm.h``), which never hold more than a few KB of them.

    Layout (made here, from the canonical tensors; :class:`Int4Q8CPU` reads the same): output rows in
    tiles of 16, ``packed`` uint8 (tiles, in/8, 64), dword j of octet o holding row 16t + j's codes of
    columns 8o + i (low nibble of byte i) and 8o + 4 + i (high nibble), so that each of an octet's
    columns is a shift and a mask of one load's lanes; ``tile_scales`` and ``tile_offsets`` fp16
    (tiles, in/group, 16). Rows past the layer's last in the last tile are zeros. Same bytes as the
    canonical tensors (but that padding)."""

    name = "int4-group-cpu"
    scheme = "int4"
    device_type = "cpu"
    TILE = tiles.TILE
    PACK_ROWS = tiles.PACK_ROWS
    #: Activation rows up to which the register kernel runs; above, the panel GEMM.
    GEMV_ROWS = 4

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "int4":
            return "runs int4 weights only"
        return native_cpu_unsupported(target, act_dtype)

    @staticmethod
    def pack(canonical: dict[str, torch.Tensor], rows: int | None = None) -> dict[str, torch.Tensor]:
        """Canonical int4 tensors (``qweight``, ``scales``, ``offsets``) -> this layout, ``rows`` output
        rows repacked at a time (:data:`PACK_ROWS`)."""
        return {
            "packed": tiles.dword_tiles(canonical["qweight"], tiles.int4_octets, rows),
            "tile_scales": tiles.tiles(canonical["scales"].half()),
            "tile_offsets": tiles.tiles(canonical["offsets"].half()),
        }

    @staticmethod
    def prepare(layer, rows: int | None = None):  # type: ignore[no-untyped-def]
        return Int4GroupCPU.pack(layer.canonical(), rows)

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        g, n = layer.scheme.group_size, layer.out_features
        ops = torch.ops.localllm
        op = ops.int4_group_mm if x.shape[0] <= Int4GroupCPU.GEMV_ROWS else ops.int4_group_gemm
        return op(x, layer.packed, layer.tile_scales, layer.tile_offsets, g, n)


class Int4ZerosCPU(Int4GroupCPU):
    """int4 with integer zero points (``int4z``: GPTQ, AWQ, compressed-tensors' asymmetric int4) on
    :class:`Int4GroupCPU`'s C++ kernel and layout, exactly: ``w = (q - z) * s`` is ``q * s + o`` with
    ``o = -z * s``, exact in fp32 but not always in fp16. So the tiles hold ``-z`` (a small integer,
    exact in fp16) where int4's hold the offsets, and the kernel (``int4z_group_mm`` / ``_gemm``) makes
    each group's ``o`` in fp32 from it and the scale as it loads them: int4's bytes and speed, and the
    product of the exact weights."""

    name = "int4z-group-cpu"
    scheme = "int4z"

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "int4z":
            return "runs int4 weights with zero points only"
        if layer.scheme.group_size % 8:
            return f"needs a group that is a multiple of 8, not {layer.scheme.group_size}"
        return native_cpu_unsupported(target, act_dtype)

    @staticmethod
    def prepare(layer, rows: int | None = None):  # type: ignore[no-untyped-def]
        c = layer.canonical()
        return Int4GroupCPU.pack({"qweight": c["qweight"], "scales": c["scales"], "offsets": -c["zeros"].float()},
                                 rows)

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        g, n = layer.scheme.group_size, layer.out_features
        ops = torch.ops.localllm
        op = ops.int4z_group_mm if x.shape[0] <= Int4GroupCPU.GEMV_ROWS else ops.int4z_group_gemm
        return op(x, layer.packed, layer.tile_scales, layer.tile_offsets, g, n)
