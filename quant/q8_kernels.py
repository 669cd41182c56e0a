"""The opt-in family of CPU kernels with int8 activations (``csrc/q8_mm.cpp``): int4, int8 and a
GGUF's Q5_0, Q4_K and Q6_K blocks, multiplied in 8-bit integers as llama.cpp multiplies them."""

from __future__ import annotations

import torch

from localllm.quant import tiles
from localllm.quant.gguf_blocks import INTEGER_GRIDS, integer_grid
from localllm.quant.kernel_base import Kernel
from localllm.quant.native_ops import native_cpu_unsupported
from localllm.quant.tile_kernels import Int4GroupCPU, Int8GroupCPU

#: ``localllm::q8_isa()``'s paths, narrowest first (``csrc/q8_mm.cpp``'s ``Isa``).
Q8_PORTABLE, Q8_AVX2, Q8_AVX_VNNI, Q8_AVX512_VNNI = range(4)


class _Q8Kernel(Kernel):
    """The opt-in family of CPU kernels with int8 activations (``csrc/q8_mm.cpp``): what they share."""

    device_type = "cpu"
    opt_in = True
    family = "q8"

    @classmethod
    def unsupported(cls, layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def,override]
        if layer.scheme.name != cls.scheme:
            return f"runs {cls.scheme} weights only"
        why = native_cpu_unsupported(target, act_dtype)
        if why is not None:
            return why
        group = layer.scheme.group_size or layer.in_features
        if layer.in_features % 32 or (group % 32 and not (group == 16 and cls.scheme != "int4")):
            # a weight scale covers whole activation blocks, or (int8) each half of one
            return "needs weight scales per group (or row) of a multiple of 32 inputs"
        if torch.ops.localllm.q8_isa() == Q8_PORTABLE:
            return ("needs AVX2 (this CPU, or ATEN_CPU_CAPABILITY=default, gives none; the portable loop is "
                    "slower than fp32)")
        return None


class Int4Q8CPU(_Q8Kernel):
    """int4 with an fp16 scale and offset per group (as :class:`Int4GroupCPU`), multiplied by the
    activations quantized to int8 per block of 32 inputs, as llama.cpp multiplies its Q4 weights
    (``csrc/q8_mm.cpp``): the codes' dot products run in 8-bit integers (AVX-512 VNNI, AVX-VNNI, or
    AVX2's vpmaddubsw), four times the multiply-adds an instruction of fp32 FMAs (twice, on AVX2
    without VNNI), which is what bounds a batched decode step or a prefill on a CPU. One kernel for
    any number of rows, each row one fixed chain of operations: a
    sequence's numbers are the same alone and in any batch. Opt-in (``--kernel int4-q8-cpu``): the
    activations' rounding moves the logits (by what ``localllm bench`` reports as KL divergence), so
    the default stays the fp32 product with the exact weights. Every path gives the portable loop's
    bits; that loop is slow, so the kernel is offered only where AVX2 is.

    Layout: :class:`Int4GroupCPU`'s."""

    name = "int4-q8-cpu"
    scheme = "int4"
    pack = staticmethod(Int4GroupCPU.pack)  # the same layout

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return Int4GroupCPU.pack(layer.canonical())

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.localllm.int4_q8_mm(x, layer.packed, layer.tile_scales, layer.tile_offsets,
                                             layer.scheme.group_size, layer.out_features)

    @staticmethod
    def rows_of(layer, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """(n,) row ids -> (n, in) fp32 weights, q * scale + offset, from the kernel's layout."""
        octets, s = tiles.tile_rows(layer, tokens)  # (n, in/8, 4): byte i holds columns 8o + i and 8o + 4 + i
        o = tiles.tile_offsets(layer, tokens)
        q = torch.cat([octets & 0x0F, octets >> 4], dim=-1).flatten(1).float()  # (n, in)
        return (q.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1) + o.unsqueeze(-1)).flatten(-2)


