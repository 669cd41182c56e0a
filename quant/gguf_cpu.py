"""A GGUF tensor's blocks on the CPU (the ``gguf`` scheme): :class:`GGUFBlocksCPU`, the layouts it
holds a layer in, and the packers that repack Q5_0, Q4_K and Q6_K blocks into ``csrc/tile_mm.cpp``'s
tiles.

Which layout a layer is in is decided once, when it is prepared (:meth:`GGUFBlocksCPU.layout_for`:
its GGUF type, and whether a tied model's embedding reads its blocks), and recorded on the layer
(``QuantLinear.layout``); its products and its row limit are picked by that record."""

from __future__ import annotations

from collections.abc import Callable

import torch

from localllm import native
from localllm.quant import tiles
from localllm.quant.formats import GGUF_BLOCKS
from localllm.quant.gguf_blocks import q4_k_parts, q6_k_parts
from localllm.quant.kernel_base import Kernel, Layout
from localllm.quant.native_ops import LIBRARY, native_cpu_unsupported
from localllm.quant.tile_kernels import Int4GroupCPU


def top_plane(top: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, in) each code's top ``bits`` bits past its nibble -> (rows, in * bits / 32) int32, the
    plane ``csrc/tile_mm.cpp`` reads beside the nibbles (``OctetHi``): a dword for 32 / bits columns,
    octet c's column i at bit bits * c + the bit where column i's nibble starts in its dword."""
    i = torch.arange(8)
    shift = torch.where(i < 4, 8 * i, 8 * (i - 4) + 4)  # (8,): where column i's nibble starts
    octets = 4 // bits
    at = shift + bits * torch.arange(octets).view(octets, 1)  # (octets, 8)
    words = (top.long().view(top.shape[0], -1, octets, 8) << at).sum((-1, -2))  # < 2^32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _slices(rows: int | None) -> int:
    """Output rows repacked at a time: ``rows`` (default :data:`quant.tiles.PACK_ROWS`), whole tiles."""
    rows = rows or tiles.PACK_ROWS
    return rows - rows % tiles.TILE


def _joined(parts: dict[str, list[torch.Tensor]], dwords: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The slices' parts of each tensor joined, those named in ``dwords`` as the kernels' bytes."""
    out = {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}
    for k in dwords:
        out[k] = tiles.as_dword_bytes(out[k])
    return out


