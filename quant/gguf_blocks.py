"""GGUF tensors imported exactly: every type keeps the values its file defines.

* Q4_0, Q4_1 and Q8_0 (32-wide blocks, fp16 scales) become canonical int4/int8 tensors with group 32.
* Every other type of :data:`quant.formats.GGUF_BLOCKS` (Q5_0, Q5_1, IQ4_NL, MXFP4, the K-quants
  Q2_K..Q6_K, and F16/BF16/F32 linear weights in a quantized file) keeps its file's block bytes as they are, in
  the ``gguf`` scheme: K-quants' scales are products of an fp16 super-block scale and a 4-8-bit
  sub-scale, exact only in fp32, so no 16-bit canonical grid could hold them; the kernel forms them in
  fp32 as it decodes (``quant/csrc/gguf_blocks_mm.cpp``). Memory is the file's bytes, 1.0x.

ggml block layouts (little-endian, one block = 32 consecutive weights of a row):

* Q4_0: fp16 ``d``, 16 bytes of codes;           ``w = (q - 8) * d``
* Q4_1: fp16 ``d``, fp16 ``m``, 16 bytes of codes; ``w = q * d + m``
* Q8_0: fp16 ``d``, 32 int8 codes;                ``w = q * d``

In the 4-bit blocks byte j holds weight j in its low nibble and weight j + 16 in its high nibble.

* MXFP4 (17 bytes, gpt-oss's experts): an E8M0 scale byte ``e``, 16 bytes of E2M1 codes (nibbles as
  above); ``w = kvalues[q] * 2^(e - 128)`` with ggml's doubled E2M1 values ``kvalues`` (0, 1, 2, 3,
  4, 6, 8, 12 and their negatives), exact in fp32. The HF checkpoint's ``*_blocks`` / ``*_scales``
  repack into these blocks (:func:`quant.hub_formats.mxfp4_blocks`).

Two more, whose integer codes the opt-in int8-activation kernels multiply (:func:`integer_grid`):

* Q5_0 (22 bytes): fp16 ``d``, uint32 ``qh``, 16 bytes ``qs``; weight j's code is the nibble of
  ``qs`` as above plus bit j of ``qh`` as its fifth bit; ``w = (q - 16) * d``.
* Q4_K (144 bytes, 256 weights = 8 sub-blocks of 32): fp16 ``d``, fp16 ``dmin``, 12 bytes of 6-bit
  sub-block scales ``sc`` and minimums ``m``, 128 bytes of codes: byte i of the 32-byte chunk c holds
  weight i of sub-block 2c (low nibble) and of 2c + 1 (high); ``w = d * sc * q - dmin * m``. For
  j < 4, ``sc[j] = b[j] & 63`` and ``m[j] = b[j + 4] & 63``; for j >= 4 the low four bits come from
  ``b[j + 4]`` (``sc``: its low nibble, ``m``: its high) and the top two from the top bits of
  ``b[j - 4]`` (``sc``) or ``b[j]`` (``m``).
* Q6_K (210 bytes, 256 weights = 16 sub-blocks of 16): 128 bytes ``ql`` (low four bits), 64 bytes
  ``qh`` (top two), 16 int8 sub-block scales ``sc``, fp16 ``d``; ``w = d * sc * (q - 32)``. In half h
  (weights 128h ..), byte l of ``ql``'s 64 gives weights l (low nibble) and 64 + l (high), and byte l
  of ``qh``'s 32 gives the top bits of weights l, 32 + l, 64 + l and 96 + l (bits 0-1, 2-3, 4-5, 6-7).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from localllm.quant.formats import GGUF_BLOCKS, QuantScheme, gguf_scheme, pack_int4, parse_scheme

BLOCK = 32
#: Rows dequantized at a time: the quantized types' numpy temporaries are a few times the float32
#: output, so never for a whole vocabulary table.
DEQUANT_ROWS = 1024
#: GGUF type name -> (canonical scheme name, symmetric) it imports into without loss at group 32.
EXACT = {"Q4_0": ("int4", True), "Q4_1": ("int4", False), "Q8_0": ("int8", True)}


def exact_import(type_name: str, scheme: QuantScheme) -> bool:
    """Whether a tensor of this GGUF type holds exactly in ``scheme`` (its own blocks, or the same grid
    with group 32)."""
    if scheme.name == "gguf":
        return scheme.gguf_type == type_name
    if type_name not in EXACT or scheme.group_size != BLOCK:
        return False
    target, symmetric = EXACT[type_name]
    if target != scheme.name:
        return False
    # Q4_0 is symmetric, so it also fits the asymmetric grid; Q4_1 fits only the asymmetric one.
    return scheme.name != "int4" or symmetric or not scheme.symmetric


def exact_scheme(type_name: str) -> QuantScheme | None:
    """The scheme a tensor of this GGUF type imports into exactly (None: a type localllm cannot keep,
    such as the IQ2/IQ3 grids): Q4_0/Q4_1 int4 group 32, Q8_0 int8 group 32, else its own blocks."""
    if type_name in EXACT:
        name, symmetric = EXACT[type_name]
        return parse_scheme(name, BLOCK, symmetric if name == "int4" else False)
    if type_name in GGUF_BLOCKS:
        return gguf_scheme(type_name)
    return None


def dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType, rows: int = DEQUANT_ROWS) -> np.ndarray:
    """float32 values of one GGUF tensor's raw data (as the reader shapes it), ``rows`` rows at a time."""
    if data.ndim < 2 or data.shape[0] <= rows:
        return gguf.quants.dequantize(data, qtype)
    first = gguf.quants.dequantize(data[:rows], qtype)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    out[:rows] = first
    del first
    for a in range(rows, data.shape[0], rows):
        out[a : a + rows] = gguf.quants.dequantize(data[a : a + rows], qtype)
    return out