class Int8Q8CPU(_Q8Kernel):
    """int8 weights (a scale per group of a multiple of 32 inputs, a GGUF's Q8_0 head; or per row) by
    the activations quantized to int8 per block of 32, on AVX2 or VNNI (``csrc/q8_mm.cpp``): the int8
    member of :class:`Int4Q8CPU`'s opt-in family, which ``--kernel int4-q8-cpu`` also takes for a
    model's int8 head. Layout: :class:`Int8GroupCPU`'s (``pack``, ``rows_of``)."""

    name = "int8-q8-cpu"
    scheme = "int8"

    @staticmethod
    def _group(layer) -> int:  # type: ignore[no-untyped-def]
        return layer.scheme.group_size or layer.in_features

    pack = staticmethod(Int8GroupCPU.pack)  # the same layout
    rows_of = staticmethod(Int8GroupCPU.rows_of)

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return Int8GroupCPU.pack(layer.canonical())

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.localllm.int8_q8_mm(x, layer.packed, layer.tile_scales, Int8Q8CPU._group(layer),
                                             layer.out_features)


class GGUFQ8CPU(_Q8Kernel):
    """The int8-activation family's member for a GGUF's Q5_0, Q4_K and Q6_K blocks (a Q4_K_M file's),
    which ``--kernel int4-q8-cpu`` takes with the rest of its family. At load the blocks become the
    integer grid that holds their codes (:func:`quant.gguf_blocks.integer_grid`: Q5_0 int8 codes with
    its fp16 scale, Q4_K int4 codes with an fp16 scale and offset a sub-block, Q6_K int8 codes with an
    fp16 scale per 16 inputs) in
    :class:`Int8Q8CPU`'s or :class:`Int4Q8CPU`'s layout, and the codes multiply in 8-bit integers as
    theirs do, as llama.cpp multiplies these blocks (the exact default forms an fp32 product of every
    weight, which bounds a one-row step by the core rather than by memory on AVX2 machines). Q5_0's
    and Q6_K's codes take a byte each (5.5 -> 8.5 and 6.56 -> 9 bits a weight); the K-quants' scales
    are rounded to fp16 on the way (see ``integer_grid``). Other GGUF types (Q5_K, Q3_K...) stay on
    :class:`GGUFBlocksCPU`."""

    name = "gguf-q8-cpu"
    scheme = "gguf"

    @classmethod
    def unsupported(cls, layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def,override]
        why = super().unsupported(layer, target, act_dtype)
        if why is None and layer.scheme.gguf_type not in INTEGER_GRIDS:
            return f"runs {', '.join(INTEGER_GRIDS)} blocks only"
        return why

    @staticmethod
    def _grid(layer):  # type: ignore[no-untyped-def]
        return Int4Q8CPU if INTEGER_GRIDS[layer.scheme.gguf_type][0] == "int4" else Int8Q8CPU

    @staticmethod
    def caveat(layer):  # type: ignore[no-untyped-def]
        kind = layer.scheme.gguf_type
        if kind.endswith("_K"):  # never a coarser grid silently (the weights, not only the activations)
            return (f"kernel {GGUFQ8CPU.name} holds {kind} layers with their sub-block scales rounded to fp16 "
                    "(within 2^-11 of the file's)")
        return None

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        grid, rows = GGUFQ8CPU._grid(layer), tiles.PACK_ROWS
        parts = [grid.pack(integer_grid(layer.scheme.gguf_type, layer.blocks[a : a + rows]))
                 for a in range(0, layer.out_features, rows)]  # a head's codes never all unpacked at once
        return {k: torch.cat([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in parts[0]}

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        ops, n = torch.ops.localllm, layer.out_features
        grid, group = INTEGER_GRIDS[layer.scheme.gguf_type]
        if grid == "int4":  # Int4Q8CPU's layout, with offsets
            return ops.int4_q8_mm(x, layer.packed, layer.tile_scales, layer.tile_offsets, group, n)
        return ops.int8_q8_mm(x, layer.packed, layer.tile_scales, group, n)

    @staticmethod
    def rows_of(layer, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """A tied head's embedding rows from the kernel's layout (Q4_K's with the fp16-rounded scales)."""
        return GGUFQ8CPU._grid(layer).rows_of(layer, tokens)
