"""The Hub's packed integer formats (GPTQ, AWQ, compressed-tensors) turned into localllm's canonical
tensors exactly: the unpack math, one layer at a time. Which format a checkpoint holds, and which of
its tensors form a layer, is :mod:`loaders.hub_quant`'s business; this module knows no files.

Every format here means ``w = (q - z) * s`` per group of input columns: q an unsigned code, z an
integer zero point, s a 16-bit scale. The values a format defines are that product, which is exact in
fp32 (at most 9 + 11 significant bits); the libraries' own fp16 dequantization is it rounded once to
fp16. Where each lands (:func:`to_canonical`):

* symmetric 4-bit (every zero 8) in a group int4 takes (32..256): ``int4``, offsets ``-8 * s``, exact
  in fp16 (a power-of-two multiple); it runs on every int4 kernel.
* any other 4-bit grid (AWQ, asymmetric GPTQ or compressed-tensors, per-channel groups): ``int4z``,
  the zeros kept as integers (``quant.formats``). Its offset ``-z * s`` has up to 4 + 11 significant
  bits, which fp16 offsets cannot hold and fp32 can: the CPU kernel (:class:`quant.tile_kernels.Int4ZerosCPU`)
  keeps ``-z`` (exact in fp16) where int4's tiles keep the offsets and forms each ``-z * s`` in fp32
  as it loads the scales. On CUDA (:class:`quant.cuda_kernels.Int4ZerosTritonCUDA`) the int4 Triton kernel loads the offsets in
  fp32.
* 8-bit: symmetric (every zero 128) as ``int8`` (codes ``q - 128`` in -128..127, exact), else ``int8z``
  (reference kernel).
* GPTQ ``desc_act``: ``g_idx`` assigns each input column its group in an order of its own. The columns
  are stored sorted by group (a stable argsort, so each group is contiguous) and ``perm`` records the
  order; the layer gathers its input by it (one gather per matmul). Nothing is re-rounded.

Scales must be exact in fp16 (GPTQ and AWQ store fp16; compressed-tensors stores the model's dtype,
bf16 of which fp16 holds every normal value above 2^-17): one that is not is refused, never rounded.
"""

from __future__ import annotations

import torch

from localllm.errors import LocalLLMError
from localllm.quant.formats import GROUP_SIZES, QuantScheme, pack_int4, parse_scheme, zero_point_scheme

#: AutoAWQ's GEMM packing: nibble k (bits 4k..4k+3) of an int32 holds output column 8c + AWQ_ORDER[k].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32/bits codes each, the k-th at bits [k*bits, (k+1)*bits), packed along
    ``dim`` (0: word i holds codes of rows i*n .. i*n + n - 1; 1: of columns) -> uint8 / int16 codes,
    ``dim`` n times longer. (GPTQ's qweight along dim 0, its qzeros along 1; compressed-tensors' values
    along 1 and zero points along 0: all the same little-endian order.)"""
    if packed.dtype != torch.int32:
        raise LocalLLMError(f"packed tensor has dtype {packed.dtype}, expected int32", "the checkpoint is damaged")
    n = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)  # (n,)
    words = packed.unsqueeze(-1) if dim == 1 else packed.unsqueeze(1)
    codes = (words >> (shifts if dim == 1 else shifts.view(1, n, 1))) & ((1 << bits) - 1)
    shape = (packed.shape[0], packed.shape[1] * n) if dim == 1 else (packed.shape[0] * n, packed.shape[1])
    return codes.reshape(shape).to(torch.uint8 if bits <= 8 else torch.int16)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM int32 (rows, cols/8) -> uint8 codes (rows, cols), undoing its nibble order."""
    nibbles = unpack_int32(packed, 4, 1).view(packed.shape[0], -1, 8)  # (rows, cols/8, 8), nibble k
    out = torch.empty_like(nibbles)
    out[..., list(AWQ_ORDER)] = nibbles  # nibble k holds column AWQ_ORDER[k]
    return out.view(packed.shape[0], -1)