#: GGUF types :func:`integer_grid` converts, by the canonical scheme and group that hold their codes.
INTEGER_GRIDS = {"Q5_0": ("int8", 32), "Q4_K": ("int4", 32), "Q6_K": ("int8", 16)}


def integer_grid(type_name: str, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """(rows, bytes) uint8 blocks of a :data:`INTEGER_GRIDS` type -> canonical tensors that hold the same
    integer codes: int8 ``qweight`` / ``scales`` (Q5_0: ``q - 16`` and ``d`` per 32, exact; Q6_K:
    ``q - 32`` and ``d * sc`` per 16) or int4 ``qweight`` / ``scales`` / ``offsets`` per 32 (Q4_K:
    ``q``, ``d * sc`` and ``-dmin * m``). For the int8-activation kernels, which multiply codes in 8-bit
    integers. The K-quants' sub-block scales and offsets are products exact only in fp32; the canonical
    grid rounds them to fp16 (a relative error of at most 2^-11 a sub-block, far below the
    activations' rounding to 1/254 of their block's largest), which is why the exact default keeps
    these blocks as they are."""
    rows = blocks.shape[0]
    if type_name == "Q5_0":
        b = blocks.view(rows, -1, 22)  # (rows, blocks, bytes)
        d = b[..., 0:2].contiguous().view(torch.float16)  # (rows, nb, 1)
        qh = b[..., 2:6]  # (rows, nb, 4): bit i of byte k is weight 8k + i's fifth bit
        fifth = ((qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(-2)  # (rows, nb, 32)
        qs = b[..., 6:22]
        nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # (rows, nb, 32)
        codes = (nibbles | fifth << 4).view(torch.int8) - 16  # -16 .. 15
        return {"qweight": codes.view(rows, -1), "scales": d.view(rows, -1)}
    if type_name == "Q4_K":
        d, dmin, sc, m, codes = q4_k_parts(blocks)
        return {"qweight": pack_int4(codes), "scales": (d.float().unsqueeze(-1) * sc).half().view(rows, -1),
                "offsets": (-(dmin.float().unsqueeze(-1) * m)).half().view(rows, -1)}
    if type_name == "Q6_K":
        d, sc, codes = q6_k_parts(blocks)
        return {"qweight": (codes.view(torch.int8) - 32).view(rows, -1),  # -32 .. 31
                "scales": (d.float().unsqueeze(-1) * sc.float()).half().view(rows, -1)}
    raise ValueError(f"GGUF {type_name} blocks have no integer grid here (only {', '.join(INTEGER_GRIDS)})")


def q4_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, bytes) uint8 Q4_K blocks -> d, dmin fp16 (rows, nb); sc, m uint8 (rows, nb, 8), the
    6-bit scale and min of each sub-block of 32; codes uint8 (rows, nb * 256) in weight order. A
    weight is d * sc * code - dmin * m."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, 144)
    d = b[..., 0:2].contiguous().view(torch.float16).view(rows, -1)
    dmin = b[..., 2:4].contiguous().view(torch.float16).view(rows, -1)
    s = b[..., 4:16]  # (rows, nb, 12)
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | (s[..., 0:4] >> 6) << 4], dim=-1)  # (rows, nb, 8)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], dim=-1)
    qs = b[..., 16:].reshape(rows, -1, 4, 1, 32)  # (rows, nb, chunk, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=3).view(rows, -1)  # sub-block 2c, then 2c + 1
    return d, dmin, sc, m, codes


