"""The Hub's quantized formats read exactly (quant/hub_formats.py, loaders/hub_quant.py).

GPTQ and AWQ fixtures are written here as their libraries pack them (AutoGPTQ's ``QuantLinear.pack``
and AutoAWQ's ``WQLinear_GEMM.from_linear``, which do not install on this machine), and each has its
reference dequantization written from that published layout, independently of localllm's unpacking.
compressed-tensors fixtures and their reference are the library's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from localllm.errors import LocalLLMError
from localllm.loaders.hub_quant import HubQuant, layer_canonical, read_hub_quant
from localllm.quant.formats import QuantScheme, dequantize
from localllm.quant.formats import dequantize_weight as float_weight
from localllm.quant.linear import QuantLinear
from tests.conftest import make_hf_model, write_tiny_tokenizer
from tests.hub_server import HubServer, hub_fixture

__all__ = ["hub_fixture"]  # the `hub` fixture: a Hub-protocol server, the client pointed at it

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# ============================================================================ fixture writers
def _int32(words: np.ndarray) -> torch.Tensor:
    """uint64 accumulators of 32-bit words -> int32 as the libraries store them (the top bit wraps)."""
    return torch.from_numpy((words & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def gptq_pack(w: torch.Tensor, bits: int, group: int, sym: bool, desc_act: bool, v1: bool,
              seed: int = 0) -> dict[str, torch.Tensor]:
    """A linear (out, in) quantized and packed as AutoGPTQ / GPTQModel write it (round to nearest;
    GPTQ's error feedback changes the codes, not the layout)."""
    out_f, in_f = w.shape
    g = in_f if group == -1 else group
    maxq = 2**bits - 1
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(in_f, generator=gen) if desc_act else torch.arange(in_f)
    g_idx = torch.empty(in_f, dtype=torch.int64)
    g_idx[perm] = torch.arange(in_f) // g  # the i-th column processed falls in group i // g
    groups = in_f // g
    scales = torch.empty(groups, out_f, dtype=torch.float16)
    zeros = torch.empty(groups, out_f, dtype=torch.int64)
    for k in range(groups):
        cols = w[:, perm[k * g:(k + 1) * g]].double()
        xmin, xmax = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)  # GPTQ's Quantizer
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        scale = ((xmax - xmin) / maxq).clamp(min=1e-8)
        zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-xmin / scale)
        if v1:
            zero = zero.clamp(min=1)  # a v1 file cannot store zero 0 (it wraps to -1)
        scales[k], zeros[k] = scale.half(), zero.long()
    s = scales.double()[g_idx].t()  # (out, in)
    z = zeros[g_idx].t().double()
    intweight = torch.clamp(torch.round(w.double() / s) + z, 0, maxq).long().t().numpy().astype(np.uint64)  # (in, out)
    pf = 32 // bits
    qweight = np.zeros((in_f // pf, out_f), dtype=np.uint64)
    for k in range(pf):
        qweight |= intweight[k::pf] << np.uint64(bits * k)
    stored = (zeros - 1 if v1 else zeros).numpy().astype(np.uint64)
    qzeros = np.zeros((groups, out_f // pf), dtype=np.uint64)
    for k in range(pf):
        qzeros |= stored[:, k::pf] << np.uint64(bits * k)
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": scales,
            "g_idx": g_idx.to(torch.int32)}


def gptq_reference(t: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    """AutoGPTQ's torch dequantization, in float64: w[i, j] = (q[i, j] - z[g_idx[i], j]) * s[g_idx[i], j]."""
    pf, mask = 32 // bits, 2**bits - 1
    qw = t["qweight"].numpy().view(np.uint32).astype(np.int64)
    qz = t["qzeros"].numpy().view(np.uint32).astype(np.int64)
    q = np.stack([(qw >> (bits * k)) & mask for k in range(pf)], axis=1).reshape(-1, qw.shape[1])  # (in, out)
    z = np.stack([(qz >> (bits * k)) & mask for k in range(pf)], axis=2).reshape(qz.shape[0], -1)  # (G, out)
    z = z + 1 if v1 else z
    g = t["g_idx"].numpy().astype(np.int64)
    s = t["scales"].double().numpy()
    return torch.from_numpy((q - z[g]) * s[g]).t()  # (out, in)


def awq_pack(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """A linear quantized and packed as AutoAWQ's ``WQLinear_GEMM.from_linear`` writes it."""
    out_f, in_f = w.shape
    wg = w.double().view(out_f, in_f // group, group)
    mn, mx = wg.amin(-1), wg.amax(-1)
    scales = ((mx - mn).clamp(min=1e-5) / 15).half()  # (out, G)
    zeros = torch.round(-mn / scales.double()).clamp(0, 15)
    q = torch.clamp(torch.round(wg / scales.double()[..., None]) + zeros[..., None], 0, 15).view(out_f, in_f)
    intweight = q.long().t().numpy().astype(np.uint64)  # (in, out)
    qweight = np.zeros((in_f, out_f // 8), dtype=np.uint64)
    for col in range(out_f // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << np.uint64(i * 4)
    iz = zeros.long().t().numpy().astype(np.uint64)  # (G, out)
    qzeros = np.zeros((in_f // group, out_f // 8), dtype=np.uint64)
    for col in range(out_f // 8):
        for i in range(8):
            qzeros[:, col] |= iz[:, col * 8 + AWQ_ORDER[i]] << np.uint64(i * 4)
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": scales.t().contiguous()}


def awq_reference(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """AutoAWQ's ``dequantize_gemm`` in float64: unpack, undo the order, (q - z) * s per group."""
    def unpack(x: torch.Tensor) -> np.ndarray:
        v = x.numpy().view(np.uint32).astype(np.int64)
        nib = np.stack([(v >> (4 * i)) & 15 for i in range(8)], axis=2)  # nibble i of column c
        out = np.empty_like(nib)
        for i in range(8):
            out[:, :, AWQ_ORDER[i]] = nib[:, :, i]
        return out.reshape(v.shape[0], -1)

    q, z = unpack(t["qweight"]), unpack(t["qzeros"])  # (in, out), (G, out)
    s = t["scales"].double().numpy()
    rows = np.arange(q.shape[0]) // group
    return torch.from_numpy((q - z[rows]) * s[rows]).t()


def ct_compress(w: torch.Tensor, bits: int, strategy: str, symmetric: bool, fmt: str, group: int = 32,
                scale_dtype: torch.dtype = torch.bfloat16):
    """compressed-tensors' own compressor: (its state dict, its scheme)."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group if strategy == "group" else None)
    out_f, in_f = w.shape
    if strategy == "group":
        view = w.view(out_f, in_f // group, group)
        mn, mx = view.amin(-1), view.amax(-1)
    elif strategy == "channel":
        mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        mn, mx = w.amin().reshape(1), w.amax().reshape(1)
    scale, zp = calculate_qparams(mn, mx, args)
    sd = {"weight": w, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zp}
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = PackedQuantizationCompressor if fmt == "pack-quantized" else NaiveQuantizationCompressor
    return compressor.compress(sd, scheme), scheme, compressor


def ct_config(bits: int, strategy: str, symmetric: bool, fmt: str, group: int = 32) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
                "group_size": group if strategy == "group" else None, "actorder": None, "dynamic": False},
                "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head"], "sparsity_config": {}}


def weight(out_f: int = 48, in_f: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[:, :16] *= 4  # some groups much wider than others
    return w


def canonical_of(hq: HubQuant, tensors: dict[str, torch.Tensor], in_f: int):
    scheme = hq.scheme(in_f)
    return scheme, layer_canonical(hq, tensors, scheme, "layer")


# ============================================================================ one layer, exactly
@pytest.mark.parametrize("bits,group,sym,desc_act,v1", [
    (4, 32, True, False, True), (4, 32, True, True, True), (4, 64, False, True, False),
    (4, 128, False, False, True), (4, -1, True, False, False), (4, 16, True, False, True),
    (8, 32, True, True, True), (8, -1, True, False, False), (8, 32, False, False, True),
])
def test_gptq_layer_equals_its_reference_bit_for_bit(bits, group, sym, desc_act, v1):
    w = weight()
    t = gptq_pack(w, bits, group, sym, desc_act, v1)
    hq = HubQuant("gptq", bits, None if group == -1 else group, sym, desc_act, "gptq" if v1 else "gptq_v2")
    scheme, canonical = canonical_of(hq, t, w.shape[1])
    expected = gptq_reference(t, bits, v1)
    assert (expected.float().double() == expected).all()  # the values are exact in fp32
    got = float_weight(canonical, scheme)
    assert torch.equal(got, expected.float())
    assert torch.equal(got.half(), expected.half())  # the libraries' fp16 dequantization: one rounding of it
    want = {(4, True): "int4", (4, False): "int4z", (8, True): "int8", (8, False): "int8z"}[(bits, sym)]
    if bits == 4 and sym and (group if group > 0 else w.shape[1]) not in (32, 64, 128, 256):
        want = "int4z"  # a group int4 does not take: zero points of 8
    assert scheme.name == want and scheme.act_order == desc_act
    # the quantization is not trivial: it differs from the float weight, by about a step
    err = (got - w).abs().max().item()
    assert 0 < err < 0.15


def test_gptq_act_order_is_a_column_permutation_the_layer_applies():
    w = weight()
    t = gptq_pack(w, 4, 32, False, True, False)
    hq = HubQuant("gptq", 4, 32, False, True, "gptq_v2")
    scheme, canonical = canonical_of(hq, t, w.shape[1])
    perm = canonical["perm"]
    assert not torch.equal(perm, torch.arange(w.shape[1]))
    stored = dequantize(canonical, scheme)  # (out, in) columns in act order
    groups = t["g_idx"].long()[perm]
    assert torch.equal(groups, torch.arange(w.shape[1]) // 32)  # each group contiguous
    layer = QuantLinear(w.shape[1], w.shape[0], scheme)
    for k, v in canonical.items():
        setattr(layer, k, v)
    layer.prepare(torch.float32)
    x = torch.randn(3, w.shape[1])
    want = x.double() @ gptq_reference(t, 4, False).t()
    err = ((layer(x).double() - want).norm() / want.norm()).item()
    assert err < 1e-4, err  # a wrong order costs ~100%; the kernel's int16 activations ~1e-5
    assert stored.shape == w.shape


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_layer_equals_its_reference_bit_for_bit(group):
    w = weight()
    t = awq_pack(w, group)
    hq = read_hub_quant({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": group,
                                                 "zero_point": True, "version": "gemm"}})
    scheme, canonical = canonical_of(hq, t, w.shape[1])
    expected = awq_reference(t, group)
    assert scheme.name == "int4z"
    got = float_weight(canonical, scheme)
    assert torch.equal(got, expected.float())
    assert 0 < (got - w).abs().max().item() < 0.05


def test_awq_nibble_order_matters():
    """Read with plain (GPTQ) nibble order, the same tensors give other weights: the order is tested."""
    w = weight()
    t = awq_pack(w, 32)
    from localllm.quant.hub_formats import unpack_awq, unpack_int32

    assert not torch.equal(unpack_awq(t["qweight"]), unpack_int32(t["qweight"], 4, 1))


@pytest.mark.parametrize("bits,strategy,symmetric,fmt", [
    (4, "group", True, "pack-quantized"), (4, "group", False, "pack-quantized"),
    (4, "channel", True, "pack-quantized"), (4, "channel", False, "pack-quantized"),
    (4, "tensor", True, "pack-quantized"), (8, "group", True, "pack-quantized"),
    (8, "channel", False, "pack-quantized"), (4, "group", False, "naive-quantized"),
    (8, "channel", True, "naive-quantized"),
])
def test_compressed_tensors_layer_equals_the_library(bits, strategy, symmetric, fmt):
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    w = weight()
    state, scheme_ct, compressor = ct_compress(w, bits, strategy, symmetric, fmt)
    hq = read_hub_quant({"quantization_config": ct_config(bits, strategy, symmetric, fmt)})
    scheme, canonical = canonical_of(hq, dict(state), w.shape[1])
    got = float_weight(canonical, scheme)
    # the library's own decompression (in its scale dtype: one rounding of the exact product)
    theirs = compressor.decompress(dict(state), scheme_ct)["weight"]
    assert torch.equal(got.to(theirs.dtype), theirs)
    # and the exact product: the library's dequantize with the scales in fp32
    unpacked = compressor.decompress  # noqa: F841 (documentation: the codes below are the library's)
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    if fmt == "pack-quantized":
        codes = unpack_from_int32(state["weight_packed"], bits, torch.Size(w.shape))
        zp = state.get("weight_zero_point")
        if zp is not None:
            zp = unpack_from_int32(zp, bits, torch.Size((w.shape[0], state["weight_scale"].shape[-1])), packed_dim=0)
    else:
        codes, zp = state["weight"], state.get("weight_zero_point")
    exact = ct_dequantize(codes, state["weight_scale"].float(), zp, scheme_ct.weights, dtype=torch.float32)
    assert torch.equal(got, exact)
    assert 0 < (got - w).abs().max().item() < 0.1


def test_bf16_scales_fp16_cannot_hold_are_refused():
    w = weight()
    state, _, _ = ct_compress(w, 4, "group", True, "pack-quantized")
    state = dict(state)
    state["weight_scale"] = state["weight_scale"].clone()
    state["weight_scale"][0, 0] = torch.tensor(1e-7, dtype=torch.bfloat16)  # below fp16's subnormal grid
    hq = read_hub_quant({"quantization_config": ct_config(4, "group", True, "pack-quantized")})
    with pytest.raises(LocalLLMError, match="not exact in fp16"):
        canonical_of(hq, state, w.shape[1])


def bnb_serialize(w: torch.Tensor, double_quant: bool, block: int = 64):
    """A linear as transformers serializes a bitsandbytes 4-bit one: (leaf -> tensor, bitsandbytes'
    own dequantization of it)."""
    from localllm.quant.formats import quiet_bitsandbytes

    with quiet_bitsandbytes():
        import bitsandbytes.functional as bnbf

        packed, state = bnbf.quantize_4bit(w, blocksize=block, quant_type="nf4", compress_statistics=double_quant)
        reference = bnbf.dequantize_4bit(packed, state)
    return {"weight": packed, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}, reference


@pytest.mark.parametrize("double_quant,block", [(True, 64), (False, 64), (True, 128)])
def test_bitsandbytes_nf4_layer_equals_the_library(double_quant, block):
    from localllm.quant.formats import parse_scheme

    w = weight()
    t, reference = bnb_serialize(w, double_quant, block)
    hq = read_hub_quant({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                 "bnb_4bit_quant_type": "nf4",
                                                 "bnb_4bit_use_double_quant": double_quant}})
    scheme = parse_scheme("nf4", block)
    canonical = layer_canonical(hq, t, scheme, "layer")
    assert canonical["absmax"].dtype == torch.float32
    got = dequantize(canonical, scheme)
    assert torch.equal(got, reference)
    assert 0 < (got - w).abs().max().item() < 0.1


def fp8_quantize(w: torch.Tensor, block: tuple[int, int] | None, per_channel: bool = False):
    """A linear as DeepSeek's / transformers' FP8 checkpoints hold it: e4m3 values and the fp32
    ``weight_scale_inv`` that multiplies them back (per block, channel or tensor)."""
    out_f, in_f = w.shape
    if block is None:
        amax = w.abs().amax(-1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
        scale = (amax / 448).float()
        return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale_inv": scale}
    bo, bi = block
    rows = -(-out_f // bo)
    scale = torch.empty(rows, in_f // bi)
    q = torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(in_f // bi):
            part = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            scale[r, c] = part.abs().amax() / 448
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (part / scale[r, c]).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}


def fp8_reference(t: dict[str, torch.Tensor], block: tuple[int, int] | None) -> torch.Tensor:
    """DeepSeek's ``weight_dequant``: each block's fp8 values times its scale, in fp32."""
    w = t["weight"].float()
    s = t["weight_scale_inv"]
    if block is None:
        return w * (s if s.dim() == 2 else s.reshape(1, 1))
    out = torch.empty_like(w)
    bo, bi = block
    for r in range(s.shape[0]):
        for c in range(s.shape[1]):
            out[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] * s[r, c]
    return out


@pytest.mark.parametrize("block,per_channel", [((128, 128), False), ((64, 32), False), (None, False), (None, True)])
def test_fp8_layer_equals_its_reference_bit_for_bit(block, per_channel):
    w = weight(200, 256)  # 200 rows: a last block of rows only partly full
    t = fp8_quantize(w, block, per_channel)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        qc["weight_block_size"] = list(block)
    hq = read_hub_quant({"quantization_config": qc})
    scheme, canonical = canonical_of(hq, t, w.shape[1])
    assert scheme.name == "fp8" and canonical["qweight"].dtype == torch.float8_e4m3fn
    got = float_weight(canonical, scheme)
    assert torch.equal(got, fp8_reference(t, block))
    assert 0 < (got - w).abs().max().item() < 0.05


# ============================================================================ the int4z kernel
def test_int4z_kernel_is_exact_where_fp16_offsets_are_not():
    """AWQ's offsets -z*s need more bits than fp16 has: the CPU kernel's tiles hold -z, and it makes
    each offset in fp32 from it and the scale, so the product is that of the exact weights (int4's
    kernel with the offsets rounded to fp16 is measurably not)."""
    from localllm.quant import kernels

    w = weight(64, 256, seed=3)
    t = awq_pack(w, 32)
    hq = HubQuant("awq", 4, 32, False, False, "gemm")
    scheme, canonical = canonical_of(hq, t, w.shape[1])
    offsets = -canonical["zeros"].float() * canonical["scales"].float()
    assert (offsets.half().float() != offsets).any()  # fp16 does not hold them
    exact = float_weight(canonical, scheme)
    rounded = kernels.Int4GroupCPU.pack({**canonical, "offsets": offsets.half()})
    layer = QuantLinear(w.shape[1], w.shape[0], scheme)
    for k, v in canonical.items():
        setattr(layer, k, v)
    name = layer.prepare(torch.float32)
    if not kernels.Int4ZerosCPU.supports(layer, torch.device("cpu"), torch.float32):
        pytest.skip("localllm's CPU kernels are not built here")
    assert name == "int4z-group-cpu"
    assert torch.equal(layer.tile_offsets[0, :, 0].float(), -canonical["zeros"][0].float())  # -z, not -z*s
    ops = torch.ops.localllm
    assert torch.equal(ops.int4z_group_dequant(layer.packed, layer.tile_scales, layer.tile_offsets, 32, 64), exact)
    for rows, op in ((1, ops.int4_group_mm), (9, ops.int4_group_gemm)):  # the register kernel, the panel GEMM
        x = torch.randn(rows, w.shape[1], dtype=torch.float64)
        want = x @ exact.double().t()
        got = layer(x.float()).double()
        err = ((got - want).norm() / want.norm()).item()
        assert err < (2e-4 if rows == 1 else 1e-6), err  # the register kernel rounds x to int16 per 32
        fp16_offsets = op(x.float(), rounded["packed"], rounded["tile_scales"], rounded["tile_offsets"], 32, 64).double()
        assert ((fp16_offsets - want).norm() / want.norm()).item() > err  # the exact offsets matter


def test_int4z_triton_kernel_is_exact_in_the_interpreter():
    """CUDA's int4z kernel (fp32 offsets on int4's Triton kernel), run in Triton's interpreter."""
    from localllm import triton_kernels
    from localllm.quant import kernels

    if not triton_kernels.available() or not triton_kernels.interpreting():
        pytest.skip("triton is not installed, or a GPU is here (TRITON_INTERPRET is off)")
    from localllm.quant.int_triton import int_mm

    w = weight(64, 256, seed=5)
    hq = HubQuant("awq", 4, 32, False, False, "gemm")
    scheme, canonical = canonical_of(hq, awq_pack(w, 32), w.shape[1])
    layer = QuantLinear(w.shape[1], w.shape[0], scheme)
    for k, v in canonical.items():
        setattr(layer, k, v)
    t = kernels.Int4ZerosTritonCUDA.prepare(layer)
    x = torch.randn(3, w.shape[1], dtype=torch.float64)
    want = x @ float_weight(canonical, scheme).double().t()
    got = int_mm(x.float(), t["qweight"], t["scales"], t["offsets"], 32).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-6  # fp32 throughout: the exact weights


# ============================================================================ refusals
@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "exl2", "bits": 4.65}, "EXL2"), ({"quant_method": "exl3"}, "EXL3"),
    ({"quant_method": "hqq", "nbits": 4}, "HQQ"), ({"quant_method": "unheard-of"}, "'unheard-of'"),
    ({"quant_method": "awq", "version": "gemv"}, "AWQ (gemv packing)"),
    ({"quant_method": "gptq", "bits": 3}, "3-bit GPTQ"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bitsandbytes 8-bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "bitsandbytes 4-bit fp4"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "FP8 with static activation scales"),
])
def test_unread_formats_are_refused_in_one_line_naming_them(qc, needle):
    with pytest.raises(LocalLLMError) as e:
        read_hub_quant({"quantization_config": qc, "_name_or_path": "org/Model-7B"})
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert "float repo (org/Model-7B" in e.value.hint


def test_a_damaged_quantization_config_is_one_line(tmp_path):
    """A field of the wrong type is the damaged checkpoint's one line, never a traceback or a float load."""
    from localllm.loaders.hub_quant import open_hf_folder

    for qc in ({"quant_method": "gptq", "bits": None, "group_size": 128}, {"quant_method": "gptq", "bits": "x"}):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
        with pytest.raises(LocalLLMError, match="quantization_config cannot be read") as e:
            open_hf_folder(tmp_path)
        assert "damaged" in e.value.hint


# ============================================================================ whole models
def _quantized_folder(folder: Path, fmt: str) -> tuple[Path, torch.nn.Module]:
    """The tiny Llama with every block linear in ``fmt``, and transformers' model holding the exact
    dequantized weights (the reference)."""
    model = make_hf_model("llama")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for i, (name, w) in enumerate(sorted(state.items())):
        module = name.removesuffix(".weight")
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            tensors[name] = w
            continue
        if fmt == "bnb":
            t, reference[name] = bnb_serialize(w, True)
        elif fmt == "fp8":
            t = fp8_quantize(w, (32, 32))
            reference[name] = fp8_reference(t, (32, 32))
        elif fmt == "gptq":
            t = gptq_pack(w, 4, 32, True, True, True, seed=i)
            reference[name] = gptq_reference(t, 4, True).float()
        elif fmt == "awq":
            t = awq_pack(w, 32)
            reference[name] = awq_reference(t, 32).float()
        else:
            state_ct, scheme_ct, compressor = ct_compress(w, 4, "group", False, "pack-quantized", scale_dtype=torch.float16)
            t = dict(state_ct)
            from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dq
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

            codes = unpack_from_int32(t["weight_packed"], 4, torch.Size(w.shape))
            zp = unpack_from_int32(t["weight_zero_point"], 4, torch.Size((w.shape[0], w.shape[1] // 32)), packed_dim=0)
            reference[name] = ct_dq(codes, t["weight_scale"].float(), zp, scheme_ct.weights, dtype=torch.float32)
        tensors.update({f"{module}.{k}": v for k, v in t.items()})
    save_file(tensors, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True,
                 "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        "ct": ct_config(4, "group", False, "pack-quantized"),
        "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
        "bnb": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "float32"},
    }[fmt]
    (folder / "config.json").write_text(json.dumps(config))
    write_tiny_tokenizer(folder, model.config.vocab_size)
    with torch.no_grad():
        for name, w in reference.items():
            model.get_parameter(name).copy_(w)
    return folder, model


@pytest.mark.parametrize("fmt,scheme_name", [("gptq", "int4"), ("awq", "int4z"), ("ct", "int4z"), ("bnb", "nf4"),
                                             ("fp8", "fp8")])
def test_quantized_repo_loads_with_the_reference_logits(tmp_path, fmt, scheme_name):
    from localllm.loaders.load import load_model

    folder, ref = _quantized_folder(tmp_path, fmt)
    loaded = load_model(str(folder), device="cpu", dtype="fp32")
    assert loaded.scheme is not None and loaded.scheme.name == scheme_name
    ids = torch.randint(3, 384, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(ids).logits
        got = loaded.model(ids)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    # every block linear holds the file's grid (nothing dequantized to float on the way)
    quantized = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) >= 2 * 4  # fused q/k/v and gate/up where the scheme allows
    assert all(m.scheme.name == scheme_name for m in quantized)
    # show names the format the folder's config gives
    from localllm.loaders.describe import describe_checkpoint
    from localllm.loaders.load import open_checkpoint

    facts = describe_checkpoint(open_checkpoint(str(folder)), None)
    assert facts["source"]["format"]["method"] == {"ct": "compressed-tensors", "bnb": "bitsandbytes"}.get(fmt, fmt)
    assert facts["quant"]["name"] == scheme_name


def test_pull_gptq_repo_stores_its_grid_and_runs_with_the_reference_logits(hub: HubServer, tmp_path):
    """Through the Hub protocol: pulled without re-quantizing, the manifest naming the format, and the
    stored model's logits those of transformers holding the dequantized weights."""
    from localllm.loaders.load import load_model
    from localllm.loaders.pull import PullOptions, parse_source, pull_model
    from localllm.loaders.store import Store

    (tmp_path / "repo").mkdir()
    folder, ref = _quantized_folder(tmp_path / "repo", "gptq")
    hub.add_repo("org/tiny-GPTQ", folder)
    store = Store(tmp_path / "home")
    notes: list[str] = []
    entry = pull_model(parse_source("org/tiny-GPTQ"), PullOptions(), store, notes.append).entry
    source, quant = entry.manifest["source"], entry.manifest["quant"]
    assert source["repo"] == "org/tiny-GPTQ" and source["format"]["method"] == "gptq"
    assert source["format"]["label"] == "GPTQ 4-bit, group 32, symmetric, act order (v1 zeros)"
    assert quant["scheme"] == {"name": "int4", "group_size": 32, "symmetric": True, "act_order": True}
    assert any("exactly" in n for n in notes) and not any("re-quantiz" in n for n in notes)
    loaded = load_model(entry.ref, store=store, device="cpu", dtype="fp32")
    with torch.no_grad():  # a quantized entry stores an fp32 source's tables (embedding, head) in bf16, norms in fp32
        for name, p in ref.named_parameters():
            if p.dim() == 2 and not name.endswith("proj.weight"):
                p.copy_(p.bfloat16().float())
    ids = torch.randint(3, 384, (1, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = ref(ids).logits
        got = loaded.model(ids)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    # the stored entry dequantized (its act-order columns put back): the same model in fp32
    as_float = load_model(entry.ref, store=store, device="cpu", quant="fp32")
    assert as_float.dequantized_from is not None
    with torch.no_grad():
        torch.testing.assert_close(as_float.model(ids), want, atol=2e-3, rtol=2e-3)
    # --keep-quant's compressed-tensors export cannot say act order: refused, not written wrong
    from localllm.loaders.export_hf import export_quantized_folder

    with pytest.raises(LocalLLMError, match="act-order"):
        export_quantized_folder(entry.path, tmp_path / "export")

    # another scheme named: re-quantized from the exact values, and said so
    notes.clear()
    entry8 = pull_model(parse_source("org/tiny-GPTQ"), PullOptions("int8"), store, notes.append).entry
    assert entry8.manifest["quant"]["scheme"]["name"] == "int8"
    assert any("re-quantizing its GPTQ 4-bit" in n for n in notes)


@pytest.mark.parametrize("fmt,scheme_name", [("awq", "int4z"), ("fp8", "fp8"), ("bnb", "nf4")])
def test_pulled_folder_round_trips_through_the_store(tmp_path, fmt, scheme_name):
    """Stored as they are (int4z zeros, fp8 values, nf4 absmax) and read back: the same logits."""
    from localllm.loaders.load import load_model
    from localllm.loaders.pull import PullOptions, parse_source, pull_model
    from localllm.loaders.store import Store

    (tmp_path / "repo").mkdir()
    folder, ref = _quantized_folder(tmp_path / "repo", fmt)
    store = Store(tmp_path / "home")
    entry = pull_model(parse_source(str(folder)), PullOptions(), store).entry
    assert entry.manifest["quant"]["scheme"]["name"] == scheme_name
    assert entry.manifest["source"]["format"]["method"] == {"awq": "awq", "fp8": "fp8", "bnb": "bitsandbytes"}[fmt]
    again = pull_model(parse_source(str(folder)), PullOptions(), store)  # its own grid is what it asks again
    assert again.kept and again.entry.ref == entry.ref
    if scheme_name == "int4z":  # --quant int4 keeps a 4-bit repo's own grid: the same entry
        assert pull_model(parse_source(str(folder)), PullOptions("int4"), store).kept
    loaded = load_model(entry.ref, store=store, device="cpu", dtype="fp32")
    with torch.no_grad():  # a quantized entry stores an fp32 source's tables in bf16, norms in fp32
        for name, p in ref.named_parameters():
            if p.dim() == 2 and not name.endswith("proj.weight"):
                p.copy_(p.bfloat16().float())
        ids = torch.randint(3, 384, (1, 12), generator=torch.Generator().manual_seed(9))
        torch.testing.assert_close(loaded.model(ids), ref(ids).logits, atol=2e-3, rtol=2e-3)