def int5_pack(blocks: torch.Tensor, rows: int | None = None) -> dict[str, torch.Tensor]:
    """Q5_0 blocks (out, in/32 * 22) -> ``csrc/tile_mm.cpp``'s int5 layout, the same codes and
    scales (``packed`` as :class:`Int4GroupCPU`'s, of the codes' low nibbles; ``fifth`` (tiles, in/32,
    64): dword j of group g holding row 16t + j's fifth bits, column 8c + i's at bit c + the bit
    where column i's nibble starts in its dword; ``tile_scales`` fp16 (tiles, in/32, 16): d). A
    decode step multiplies 16 rows' codes a vector without a byte shuffle, where the blocks' own
    layout (16 bytes of nibbles, then 4 of fifth bits, a row at a time) takes several."""
    rows = _slices(rows)
    parts: dict[str, list[torch.Tensor]] = {"packed": [], "fifth": [], "tile_scales": []}
    for a in range(0, blocks.shape[0], rows):
        b = blocks[a : a + rows].reshape(-1, blocks.shape[1] // 22, 22)  # (r, nb, bytes): d, qh, qs
        r = b.shape[0]
        qs = b[..., 6:22]  # (r, nb, 16): column j's low 4 bits, column 16 + j's in the high nibble
        nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=-1).view(r, -1)  # (r, in): the codes' low 4 bits
        octets = tiles.octet_bytes(nibbles).view(torch.int32)  # (r, in/8)
        qh = b[..., 2:6]  # (r, nb, 4): bit i of byte c is column 8c + i's fifth bit
        fifth = ((qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(r, -1)  # (r, in)
        words = top_plane(fifth, 1)  # (r, in/32)
        d = b[..., 0:2].contiguous().view(torch.float16).view(r, -1)  # (r, nb)
        parts["packed"].append(tiles.tiles(octets))  # (r/16, in/8, 16) dwords
        parts["fifth"].append(tiles.tiles(words))  # (r/16, in/32, 16) dwords
        parts["tile_scales"].append(tiles.tiles(d))
    return _joined(parts, ("packed", "fifth"))


def q4_k_pack(blocks: torch.Tensor, rows: int | None = None) -> dict[str, torch.Tensor]:
    """Q4_K blocks (out, in/256 * 144) -> ``csrc/tile_mm.cpp``'s Int4K layout, the same codes and
    scales in 148 bytes a 256 weights (``packed`` as :class:`Int4GroupCPU`'s, of the codes;
    ``mins`` uint8 (tiles, in/32, 32): each row's 6-bit sc of a sub-block, then its m, a byte each;
    ``supers`` fp16 (tiles, in/256, 32): d, then dmin). The kernel forms d * sc and -dmin * m in registers, exact in fp32,
    where the blocks' layout spreads each sub-block's codes with byte shuffles a row at a time."""
    rows = _slices(rows)
    parts: dict[str, list[torch.Tensor]] = {"packed": [], "mins": [], "supers": []}
    for a in range(0, blocks.shape[0], rows):
        d, dmin, sc, m, codes = q4_k_parts(blocks[a : a + rows])  # (r, nb), (r, nb, 8), (r, in)
        r = codes.shape[0]
        parts["packed"].append(tiles.tiles(tiles.octet_bytes(codes).view(torch.int32)))
        # (r/16, in/32, 16) bytes of sc beside those of m: one (r/16, in/32, 32) row of 32 a group
        parts["mins"].append(torch.cat([tiles.tiles(v.reshape(r, -1)) for v in (sc, m)], dim=-1))
        parts["supers"].append(torch.cat([tiles.tiles(v) for v in (d, dmin)], dim=-1))
    return _joined(parts, ("packed",))


def q6_k_pack(blocks: torch.Tensor, rows: int | None = None) -> dict[str, torch.Tensor]:
    """Q6_K blocks (out, in/256 * 210) -> ``csrc/tile_mm.cpp``'s Int6K layout, the same codes and
    scales in as many bytes (``packed`` as :class:`Int4GroupCPU`'s, of the codes' low nibbles;
    ``top`` uint8 (tiles, in/16, 64): dword j of sub-block g holding row 16t + j's top two bits, those
    of column 8c + i (octet c of the sub-block) at bits 2c, 2c + 1 from where column i's nibble
    starts; ``sub_scales`` int8 (tiles, in/16, 16): sc; ``supers`` fp16 (tiles, in/256, 16): d). The
    kernel forms d * sc and -32 d * sc in registers, exact in fp32, where the blocks' layout spreads
    each sub-block's codes over two arrays with byte shuffles a row at a time."""
    rows = _slices(rows)
    parts: dict[str, list[torch.Tensor]] = {"packed": [], "top": [], "sub_scales": [], "supers": []}
    for a in range(0, blocks.shape[0], rows):
        d, sc, codes = q6_k_parts(blocks[a : a + rows])  # (r, nb), (r, nb, 16), (r, in)
        r = codes.shape[0]
        octets = tiles.octet_bytes(codes & 0x0F).view(torch.int32)  # (r, in/8)
        words = top_plane(codes >> 4, 2)  # (r, in/16)
        parts["packed"].append(tiles.tiles(octets))
        parts["top"].append(tiles.tiles(words))
        parts["sub_scales"].append(tiles.tiles(sc.reshape(r, -1)))
        parts["supers"].append(tiles.tiles(d))
    return _joined(parts, ("packed", "top"))


#: The file's blocks as they are: the block-decoding kernel (``csrc/gguf_blocks_mm.cpp``) and its panels.
BLOCKS_LAYOUT = Layout("blocks", ("blocks",), "gguf_mm", "gguf_gemm")
#: Q5_0's codes in int4 tiles with a plane of fifth bits, and d a group of 32.
INT5_TILES = Layout("int5", ("packed", "fifth", "tile_scales"), "int5_group_mm", "int5_group_gemm")
#: Q4_K's codes in int4 tiles, each sub-block's 6-bit scale and min, and d, dmin a super-block.
INT4K_TILES = Layout("int4k", ("packed", "mins", "supers"), "int4k_group_mm", "int4k_group_gemm")
#: Q6_K's low nibbles in int4 tiles, a plane of top two bits, int8 sub-block scales, and d.
INT6K_TILES = Layout("int6k", ("packed", "top", "sub_scales", "supers"), "int6k_group_mm", "int6k_group_gemm")

#: GGUF type -> the tile layout its blocks are repacked into at load, and the packer that makes it
#: (the tile kernels decode 16 rows a vector where the blocks' own layout shuffles bytes a row at a
#: time). A type not here keeps :data:`BLOCKS_LAYOUT`.
REPACKED: dict[str, tuple[Layout, Callable[[torch.Tensor], dict[str, torch.Tensor]]]] = {
    "Q5_0": (INT5_TILES, int5_pack),
    "Q4_K": (INT4K_TILES, q4_k_pack),
    "Q6_K": (INT6K_TILES, q6_k_pack),
}


class GGUFBlocksCPU(Kernel):
    """A GGUF tensor's blocks as the file has them (the ``gguf`` scheme: Q4_K, Q5_0, Q6_K...): decode
    steps (a few rows of activations) run localllm's C++ kernel, which decodes each block as it
    multiplies; more rows (a batched step, a prefill) go through fp32 panels of the weights decoded
    by the same decoder (``gguf_gemm``, ``csrc/panel_gemm.h``). No copy of the whole weight is ever
    made, and the scales stay as exact as the file's (fp32 products, never rounded to 16 bits). Q5_0,
    Q4_K and Q6_K are repacked at load into ``csrc/tile_mm.cpp``'s tiles (:data:`REPACKED`), whose
    decode kernels take int16 activations as :class:`Int4GroupCPU`'s do."""

    name = "gguf-blocks-cpu"
    scheme = "gguf"
    device_type = "cpu"
    #: Activation rows up to which the block-decoding kernel runs; above, the panel GEMM.
    GEMV_ROWS = 16
    # The packers, where they were first defined (the tests name them so).
    int5_pack = staticmethod(int5_pack)
    q4_k_pack = staticmethod(q4_k_pack)
    q6_k_pack = staticmethod(q6_k_pack)
    top_plane = staticmethod(top_plane)

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "gguf":
            return "runs GGUF blocks only"
        return native_cpu_unsupported(target, act_dtype)

    @staticmethod
    def layout_for(layer) -> Layout:  # type: ignore[no-untyped-def]
        """Tiles for a type of :data:`REPACKED`, but for a tied head, which keeps its blocks (the
        embedding reads them); the blocks for any other type."""
        if layer.serves_embedding or layer.scheme.gguf_type not in REPACKED:
            return BLOCKS_LAYOUT
        return REPACKED[layer.scheme.gguf_type][0]

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        if not native.available(LIBRARY):
            raise RuntimeError("localllm's CPU kernels are not built")
        if GGUFBlocksCPU.layout_for(layer) is BLOCKS_LAYOUT:
            return {"blocks": layer.blocks}  # the file's bytes as they are
        return REPACKED[layer.scheme.gguf_type][1](layer.blocks)

    @classmethod
    def row_limit(cls, layer):  # type: ignore[no-untyped-def]
        """Repacked layers take the tile kernels' rows (:class:`Int4GroupCPU`'s); the file's own
        blocks, the block-decoding kernel's."""
        return cls.GEMV_ROWS if layer.layout is BLOCKS_LAYOUT else Int4GroupCPU.GEMV_ROWS

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        layout = layer.layout
        ops = torch.ops.localllm
        op = getattr(ops, layout.row_op if x.shape[0] <= GGUFBlocksCPU.row_limit(layer) else layout.panel_op)
        tensors = [getattr(layer, name) for name in layout.tensors]
        if layout is BLOCKS_LAYOUT:
            return op(x, *tensors, GGUF_BLOCKS[layer.scheme.gguf_type][0], layer.in_features)
        return op(x, *tensors, layer.out_features)
