"""Weight formats: the schemes, their canonical tensors, and a pure-torch quantize / dequantize reference.

Canonical layouts (what artifacts store; kernels repack at load time):

* ``int4``  ``qweight`` uint8 (out, in/2), two 4-bit codes a byte, low nibble first (column 2j in
  the low nibble, 2j+1 in the high one); ``scales`` and ``offsets`` fp16 (out, in/group); meaning
  ``w = q * scale + offset`` with q in 0..15. Symmetric int4 is the same grid with
  ``offset = -8 * scale``.
* ``int8``  ``qweight`` int8 (out, in); ``scales`` fp16 (out,) per channel, or (out, in/group);
  ``w = q * scale`` with q in -127..127.
* ``nf4``   bitsandbytes' 4-bit NormalFloat: ``qweight`` uint8 (out, in/2) as bitsandbytes packs it
  (high nibble first), ``absmax`` fp32 (out, in/blocksize); ``w = NF4[q] * absmax``.
* ``int4z`` int4 with integer zero points, the grid of GPTQ, AWQ and compressed-tensors' asymmetric
  int4 (imported only, :mod:`quant.hub_formats`): ``qweight`` as int4's, ``scales`` fp16 (out, in/group),
  ``zeros`` uint8 (out, in/group) in 0..16; ``w = (q - zero) * scale``. Its offset ``-zero * scale`` has up
  to 4 + 11 significant bits, which fp16 offsets cannot hold (fp32 can): so the zeros are kept as
  integers, and kernels form the offsets in fp32 (or hold the part fp16 misses beside them).
* ``int8z`` int8 with integer zero points (GPTQ's asymmetric 8-bit, imported only): ``qweight`` uint8
  (out, in), ``scales`` fp16 (out,) per channel or (out, in/group), ``zeros`` int16 of the same shape in
  0..256; ``w = (q - zero) * scale``.
* ``fp8``    FP8 e4m3 weights as a Hub checkpoint holds them (``quant_method: fp8``, imported only):
  ``qweight`` float8_e4m3fn (out, in), ``scales`` fp32 (out, in/group) (a 128x128 block's scale on
  each of its rows; per tensor or per channel one a row); ``w = fp8 * scale`` formed in fp32. The
  reference kernel multiplies it, one slice of a layer's rows at a time.
* act order (``QuantScheme.act_order``, imported GPTQ ``desc_act`` layers of any of these integer
  schemes): the input columns are stored permuted so that each group is contiguous, and ``perm`` int64
  (in,) says which input column each stored column is; the layer multiplies ``x[..., perm]``.
* ``fp32`` / ``fp16`` / ``bf16``: plain ``weight``.
* ``gguf``  a GGUF tensor in its file's own blocks, for any type of :data:`GGUF_BLOCKS` (the scheme's
  ``gguf_type``): ``blocks`` uint8 (out, in / block * bytes), the file's bytes as they are. Its values
  are the ones ``gguf.quants.dequantize`` gives (K-quants' product scales formed in fp32, where they are
  exact); the kernels decode the blocks as they multiply (``quant/csrc/gguf_blocks_mm.cpp``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from localllm.errors import LocalLLMError

FLOAT_SCHEMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_SCHEMES = ("int8", "int4", "nf4")
ALL_SCHEMES = (*FLOAT_SCHEMES, *QUANT_SCHEMES)
DEFAULT_GROUP = {"int4": 32, "int8": None, "nf4": 64}
#: Integer grids with zero points, read from the Hub's quantized formats (never a ``--quant`` choice).
ZERO_POINT_SCHEMES = ("int4z", "int8z")
#: FP8 weights with fp32 scales, read from the Hub (never a ``--quant`` choice).
FP8 = "fp8"
#: The group sizes int4 takes and the block sizes nf4 takes (int8 takes any multiple of 16, or none).
GROUP_SIZES = (32, 64, 128, 256)
#: GGUF tensor types the ``gguf`` scheme keeps as they are: name -> (ggml type id, weights a block,
#: bytes a block). The layouts are ggml's (see quant/csrc/gguf_blocks_mm.cpp for each).
GGUF_BLOCKS = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "BF16": (30, 1, 2),
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "IQ4_NL": (20, 32, 18), "MXFP4": (39, 32, 17),
    "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}

# bitsandbytes' NF4 code book (the quantiles of a unit normal, scaled to [-1, 1]).
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230731010437, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])


@dataclass(frozen=True)
class QuantScheme:
    """A weight format: its name and parameters (recorded in the artifact's manifest)."""

    name: str
    group_size: int | None = None  # int4: group; int8: None = per output channel; nf4: blocksize
    symmetric: bool = False  # int4 only
    gguf_type: str | None = None  # gguf only: the GGUF tensor type whose blocks it keeps ("Q4_K")
    #: Input columns stored permuted (a GPTQ ``desc_act`` layer): a ``perm`` buffer gathers x.
    act_order: bool = False

    @property
    def is_float(self) -> bool:
        return self.name in FLOAT_SCHEMES

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["gguf_type"] is None:
            del d["gguf_type"]  # the manifests of the other schemes, as they were
        if not d["act_order"]:
            del d["act_order"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantScheme":
        if d["name"] == "gguf":
            return gguf_scheme(d["gguf_type"])
        if d["name"] in ZERO_POINT_SCHEMES:
            return zero_point_scheme(d["name"], d.get("group_size"), d.get("act_order", False))
        if d["name"] == FP8:
            return fp8_scheme(d.get("group_size"))
        scheme = parse_scheme(d["name"], d.get("group_size"), d.get("symmetric", False))
        return replace(scheme, act_order=True) if d.get("act_order") else scheme

    def label(self) -> str:
        order = ", act order" if self.act_order else ""
        if self.name == "int4":
            return f"int4 (group {self.group_size}, {'symmetric' if self.symmetric else 'asymmetric'}{order})"
        if self.name == "int8":
            return f"int8 ({'per channel' if self.group_size is None else f'group {self.group_size}'}{order})"
        if self.name == "nf4":
            return f"nf4 (block {self.group_size})"
        if self.name == "gguf":
            return f"{self.gguf_type} blocks (as in the file)"
        if self.name == FP8:
            return f"fp8 e4m3 ({'per channel' if self.group_size is None else f'blocks of {self.group_size}'})"
        if self.name in ZERO_POINT_SCHEMES:
            group = "per channel" if self.group_size is None else f"group {self.group_size}"
            return f"{self.name[:4]} ({group}, integer zero points{', act order' if self.act_order else ''})"
        return self.name

    def check_layer(self, name: str, in_features: int) -> None:
        """Raise when this scheme cannot hold a layer of width ``in_features``."""
        g = self.group_size
        if g and in_features % g:
            fits = [x for x in GROUP_SIZES if in_features % x == 0]
            raise LocalLLMError(
                f"group size {g} does not divide the input width {in_features} of {name}",
                f"use --group-size {fits[-1]} (fits: {', '.join(map(str, fits))})" if fits else
                f"no {self.name} group size divides it: use --quant int8 (per channel) or a float scheme",
            )


def parse_scheme(name: str, group_size: int | None = None, symmetric: bool = False) -> QuantScheme:
    """Validate a scheme name and its group size (None = the scheme's default)."""
    if name not in ALL_SCHEMES:
        raise LocalLLMError(f"unknown quantization scheme '{name}'", f"use one of {', '.join(ALL_SCHEMES)}")
    if name in FLOAT_SCHEMES:
        return QuantScheme(name)
    group = group_size if group_size is not None else DEFAULT_GROUP[name]
    if name == "int4" and group not in GROUP_SIZES:
        raise LocalLLMError(f"int4 group size {group} is not supported", f"use one of {', '.join(map(str, GROUP_SIZES))}")
    if name == "int8" and group is not None and (group <= 0 or group % 16):
        raise LocalLLMError(f"int8 group size {group} is not supported", "leave it out (per channel) or use 32, 64, 128")
    if name == "nf4" and group not in GROUP_SIZES:
        others = [str(g) for g in GROUP_SIZES if g != DEFAULT_GROUP["nf4"]]
        raise LocalLLMError(f"nf4 block size {group} is not supported",
                            f"use {DEFAULT_GROUP['nf4']} (the default), {', '.join(others[:-1])} or {others[-1]}")
    return QuantScheme(name, group, symmetric if name == "int4" else False)


def zero_point_scheme(name: str, group_size: int | None, act_order: bool = False) -> QuantScheme:
    """An imported integer grid with zero points (``int4z``: any even group; ``int8z``: a group, or
    None for per channel), optionally with its input columns in act order."""
    if name not in ZERO_POINT_SCHEMES:
        raise LocalLLMError(f"unknown zero-point scheme '{name}'", f"use one of {', '.join(ZERO_POINT_SCHEMES)}")
    if name == "int4z" and (group_size is None or group_size <= 0 or group_size % 2):
        raise LocalLLMError(f"int4 with zero points needs an even group size, not {group_size}",
                            "the checkpoint's quantization_config is damaged")
    if group_size is not None and group_size <= 0:
        raise LocalLLMError(f"group size {group_size} is not supported", "the checkpoint's quantization_config is damaged")
    return QuantScheme(name, group_size, False, None, act_order)


def fp8_scheme(group_size: int | None) -> QuantScheme:
    """FP8 e4m3 weights with an fp32 scale per ``group_size`` inputs of a row (None: one a row)."""
    if group_size is not None and group_size <= 0:
        raise LocalLLMError(f"FP8 block size {group_size} is not supported", "the checkpoint's quantization_config is damaged")
    return QuantScheme(FP8, group_size)


def gguf_scheme(type_name: str) -> QuantScheme:
    """The scheme that keeps a GGUF tensor of ``type_name`` in its own blocks (group = block width)."""
    if type_name not in GGUF_BLOCKS:
        raise LocalLLMError(f"GGUF tensor type {type_name} is not supported",
                            f"supported: {', '.join(GGUF_BLOCKS)}")
    return QuantScheme("gguf", GGUF_BLOCKS[type_name][1], False, type_name)


def gguf_row_bytes(type_name: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights in GGUF type ``type_name``."""
    _, block, nbytes = GGUF_BLOCKS[type_name]
    return in_features // block * nbytes


@contextmanager
def quiet_bitsandbytes() -> Iterator[None]:
    """Import (or first use) bitsandbytes without its CPU backend's warning about the optional
    ``kernels`` package (it then uses its own fallback, which the reference check covers). Only that
    logger, only for the block: its level is restored after."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    saved = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(saved)


# ----------------------------------------------------------------------------- int4 packing
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes (out, in) in 0..15 -> uint8 (out, in/2), low nibble first."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (out, in/2) -> codes uint8 (out, in), the inverse of :func:`pack_int4`."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).view(packed.shape[0], -1)


# ----------------------------------------------------------------------------- quantize
def _gguf_quantize(w, type_name: str):  # type: ignore[no-untyped-def]
    """(out, in) float32 numpy -> (out, bytes) uint8 blocks, by the ``gguf`` package's quantizers (which
    have none for the K-quants and IQ4_NL: such a scheme holds imported blocks only)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        raw = gguf.quants.quantize(w, qtype)
    except NotImplementedError:
        raise LocalLLMError(f"localllm cannot quantize weights to {type_name}",
                            "use int4 or int8; GGUF files keep their own blocks") from None
    return raw.view("uint8").reshape(w.shape[0], -1)


def quantize(w: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantization of one weight (out, in) to the scheme's canonical tensors."""
    if scheme.is_float:
        return {"weight": w.to(FLOAT_SCHEMES[scheme.name])}
    w = w.float()
    out, inp = w.shape
    scheme.check_layer("a weight", inp)
    if scheme.name == "int4":
        g = scheme.group_size
        wg = w.view(out, inp // g, g)  # type: ignore[operator]
        if scheme.symmetric:
            scale = (wg.abs().amax(-1) / 7.5).clamp(min=1e-10)  # codes -8..7 around 8: -7.5..7.5 covers absmax
            scale = scale.half().float()
            offset = -8 * scale
        else:
            lo, hi = wg.amin(-1), wg.amax(-1)
            scale = ((hi - lo) / 15).clamp(min=1e-10).half().float()
            offset = lo.half().float()
        q = (wg - offset[..., None]).div_(scale[..., None]).round_().clamp_(0, 15).view(out, inp)  # in place: one temporary
        return {"qweight": pack_int4(q), "scales": scale.half(), "offsets": offset.half()}
    if scheme.name == "int8":
        g = scheme.group_size
        if g is None:
            scale = (w.abs().amax(-1) / 127).clamp(min=1e-10).half().float()  # (out,)
            q = (w / scale[:, None]).round_().clamp_(-127, 127)
        else:
            wg = w.view(out, inp // g, g)
            scale = (wg.abs().amax(-1) / 127).clamp(min=1e-10).half().float()  # (out, in/g)
            q = (wg / scale[..., None]).round_().clamp_(-127, 127).view(out, inp)
        return {"qweight": q.to(torch.int8), "scales": scale.half()}
    if scheme.name == "nf4":
        with quiet_bitsandbytes():
            import bitsandbytes.functional as bnbf

        packed, state = bnbf.quantize_4bit(w, blocksize=scheme.group_size, quant_type="nf4")
        return {"qweight": packed.view(out, inp // 2), "absmax": state.absmax.float().view(out, -1)}
    if scheme.name == "gguf":
        return {"blocks": torch.from_numpy(_gguf_quantize(w.numpy(), scheme.gguf_type))}  # type: ignore[arg-type]
    raise LocalLLMError(f"unknown quantization scheme '{scheme.name}'")


def dequantize(t: dict[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: canonical tensors -> weight (out, in) in ``dtype``."""
    if scheme.is_float:
        return t["weight"].to(dtype)
    if scheme.name == "int4":
        q = unpack_int4(t["qweight"]).float()  # (out, in)
        out, inp = q.shape
        g = scheme.group_size
        w = q.view(out, inp // g, g) * t["scales"].float()[..., None] + t["offsets"].float()[..., None]  # type: ignore[operator]
        return w.view(out, inp).to(dtype)
    if scheme.name == "int8":
        q = t["qweight"].float()
        s = t["scales"].float()
        if s.dim() == 1:
            return (q * s[:, None]).to(dtype)
        out, inp = q.shape
        return (q.view(out, s.shape[1], -1) * s[..., None]).view(out, inp).to(dtype)
    if scheme.name in ZERO_POINT_SCHEMES:
        q = unpack_int4(t["qweight"]) if scheme.name == "int4z" else t["qweight"]
        out, inp = q.shape
        s, z = t["scales"].float(), t["zeros"].float()
        groups = 1 if s.dim() == 1 else s.shape[1]
        # (q - z) * s: an integer of at most 9 bits times an fp16 scale, exact in fp32
        w = (q.float().view(out, groups, -1) - z.view(out, groups, 1)) * s.view(out, groups, 1)
        return w.view(out, inp).to(dtype)
    if scheme.name == FP8:
        w = t["qweight"].float()  # (out, in): fp8 values, exact in fp32
        s = t["scales"].float()  # (out, groups)
        out, inp = w.shape
        return (w.view(out, s.shape[1], -1) * s.unsqueeze(-1)).view(out, inp).to(dtype)
    if scheme.name == "nf4":
        packed = t["qweight"]
        out = packed.shape[0]
        codes = torch.stack([packed >> 4, packed & 0x0F], dim=-1).view(out, -1).long()  # high nibble first
        vals = NF4_CODE.to(packed.device)[codes]  # (out, in)
        absmax = t["absmax"].float()
        return (vals.view(out, absmax.shape[1], -1) * absmax[..., None]).view(out, -1).to(dtype)
    if scheme.name == "gguf":
        import gguf

        blocks = t["blocks"]
        qtype = gguf.GGMLQuantizationType[scheme.gguf_type]  # type: ignore[misc]
        w = torch.from_numpy(gguf.quants.dequantize(blocks.cpu().numpy(), qtype))  # (out, in) fp32
        return w.to(device=blocks.device, dtype=dtype)
    raise LocalLLMError(f"unknown quantization scheme '{scheme.name}'")


def dequantize_weight(t: dict[str, torch.Tensor], scheme: QuantScheme,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight (out, in) with its input columns in their own order: :func:`dequantize` (which gives
    the stored order the kernels multiply in), with an act-order layer's columns put back by ``perm``."""
    w = dequantize(t, scheme, dtype)
    if not scheme.act_order:
        return w
    out = torch.empty_like(w)
    out[:, t["perm"]] = w  # stored column j is input column perm[j]
    return out


def act_order_shapes(scheme: QuantScheme, inp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The ``perm`` buffer of a layer whose input columns are stored in act order (else nothing)."""
    return {"perm": ((inp,), torch.int64)} if scheme.act_order else {}


def canonical_shapes(scheme: QuantScheme, out: int, inp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of the canonical tensors of an (out, in) weight."""
    g = scheme.group_size
    if scheme.is_float:
        return {"weight": ((out, inp), FLOAT_SCHEMES[scheme.name])}
    if scheme.name == "int4":
        return {"qweight": ((out, inp // 2), torch.uint8), "scales": ((out, inp // g), torch.float16),  # type: ignore[operator]
                "offsets": ((out, inp // g), torch.float16), **act_order_shapes(scheme, inp)}  # type: ignore[operator]
    if scheme.name == "int8":
        return {"qweight": ((out, inp), torch.int8),
                "scales": (((out,) if g is None else (out, inp // g)), torch.float16), **act_order_shapes(scheme, inp)}
    if scheme.name == "gguf":
        return {"blocks": ((out, gguf_row_bytes(scheme.gguf_type, inp)), torch.uint8)}  # type: ignore[arg-type]
    if scheme.name == FP8:
        return {"qweight": ((out, inp), torch.float8_e4m3fn),
                "scales": ((out, 1 if g is None else inp // g), torch.float32)}
    if scheme.name in ZERO_POINT_SCHEMES:
        per = (out,) if g is None else (out, inp // g)
        four = scheme.name == "int4z"
        shapes = {"qweight": ((out, inp // 2) if four else (out, inp), torch.uint8),
                  "scales": (per, torch.float16), "zeros": (per, torch.uint8 if four else torch.int16)}
        return {**shapes, **act_order_shapes(scheme, inp)}
    return {"qweight": ((out, inp // 2), torch.uint8), "absmax": ((out, inp // g), torch.float32)}  # type: ignore[operator]
