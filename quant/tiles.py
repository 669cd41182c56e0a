"""The tiles of 16 output rows that ``csrc/tile_mm.cpp`` and ``csrc/q8_mm.cpp`` read: how codes and
scales are laid into them and read back. Every tile layout (int4, int8, and the GGUF types repacked
for the CPU) is made of these."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from localllm import native
from localllm.quant.formats import unpack_int4
from localllm.quant.native_ops import LIBRARY

if TYPE_CHECKING:
    from localllm.quant.linear import QuantLinear

#: Output rows a tile holds (a decode kernel's register rows).
TILE = 16
#: Output rows repacked at a time (the codes are unpacked to a byte each on the way).
PACK_ROWS = 4096


def tiles(t: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """(rows, cols) -> (ceil(rows / tile), cols, tile), rows past the end zero."""
    rows, cols = t.shape
    pad = -rows % tile
    if pad:
        t = torch.cat([t, t.new_zeros((pad, cols))])
    return t.view(-1, tile, cols).transpose(1, 2).contiguous()


def octet_bytes(codes: torch.Tensor) -> torch.Tensor:
    """(rows, in) 4-bit codes, a byte each -> (rows, in/2), 4 bytes an octet of columns (low nibbles 0-3)."""
    q = codes.view(codes.shape[0], -1, 2, 4)  # (rows, octets, 2 halves, 4)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).flatten(1)


def int4_octets(qweight: torch.Tensor) -> torch.Tensor:
    """(rows, in/2) canonical int4 bytes -> :func:`octet_bytes`."""
    return octet_bytes(unpack_int4(qweight))


def as_dword_bytes(t: torch.Tensor) -> torch.Tensor:
    """(tiles, n, 16) int32 dwords -> (tiles, n, 64) uint8, the bytes the kernels load."""
    return t.view(torch.uint8).view(t.shape[0], t.shape[1], 4 * TILE)


def dword_tiles(qweight: torch.Tensor, row_bytes: Callable[[torch.Tensor], torch.Tensor],
                rows: int | None = None) -> torch.Tensor:
    """The layout of the int4 kernels and of the int8-activation ones: uint8 (tiles of 16 rows, n/4,
    64), dword j of column c being output row 16t + j's 4 bytes c of ``row_bytes(qweight rows)``
    ((rows, n) uint8); built ``rows`` (:data:`PACK_ROWS`) rows at a time, the last tile padded with
    zeros."""
    if not native.available(LIBRARY):
        raise RuntimeError("localllm's CPU kernels are not built")
    rows = rows or PACK_ROWS
    rows -= rows % TILE
    parts = [tiles(row_bytes(qweight[a : a + rows]).view(torch.int32))
             for a in range(0, qweight.shape[0], rows)]  # (rows/16, n/4, 16) dwords each
    return as_dword_bytes(torch.cat(parts) if len(parts) > 1 else parts[0])


def tile_rows(layer: "QuantLinear", tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) output rows -> (n, in/4, 4) bytes of ``layer.packed`` (:func:`dword_tiles`' layout) and
    (n, groups) fp32 ``layer.tile_scales`` of those rows."""
    t, j = tokens // TILE, tokens % TILE
    count, dwords, _ = layer.packed.shape
    return layer.packed.view(count, dwords, TILE, 4)[t, :, j], layer.tile_scales[t, :, j].float()


def tile_offsets(layer: "QuantLinear", tokens: torch.Tensor) -> torch.Tensor:
    """(n,) output rows -> (n, groups) fp32 ``layer.tile_offsets`` of those rows (an int4 layout)."""
    return layer.tile_offsets[tokens // TILE, :, tokens % TILE].float()