def exact_fp16(s: torch.Tensor, what: str) -> torch.Tensor:
    """``s`` as fp16, refusing any value that fp16 does not hold exactly."""
    h = s.to(torch.float16)
    if s.dtype != torch.float16 and not torch.equal(h.float(), s.float()):
        bad = (h.float() != s.float()).sum().item()
        raise LocalLLMError(f"{what}: {bad} scale(s) are not exact in fp16 ({s.dtype}), which localllm's "
                            "integer formats hold them in", "pull the model's float (or GGUF) repo instead")
    if not torch.isfinite(h).all():
        raise LocalLLMError(f"{what}: scales are not finite", "the checkpoint is damaged")
    return h


def group_order(g_idx: torch.Tensor | None, in_features: int, group: int, what: str) -> torch.Tensor | None:
    """The permutation that makes each group's columns contiguous (None: ``g_idx`` is the plain
    ``i // group``, or absent). Each group must hold exactly ``group`` columns."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64).view(-1)
    if g_idx.numel() != in_features:
        raise LocalLLMError(f"{what}: g_idx has {g_idx.numel()} entries for {in_features} inputs",
                            "the checkpoint is damaged")
    plain = torch.arange(in_features) // group
    if torch.equal(g_idx, plain):
        return None
    counts = torch.bincount(g_idx, minlength=in_features // group)
    if g_idx.min() < 0 or counts.numel() != in_features // group or not (counts == group).all():
        raise LocalLLMError(f"{what}: g_idx does not assign {group} columns to each group",
                            "the checkpoint is damaged")
    return torch.argsort(g_idx, stable=True)


def int_scheme(bits: int, group: int | None, symmetric: bool, in_features: int, act_order: bool) -> QuantScheme:
    """The localllm scheme an integer grid lands on exactly (see the module's docstring). ``group``
    None means per output channel (one group of the whole row)."""
    g = group if group is not None else in_features
    if bits == 4:
        if symmetric and g in GROUP_SIZES:
            scheme = parse_scheme("int4", g, symmetric=True)
            return QuantScheme(scheme.name, scheme.group_size, True, None, act_order)
        return zero_point_scheme("int4z", g, act_order)
    if bits == 8:
        per = None if g == in_features else g
        if symmetric and (per is None or per % 16 == 0):
            scheme = parse_scheme("int8", per)
            return QuantScheme(scheme.name, scheme.group_size, False, None, act_order)
        return zero_point_scheme("int8z", per, act_order)
    raise LocalLLMError(f"{bits}-bit integer weights are not supported", "use a 4-bit or 8-bit checkpoint")


def to_canonical(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, scheme: QuantScheme, bits: int,
                 perm: torch.Tensor | None, what: str) -> dict[str, torch.Tensor]:
    """Codes q (out, in) unsigned, zeros z (out, groups) integers, scales s (out, groups) -> ``scheme``'s
    canonical tensors, with ``w = (q - z) * s`` unchanged (q's columns taken in ``perm`` order when given,
    groups then contiguous in that order). Raises where ``scheme`` cannot hold the grid exactly."""
    out, inp = q.shape
    if perm is not None:
        q = q.index_select(1, perm)
    s16 = exact_fp16(s, what)
    z = z.to(torch.int16)
    if perm is not None and not scheme.act_order:
        raise LocalLLMError(f"{what}: g_idx orders its groups, but the config does not say desc_act",
                            "the checkpoint's quantization_config does not match its weights")
    extra = {"perm": torch.arange(inp) if perm is None else perm.to(torch.int64)} if scheme.act_order else {}
    mid = 1 << (bits - 1)
    if scheme.name in ("int4", "int8") and not bool((z == mid).all()):
        raise LocalLLMError(f"{what}: the config says symmetric, but its zero points are not all {mid}",
                            "the checkpoint's quantization_config does not match its weights")
    if scheme.name == "int4":
        return {"qweight": pack_int4(q), "scales": s16, "offsets": (-8 * s16.float()).half(), **extra}
    if scheme.name == "int8":
        codes = (q.to(torch.int16) - mid).to(torch.int8)
        return {"qweight": codes, "scales": s16.view(out) if scheme.group_size is None else s16, **extra}
    if scheme.name == "int4z":
        if z.min() < 0 or z.max() > 16:
            raise LocalLLMError(f"{what}: zero points outside 0..16", "the checkpoint is damaged")
        return {"qweight": pack_int4(q), "scales": s16, "zeros": z.to(torch.uint8), **extra}
    if scheme.name == "int8z":
        per = (out,) if scheme.group_size is None else tuple(s16.shape)
        return {"qweight": q.to(torch.uint8), "scales": s16.reshape(per), "zeros": z.reshape(per), **extra}
    raise LocalLLMError(f"{what}: no exact import into {scheme.label()}")


def gptq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int,
               v1: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's tensors -> codes (out, in), zeros (out, groups), scales (out, groups).

    ``qweight`` int32 (in * bits/32, out), codes packed along the input; ``qzeros`` int32 (groups,
    out * bits/32) packed along the output; ``scales`` (groups, out). ``v1`` (``checkpoint_format:
    gptq``, and every AutoGPTQ checkpoint): the stored zero is z - 1 (AutoGPTQ's reference adds 1 back,
    so a stored 15 means 16); gptq_v2 stores z."""
    q = unpack_int32(qweight, bits, 0).t()  # (out, in)
    z = unpack_int32(qzeros, bits, 1).to(torch.int16).t()  # (out, groups)
    if v1:
        z = z + 1
    return q.contiguous(), z.contiguous(), scales.t().contiguous()


def awq_codes(qweight: torch.Tensor, qzeros: torch.Tensor,
              scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM's tensors -> codes (out, in), zeros (out, groups), scales (out, groups).

    ``qweight`` int32 (in, out/8) and ``qzeros`` int32 (groups, out/8), both packed along the output in
    :data:`AWQ_ORDER`; ``scales`` (groups, out)."""
    return (unpack_awq(qweight).t().contiguous(), unpack_awq(qzeros).to(torch.int16).t().contiguous(),
            scales.t().contiguous())


def ct_codes(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int,
             shape: tuple[int, int], packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' tensors -> codes (out, in) unsigned, zeros (out, groups), scales (out, groups).

    ``packed`` (``pack-quantized``): ``weight_packed`` int32 (out, in * bits/32) holds each signed value
    plus 2^(bits-1) along the input, and an asymmetric ``weight_zero_point`` is packed the same way along
    the output (int32 (out * bits/32, groups)); else (``naive-quantized``) the values and zero points are
    int8 as they are. ``scale``: (out, groups) per group, (out, 1) per channel, one value per tensor. The
    library's ``dequantize`` computes ``(x_q - zero_point) * scale``: with both shifted by 2^(bits-1),
    the same product."""
    out, inp = shape
    mid = 1 << (bits - 1)
    if packed:
        q = unpack_int32(values, bits, 1)[:, :inp]
    else:
        q = (values.to(torch.int16) + mid).to(torch.uint8)
    s = scale.reshape(out, -1) if scale.numel() > 1 else scale.reshape(1, 1).expand(out, 1)
    groups = s.shape[1]
    if zero_point is None:
        z = torch.full((out, groups), mid, dtype=torch.int16)
    elif packed:
        z = unpack_int32(zero_point, bits, 0)[:out].to(torch.int16).reshape(out, groups)
    else:
        z = zero_point.to(torch.int16).reshape(out, -1).expand(out, groups) + mid
    return q.contiguous(), z.contiguous(), s.contiguous()


def bnb_nf4_canonical(packed: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor,
                      nested_absmax: torch.Tensor | None, nested_quant_map: torch.Tensor | None,
                      state: dict, what: str) -> dict[str, torch.Tensor]:
    """bitsandbytes' serialized 4-bit NormalFloat -> the ``nf4`` scheme's canonical tensors.

    ``packed`` uint8 (out * in / 2, 1): the flattened weight's codes, high nibble first, as the
    ``nf4`` scheme holds them; ``absmax`` fp32 per block of ``state["blocksize"]``, or (double
    quantization) uint8 codes of ``nested_quant_map`` times ``nested_absmax`` per block of
    ``state["nested_blocksize"]`` plus ``state["nested_offset"]``, formed in fp32 as bitsandbytes'
    ``dequantize_blockwise`` forms them (one product, one sum: the same bits)."""
    from localllm.quant.formats import NF4_CODE

    if state.get("quant_type") != "nf4" or not torch.equal(quant_map.float(), NF4_CODE):
        raise LocalLLMError(f"{what}: bitsandbytes {state.get('quant_type')} weights are not NormalFloat-4",
                            "pull the model's float repo or a GGUF file of it")
    out, inp = (int(v) for v in state["shape"])
    block = int(state["blocksize"])
    if inp % block or packed.numel() * 2 != out * inp:
        raise LocalLLMError(f"{what}: a {out}x{inp} weight in blocks of {block} does not fit its rows",
                            "pull the model's float repo or a GGUF file of it")
    if nested_absmax is not None:
        nested = int(state["nested_blocksize"])
        codes = absmax.long()
        scale = nested_absmax.float().repeat_interleave(nested)[: codes.numel()]
        absmax = nested_quant_map.float()[codes] * scale  # type: ignore[index]
        absmax = absmax + torch.tensor(float(state["nested_offset"]), dtype=torch.float32)
    return {"qweight": packed.view(out, inp // 2), "absmax": absmax.float().view(out, inp // block)}


def fp8_canonical(weight: torch.Tensor, scale_inv: torch.Tensor, scheme: QuantScheme,
                  block_rows: int | None, what: str) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's linear (``weight`` float8_e4m3fn (out, in) and ``weight_scale_inv``: one
    value, one a row, or one a ``block_rows`` x group block) -> the ``fp8`` scheme's tensors: the fp8
    values as they are, each block's scale on each of its rows (a copy, exact), in fp32."""
    if weight.dtype != torch.float8_e4m3fn:
        raise LocalLLMError(f"{what}: FP8 weight has dtype {weight.dtype}, expected float8_e4m3fn",
                            "pull the model's float repo or a GGUF file of it")
    out, inp = weight.shape
    s = scale_inv.float()
    if s.numel() == 1:
        scales = s.reshape(1, 1).expand(out, 1)
    elif scheme.group_size is None:
        scales = s.reshape(out, 1)
    else:
        g, rows = scheme.group_size, block_rows or 1
        if inp % g or s.shape != (-(-out // rows), inp // g):
            raise LocalLLMError(f"{what}: FP8 scales {tuple(s.shape)} do not fit a {out}x{inp} weight in "
                                f"{rows}x{g} blocks", "the checkpoint is damaged")
        scales = s.repeat_interleave(rows, dim=0)[:out]
    if not torch.isfinite(scales).all():
        raise LocalLLMError(f"{what}: FP8 scales are not finite", "the checkpoint is damaged")
    return {"qweight": weight, "scales": scales.contiguous()}


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor, what: str) -> torch.Tensor:
    """The HF checkpoint's MXFP4 (gpt-oss's experts: ``*_blocks`` uint8 (..., rows, groups, 16),
    ``*_scales`` uint8 (..., rows, groups)) -> GGUF MXFP4 blocks uint8 (..., rows, groups * 17), the
    ``gguf`` scheme's ``MXFP4`` bytes: the same values, so one kernel multiplies both.

    Each group is 32 consecutive input columns of a row. The checkpoint holds column 2j in byte j's low
    nibble and 2j + 1 in its high one; a GGUF block holds column j low and j + 16 high, after its scale
    byte. The scale byte is kept as it is: transformers' value is ``FP4_VALUES[q] * 2^(s - 127)`` and
    ggml's ``kvalues_mxfp4[q] * 2^(e - 128)`` with code values doubled, the same product for e = s. (The
    one difference: code 8 is -0.0 in transformers, +0.0 in ggml; they add the same to any sum.) Rows
    stay whole rows of whole blocks, so any gather of rows (gpt-oss's interleaved gate and up) is exact."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise LocalLLMError(f"{what}: MXFP4 blocks and scales are {blocks.dtype} and {scales.dtype}, expected uint8",
                            "the checkpoint is damaged")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise LocalLLMError(f"{what}: MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
                            "(blocks must be (..., groups, 16) beside scales (..., groups))", "the checkpoint is damaged")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # (..., groups, 32), column order
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # (..., groups, 16): column j low nibble, j + 16 high
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).flatten(-2)  # (..., rows, groups * 17)