def q6_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, bytes) uint8 Q6_K blocks -> d fp16 (rows, nb); sc int8 (rows, nb, 16), the scale of each
    sub-block of 16; codes uint8 (rows, nb * 256) in weight order, 0 .. 63. A weight is
    d * sc * (code - 32)."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, 210)
    ql = b[..., :128].reshape(rows, -1, 2, 64)  # (rows, nb, half, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-1)  # (rows, nb, half, 128)
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    top = (qh & 3).flatten(-2)  # (rows, nb, half, 128)
    codes = (low | top << 4).view(rows, -1)
    sc = b[..., 192:208].contiguous().view(torch.int8)  # (rows, nb, 16)
    d = b[..., 208:210].contiguous().view(torch.float16).view(rows, -1)
    return d, sc, codes


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = data.shape[0]
    return np.ascontiguousarray(data).reshape(rows, -1, block_bytes)  # (out, in/32, bytes)


def _codes4(qs: np.ndarray) -> np.ndarray:
    """(out, nb, 16) bytes -> (out, nb*32) codes in weight order."""
    lo, hi = qs & 0x0F, qs >> 4
    return np.concatenate([lo, hi], axis=-1).reshape(qs.shape[0], -1)


def to_canonical(type_name: str, data: np.ndarray, scheme: QuantScheme | None = None) -> dict[str, torch.Tensor]:
    """Canonical tensors of one GGUF tensor's raw data (out, bytes per row as the reader shapes it:
    uint8 blocks, or float16/float32 for F16/F32) in ``scheme`` (default: :func:`exact_scheme`)."""
    scheme = scheme or exact_scheme(type_name)
    if scheme is not None and scheme.name == "gguf":
        if scheme.gguf_type != type_name:
            raise ValueError(f"GGUF {type_name} blocks do not fit {scheme.label()}")
        rows = data.shape[0]
        return {"blocks": torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1))}  # (out, bytes)
    if type_name == "Q4_1":
        b = _blocks(data, 20)
        d = b[..., 0:2].copy().view(np.float16)[..., 0]  # (out, in/32), contiguous: its own buffer
        m = b[..., 2:4].copy().view(np.float16)[..., 0]
        codes = _codes4(b[..., 4:20])
        return {"qweight": pack_int4(torch.from_numpy(codes)), "scales": torch.from_numpy(d),
                "offsets": torch.from_numpy(m)}
    if type_name == "Q4_0":
        b = _blocks(data, 18)
        d = b[..., 0:2].copy().view(np.float16)[..., 0]
        codes = _codes4(b[..., 2:18])
        scales = torch.from_numpy(d)
        # -8 * d is exact in fp16 (a power-of-two multiple) unless |d| is near fp16's maximum.
        return {"qweight": pack_int4(torch.from_numpy(codes)), "scales": scales, "offsets": -8 * scales}
    if type_name == "Q8_0":
        b = _blocks(data, 34)
        d = b[..., 0:2].copy().view(np.float16)[..., 0]
        q = b[..., 2:34].copy().view(np.int8).reshape(b.shape[0], -1)
        return {"qweight": torch.from_numpy(q), "scales": torch.from_numpy(d)}
    raise ValueError(f"no exact import for GGUF type {type_name}")
