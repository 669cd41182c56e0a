"""A GGUF tensor's blocks on the CPU (quant/gguf_cpu.py): for every common type the kernel's decoder
gives ``gguf.quants.dequantize`` of the same bytes, bit for bit; its matmul is ``x @ W^T`` to fp32
rounding; the repacked tiles hold the blocks' codes and scales; K-quants' product scales are never
rounded to 16 bits; a mixed K-quant file loads each tensor in its own type, in the file's bytes.
How each type is imported is tests/test_gguf_blocks.py's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from localllm import native
from localllm.quant import kernels
from localllm.quant.formats import GGUF_BLOCKS, QuantScheme, dequantize, gguf_scheme
from localllm.quant.gguf_blocks import exact_scheme, to_canonical
from localllm.quant.linear import QuantLinear
from tests.test_tile_kernels import int16_bound, panel_rows_are_batch_invariant

needs_native = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler for localllm's CPU kernels")

#: Byte offsets of each block's fp16 fields (d, and dmin / m where the type has one).
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
BLOCK_TYPES = list(FP16_FIELDS)
FLOAT_TYPES = ["F32", "F16", "BF16"]


def random_blocks(type_name: str, out: int, inp: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """(out, bytes) uint8: random codes and sub-scales, with finite fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    _, block, nbytes = GGUF_BLOCKS[type_name]
    raw = rng.integers(0, 256, (out, inp // block, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[type_name]:
        d = (rng.standard_normal((out, inp // block, 1)) * scale).astype(np.float16)
        raw[..., at : at + 2] = d.view(np.uint8)
    return raw.reshape(out, -1)


def file_bytes(type_name: str, w: np.ndarray) -> np.ndarray:
    """(out, bytes) uint8 of ``w`` in a float type, as a GGUF file stores it."""
    if type_name == "F32":
        return w.astype(np.float32).view(np.uint8)
    if type_name == "F16":
        return w.astype(np.float16).view(np.uint8)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType.BF16).reshape(w.shape[0], -1)


def type_bytes(type_name: str, out: int, inp: int, seed: int = 0) -> np.ndarray:
    if type_name in FLOAT_TYPES:
        w = np.random.default_rng(seed).standard_normal((out, inp)).astype(np.float32) * 0.05
        return file_bytes(type_name, w)
    return random_blocks(type_name, out, inp, seed)


def gguf_values(type_name: str, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])


@needs_native
@pytest.mark.parametrize("type_name", BLOCK_TYPES + FLOAT_TYPES)
def test_the_kernels_decoder_is_bit_exact(type_name):
    """The C++ decoder the matmul uses gives gguf's values bit for bit, on random bytes and on blocks
    gguf's own quantizer wrote (where it has one)."""
    raw = type_bytes(type_name, 24, 768, seed=1)
    got = kernels.gguf_dequantize(torch.from_numpy(raw), type_name, 768).numpy()
    np.testing.assert_array_equal(got, gguf_values(type_name, raw))
    w = np.random.default_rng(2).standard_normal((8, 256)).astype(np.float32)
    try:
        written = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    except NotImplementedError:
        return  # no quantizer in the gguf package for this type (the K-quants, IQ4_NL)
    written = written.view(np.uint8).reshape(8, -1)
    got = kernels.gguf_dequantize(torch.from_numpy(written), type_name, 256).numpy()
    np.testing.assert_array_equal(got, gguf_values(type_name, written))


def gguf_layer(type_name: str, out: int, inp: int, seed: int = 0) -> tuple[QuantLinear, torch.Tensor]:
    raw = type_bytes(type_name, out, inp, seed)
    layer = QuantLinear(inp, out, gguf_scheme(type_name))
    layer.blocks = to_canonical(type_name, raw, gguf_scheme(type_name))["blocks"]
    return layer, torch.from_numpy(gguf_values(type_name, raw).copy())


@needs_native
@pytest.mark.parametrize("type_name", BLOCK_TYPES + FLOAT_TYPES)
def test_the_matmul_is_x_times_the_exact_weight(type_name):
    """Decode-sized inputs (the block kernel) and a prefill (the panel GEMM, over a width whose last
    panel is short where the blocks allow it: 800 = 3 x 256 + 32 columns, or 808 for a float type, not a
    whole vector) equal ``x @ W^T`` with gguf's W to fp32 rounding, with output rows past a tile of 16
    (90 = 5 x 16 + 10)."""
    width = {256: 512, 32: 800, 1: 808}[GGUF_BLOCKS[type_name][1]]
    layer, w = gguf_layer(type_name, 90, width, seed=3)
    assert layer.prepare(torch.float32) == "gguf-blocks-cpu"
    # no other copy of the weight: Q5_0's and Q4_K's blocks are repacked into tiles, the rest kept as they are
    assert {n for n, _ in layer.named_buffers()} == REPACKED.get(type_name, {"blocks"})
    for rows in (1, 3, 8, 21, 40):
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ w.double().t()
        got = layer(x).double()
        # the tiles' register kernel takes the activations in int16 steps (tile_mm.cpp)
        int16 = type_name in REPACKED and rows <= kernels.Int4GroupCPU.GEMV_ROWS
        bound = 2e-6 * want.abs().max() + (int16_bound(x, w.double()) if int16 else 0)
        assert ((got - want).abs() <= bound).all(), rows


@needs_native
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q4_1", "F16"])
def test_rows_do_not_depend_on_the_batch(type_name):
    """Each row of a product bit for bit the same alone and within other batches: the panel GEMM's
    (a prefill), and the block kernel's (a verify step's or a batched decode's rows, 8 at a time
    sharing each decoded block, against the one row of a decode step)."""
    layer, _ = gguf_layer(type_name, 40, 512, seed=4)
    kind = GGUF_BLOCKS[type_name][0]
    x = torch.randn(30, 512, generator=torch.Generator().manual_seed(5))
    panel_rows_are_batch_invariant(lambda a: torch.ops.localllm.gguf_gemm(a, layer.blocks, kind, 512), x)
    if type_name != "F16":
        panel_rows_are_batch_invariant(lambda a: torch.ops.localllm.gguf_mm(a, layer.blocks, kind, 512), x)


#: The tiles a GGUF type's blocks are repacked into for the exact CPU kernels (tile_mm.cpp).
REPACKED = {"Q5_0": {"packed", "fifth", "tile_scales"}, "Q4_K": {"packed", "mins", "supers"},
            "Q6_K": {"packed", "top", "sub_scales", "supers"}}


@needs_native
def test_q4_k_repacked_holds_the_blocks_codes_and_scales():
    """The Int4K layout a Q4_K layer is repacked into (``GGUFBlocksCPU.q4_k_pack``) decodes to gguf's
    own values bit for bit (d * sc and dmin * m made in fp32, never rounded to 16 bits), in as many
    bytes as the blocks, the same made a slice of rows at a time, the last tile padded with zeros; its
    rows do not depend on the batch in the panel GEMM; a tied head keeps its blocks."""
    layer, w = gguf_layer("Q4_K", 90, 512, seed=7)
    whole = kernels.GGUFBlocksCPU.q4_k_pack(layer.blocks)
    assert all(torch.equal(whole[k], v) for k, v in kernels.GGUFBlocksCPU.q4_k_pack(layer.blocks, rows=32).items())
    assert whole["packed"].shape == (6, 64, 64) and whole["mins"].shape == (6, 16, 32)
    assert whole["supers"].shape == (6, 2, 32) and whole["supers"].dtype == torch.float16
    assert sum(t.numel() * t.element_size() for t in whole.values()) <= 1.05 * 96 * 2 * 144  # 96 rows of blocks
    assert (whole["packed"][-1, :, 40:] == 0).all() and (whole["mins"][-1, :, 10:16] == 0).all()
    got = torch.ops.localllm.int4k_group_dequant(whole["packed"], whole["mins"], whole["supers"], 90)
    assert torch.equal(got, w)
    x = torch.randn(30, 512, generator=torch.Generator().manual_seed(8))
    panel_rows_are_batch_invariant(lambda a: torch.ops.localllm.int4k_group_gemm(
        a, whole["packed"], whole["mins"], whole["supers"], 90), x)
    with pytest.raises(RuntimeError, match="supers must be contiguous"):
        torch.ops.localllm.int4k_group_mm(x[:1], whole["packed"], whole["mins"], whole["supers"][:, :1], 90)
    head, _ = gguf_layer("Q4_K", 90, 512, seed=7)
    head.serves_embedding = True
    head.prepare(torch.float32)
    assert {n for n, _ in head.named_buffers()} == {"blocks"}


@needs_native
def test_q6_k_repacked_holds_the_blocks_codes_and_scales():
    """The Int6K layout a Q6_K layer is repacked into (``GGUFBlocksCPU.q6_k_pack``) decodes to gguf's
    own values bit for bit (d * sc made in fp32), in the blocks' 210 bytes a 256 weights, the same made
    a slice of rows at a time, the last tile padded with zeros; its panel rows do not depend on the
    batch; a tied head keeps its blocks."""
    layer, w = gguf_layer("Q6_K", 90, 512, seed=9)
    whole = kernels.GGUFBlocksCPU.q6_k_pack(layer.blocks)
    assert all(torch.equal(whole[k], v) for k, v in kernels.GGUFBlocksCPU.q6_k_pack(layer.blocks, rows=32).items())
    assert whole["packed"].shape == (6, 64, 64) and whole["top"].shape == (6, 32, 64)
    assert whole["sub_scales"].shape == (6, 32, 16) and whole["sub_scales"].dtype == torch.int8
    assert whole["supers"].shape == (6, 2, 16) and whole["supers"].dtype == torch.float16
    assert sum(t.numel() * t.element_size() for t in whole.values()) == 96 * 2 * 210  # 96 rows of blocks
    assert (whole["top"][-1, :, 40:] == 0).all() and (whole["sub_scales"][-1, :, 10:] == 0).all()
    got = torch.ops.localllm.int6k_group_dequant(whole["packed"], whole["top"], whole["sub_scales"],
                                                 whole["supers"], 90)
    assert torch.equal(got, w)
    x = torch.randn(30, 512, generator=torch.Generator().manual_seed(10))
    panel_rows_are_batch_invariant(lambda a: torch.ops.localllm.int6k_group_gemm(
        a, whole["packed"], whole["top"], whole["sub_scales"], whole["supers"], 90), x)
    with pytest.raises(RuntimeError, match="scales must be contiguous"):
        torch.ops.localllm.int6k_group_mm(x[:1], whole["packed"], whole["top"], whole["sub_scales"].to(torch.uint8),
                                          whole["supers"], 90)
    head, _ = gguf_layer("Q6_K", 90, 512, seed=9)
    head.serves_embedding = True
    head.prepare(torch.float32)
    assert {n for n, _ in head.named_buffers()} == {"blocks"}


@needs_native
def test_q5_0_repacked_holds_the_blocks_codes_and_scales():
    """The int5 layout a Q5_0 layer is repacked into (``GGUFBlocksCPU.int5_pack``) decodes to gguf's own
    values bit for bit, is the same made a slice of rows at a time, and pads the last tile with zeros;
    a tied head keeps its blocks (the embedding reads their rows)."""
    layer, w = gguf_layer("Q5_0", 90, 800, seed=6)
    whole = kernels.GGUFBlocksCPU.int5_pack(layer.blocks)
    assert all(torch.equal(whole[k], v) for k, v in kernels.GGUFBlocksCPU.int5_pack(layer.blocks, rows=32).items())
    assert whole["packed"].shape == (6, 100, 64) and whole["fifth"].shape == (6, 25, 64)
    assert (whole["packed"][-1, :, 40:] == 0).all() and (whole["fifth"][-1, :, 40:] == 0).all()
    assert (whole["tile_scales"][-1, :, 10:] == 0).all()
    got = torch.ops.localllm.int5_group_dequant(whole["packed"], whole["fifth"], whole["tile_scales"], 90)
    assert torch.equal(got, w)
    with pytest.raises(RuntimeError, match="fifth must be contiguous"):
        torch.ops.localllm.int5_group_mm(torch.randn(1, 800), whole["packed"], whole["fifth"][:, :5],
                                         whole["tile_scales"], 90)
    head, _ = gguf_layer("Q5_0", 90, 800, seed=6)
    head.serves_embedding = True
    head.prepare(torch.float32)
    assert {n for n, _ in head.named_buffers()} == {"blocks"}


@needs_native
def test_bf16_activations_run_the_same_kernel():
    layer, w = gguf_layer("Q4_K", 64, 1024)
    assert layer.prepare(torch.bfloat16) == "gguf-blocks-cpu"
    x = torch.randn(2, 1024).to(torch.bfloat16)
    want = x.double() @ w.double().t()
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-2  # the bf16 output's rounding


def test_k_quant_product_scales_are_not_rounded_to_16_bits():
    """A Q4_K block whose d * sc (and dmin * m) are not representable in fp16 or bf16: the imported
    weight holds the fp32 products, as gguf computes them. (The test can fail: a 16-bit scale moves them.)"""
    raw = random_blocks("Q4_K", 1, 256, seed=5)
    raw[0, 0:2] = np.array([0.0123], dtype=np.float16).view(np.uint8)  # d: 11 significant bits
    raw[0, 4:16] = 0b10111101  # every 6-bit sub-scale 61, min 61: d * 61 needs 17 bits
    want = gguf_values("Q4_K", raw)
    d = np.float32(np.float16(0.0123))
    assert np.float32(np.float16(d * 61)) != d * 61 and float(torch.tensor(float(d * 61)).bfloat16()) != d * 61
    got = dequantize(to_canonical("Q4_K", raw), gguf_scheme("Q4_K")).numpy()
    np.testing.assert_array_equal(got, want)
    codes = raw[0, 16:48] & 0x0F  # the first sub-block's codes
    np.testing.assert_array_equal(want[0, :32], codes.astype(np.float32) * (d * np.float32(61))
                                  - np.float32(np.float16(raw[0, 2:4].view(np.float16)[0])) * np.float32(61))


def test_the_scheme_survives_a_manifest_round_trip():
    for kind in BLOCK_TYPES + FLOAT_TYPES:
        s = gguf_scheme(kind)
        assert QuantScheme.from_dict(s.to_dict()) == s and s.label() == f"{kind} blocks (as in the file)"
    assert "gguf_type" not in exact_scheme("Q8_0").to_dict()  # the other schemes' manifests as they were


# ------------------------------------------------------------------ a mixed K-quant file, end to end
K_TYPES = {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q8_0",
           "attn_output.weight": "Q4_K", "ffn_gate.weight": "Q5_0", "ffn_up.weight": "Q5_0",
           "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}


def write_k_quant_gguf(tmp_path, monkeypatch, types=K_TYPES, **overrides):
    """A tiny Llama laid out like a Q4_K_M file (Q5_0, Q8_0, Q4_K, Q6_K; F32 norms and embedding).
    gguf has no K-quant quantizer: those tensors get random blocks at the weights' scale (the model
    is what the file says, which is what is compared)."""
    from tests.conftest import make_hf_model
    from tests.test_gguf import write_llama_gguf

    real = gguf.quants.quantize

    def quantize(value, qtype):
        if qtype.name in ("Q4_K", "Q6_K"):
            seed = int(abs(value).sum() * 1000) % 2**32
            return random_blocks(qtype.name, value.shape[0], value.shape[1], seed=seed, scale=0.002)
        return real(value, qtype)

    monkeypatch.setattr(gguf.quants, "quantize", quantize)
    ref = make_hf_model("llama", hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, **overrides)
    return write_llama_gguf(ref, tmp_path / "q4_k_m.gguf", types=types)


def held_bytes(tensor) -> int:  # type: ignore[no-untyped-def]
    """The bytes a loaded layer holds for a GGUF tensor: the file's, but for Q4_K's tiles, whose
    sub-block scales and mins take a byte each (148 bytes a 256 weights, against the blocks' 144)."""
    n = int(tensor.n_bytes)
    return n // 144 * 148 if tensor.tensor_type.name == "Q4_K" else n


@needs_native
def test_a_mixed_k_quant_file_loads_each_tensor_in_its_own_blocks(tmp_path, monkeypatch):
    from localllm.loaders.gguf import GGUFCheckpoint
    from localllm.loaders.load import load_model, weight_bytes

    path = write_k_quant_gguf(tmp_path, monkeypatch)
    ckpt = GGUFCheckpoint(path)
    assert ckpt.default_scheme() == gguf_scheme("Q5_0")  # the most common block type
    assert ckpt.default_head(ckpt.default_scheme()) == gguf_scheme("Q6_K")  # untied: its own blocks
    lm = load_model(str(path), dtype="fp32")
    layer = lm.model.layers[0]
    assert layer.attn.o.scheme == gguf_scheme("Q4_K") and layer.mlp.down.scheme == gguf_scheme("Q6_K")
    assert layer.attn.v.scheme.name == "int8" and lm.model.output.scheme == gguf_scheme("Q6_K")
    assert lm.kernels["gguf-blocks-cpu"] >= 4 and "reference" not in lm.kernels
    assert lm.tensor_import["Q4_K"] == "1 tensor -> Q4_K blocks (as in the file), exact"
    assert lm.tensor_import["Q6_K"] == "2 tensors -> Q6_K blocks (as in the file), exact"
    # The quantized layers hold the file's bytes of their tensors (Q4_K's tiles: held_bytes).
    reader = gguf.GGUFReader(str(path))
    quantized = sum(held_bytes(t) for t in reader.tensors if t.tensor_type.name in ("Q5_0", "Q8_0", "Q4_K", "Q6_K"))
    held = sum(weight_bytes(m) for m in lm.model.modules() if isinstance(m, QuantLinear))
    assert held == quantized
    exact = load_model(str(path), quant="fp32")  # every tensor dequantized by gguf, in fp32
    ids = torch.tensor([[1, 5, 77, 300, 12, 9, 250, 3]])
    with torch.no_grad():
        want = exact.model(ids)
        assert want.std() > 0.1
        # The block kernels sum fp32 products in their own order (which differs with the CPU's vector
        # width), the reference in matmul's: rounding only; a misread block moves them far more.
        torch.testing.assert_close(lm.model(ids), want, atol=3e-4, rtol=1e-4)


@needs_native
def test_a_tied_k_quant_table_is_held_once_in_its_blocks(tmp_path, monkeypatch):
    """A tied Q6_K ``token_embd`` (Llama 3.2's Q4_K_M files) is the head in its blocks and the
    embedding read from them: no 16-bit table, and the values of the file's dequantized tensor."""
    from localllm.loaders.gguf import GGUFCheckpoint
    from localllm.loaders.load import load_model, weight_bytes
    from localllm.quant.linear import TiedHeadEmbedding

    types = {**{k: v for k, v in K_TYPES.items() if k != "output.weight"}, "token_embd.weight": "Q6_K"}
    path = write_k_quant_gguf(tmp_path, monkeypatch, types, tie_word_embeddings=True)
    ckpt = GGUFCheckpoint(path)
    assert ckpt.config.tie_embeddings and ckpt.default_head(ckpt.default_scheme()) == gguf_scheme("Q6_K")
    lm = load_model(str(path), dtype="fp32")
    assert isinstance(lm.model.embed, TiedHeadEmbedding) and lm.model.output.scheme == gguf_scheme("Q6_K")
    assert "embed.weight" not in dict(lm.model.named_parameters())
    assert lm.tensor_import["Q6_K"] == "2 tensors -> Q6_K blocks (as in the file), exact"
    reader = gguf.GGUFReader(str(path))
    table = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert lm.model.output.blocks.numel() == int(table.n_bytes)  # the file's bytes, held once
    quantized = sum(held_bytes(t) for t in reader.tensors if t.tensor_type.name != "F32")
    assert weight_bytes(lm.model) - sum(p.numel() * 4 for p in lm.model.parameters()) == quantized
    ids = torch.tensor([[1, 5, 77, 300, 12, 9, 250, 3]])
    want_rows = torch.from_numpy(gguf_values("Q6_K", np.asarray(table.data)))[ids[0]]
    assert torch.equal(lm.model.embed(ids)[0], want_rows)  # bit for bit gguf's values
    exact = load_model(str(path), quant="fp32")  # every tensor dequantized by gguf, in fp32
    with torch.no_grad():
        want = exact.model(ids)
        assert want.std() > 0.1
        # rounding only, as in the test above
        torch.testing.assert_close(lm.model(ids), want, atol=3e-4, rtol=1e-4)
    bf16 = load_model(str(path), dtype="bf16")  # the embedding rounds the exact rows once, like a bf16 table
    assert torch.equal(bf16.model.embed(ids)[0], want_rows.to(torch.bfloat16))
