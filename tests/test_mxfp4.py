"""MXFP4 (gpt-oss's expert weights) kept exactly in its grid: GGUF's MXFP4 blocks (ggml type 39: an
E8M0 scale byte and 16 bytes of E2M1 codes per 32 weights) import as they are and decode bit for bit as
``gguf.quants.dequantize`` gives them; the native linear and the native expert op multiply the exact
weights; the HF checkpoint's ``*_blocks`` / ``*_scales`` repack into the same blocks, equal to
transformers' own dequantization (``convert_moe_packed_tensors``)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from localllm import native
from localllm.quant import kernels
from localllm.quant.experts import QuantExperts, ReferenceExperts
from localllm.quant.formats import GGUF_BLOCKS, dequantize_weight, gguf_scheme
from localllm.quant.gguf_blocks import exact_scheme, to_canonical
from localllm.quant.hub_formats import mxfp4_blocks
from localllm.quant.linear import QuantLinear
from localllm.quant.native_ops import LIBRARY

needs_native = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler for localllm's CPU kernels")
MXFP4 = gguf.GGMLQuantizationType.MXFP4


def mxfp4_bytes(out: int, inp: int, seed: int = 0, exponents: tuple[int, int] = (119, 124)) -> np.ndarray:
    """(out, inp / 32 * 17) uint8: random codes, scale bytes drawn from ``exponents`` (2^(e - 127) the
    scale; 119..124: weights up to 6 * 2^-3, as a trained model's)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (out, inp // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(exponents[0], exponents[1] + 1, (out, inp // 32), dtype=np.uint8)
    return raw.reshape(out, -1)


def test_the_scheme_keeps_the_files_blocks():
    assert GGUF_BLOCKS["MXFP4"] == (int(MXFP4), 32, 17)
    scheme = exact_scheme("MXFP4")
    assert scheme == gguf_scheme("MXFP4") and scheme.group_size == 32
    raw = mxfp4_bytes(6, 64)
    blocks = to_canonical("MXFP4", raw)["blocks"]
    assert blocks.dtype == torch.uint8 and np.array_equal(blocks.numpy(), raw)
    want = gguf.quants.dequantize(raw, MXFP4)
    assert np.array_equal(dequantize_weight({"blocks": blocks}, scheme).numpy(), want)


@needs_native
def test_the_kernels_decoder_is_bit_exact():
    """Every scale byte, row e's blocks scaled by byte e: the subnormal 2^-128 and 2^-127 of 0 and 1,
    and the top ones whose large codes overflow to infinity (above 252; 255 is NaN in the OCP spec,
    ggml reads it as 2^127), and blocks gguf's own quantizer wrote."""
    raw = mxfp4_bytes(256, 64, seed=3)
    raw.reshape(256, 2, 17)[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
    got = kernels.gguf_dequantize(torch.from_numpy(raw), "MXFP4", 64).numpy()
    want = gguf.quants.dequantize(raw, MXFP4)
    assert np.isfinite(want[:253]).all() and (want != 0).any(axis=1).all()
    np.testing.assert_array_equal(got, want)
    assert np.abs(want[0][want[0] != 0]).min() == 2.0**-128  # scale byte 0: code 1 is 2^-128
    w = np.random.default_rng(2).standard_normal((8, 256)).astype(np.float32)
    written = gguf.quants.quantize(w, MXFP4).view(np.uint8).reshape(8, -1)
    got = kernels.gguf_dequantize(torch.from_numpy(written), "MXFP4", 256).numpy()
    np.testing.assert_array_equal(got, gguf.quants.dequantize(written, MXFP4))


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 8, 40])  # the block kernel up to 16 rows, the panel GEMM above
def test_the_linear_is_x_times_the_exact_weight(rows):
    out, inp = 48, 320
    raw = mxfp4_bytes(out, inp, seed=rows)
    layer = QuantLinear(inp, out, gguf_scheme("MXFP4"))
    layer.blocks = torch.from_numpy(raw.copy())
    assert layer.prepare(torch.float32) == "gguf-blocks-cpu"
    w = torch.from_numpy(gguf.quants.dequantize(raw, MXFP4))  # (out, in)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        got = layer(x)
    want = x.double() @ w.double().t()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


E, D, F = 4, 128, 96


def mxfp4_experts(out: int, inp: int, seed: int) -> QuantExperts:
    p = QuantExperts(E, inp, out, gguf_scheme("MXFP4"))
    p.blocks = torch.from_numpy(np.stack([mxfp4_bytes(out, inp, seed * 10 + e) for e in range(E)]))
    return p


@needs_native
@pytest.mark.parametrize("rows", [1, 6, 64])  # 64 rows over 4 experts: the panel GEMM
def test_the_native_expert_op_multiplies_mxfp4(rows):
    """``localllm::moe_ffn`` (the native expert kernel's op, csrc/moe_mm.cpp) takes MXFP4 blocks through
    gguf_blocks.h's row kernel: a layer's experts equal the reference's dequantized product."""
    assert native.available(LIBRARY)
    gate, up, down = mxfp4_experts(F, D, 1), mxfp4_experts(F, D, 2), mxfp4_experts(D, F, 3)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, 2, generator=g), -1)
    want = ReferenceExperts.ffn(x, ids, weights, (gate, up), down, "silu")
    t = int(MXFP4)
    got = torch.ops.localllm.moe_ffn(x, ids, weights, gate.blocks, up.blocks, down.blocks, t, t, t, 0)
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 1e-5


def hf_mxfp4(shape: tuple[int, ...], seed: int, exponents: tuple[int, int] = (0, 254)) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF checkpoint's ``*_blocks`` (..., G, 16) and ``*_scales`` (..., G), random."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(exponents[0], exponents[1] + 1, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_blocks_repack_equal_transformers_dequantization(dtype):
    """The repacked blocks dequantize (ggml's decoder) to transformers' values, bit for bit, over every
    scale byte but 255; transformers lays gpt-oss's experts out (E, in, out), ours are (E, out, in)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    Ex, R, G = 3, 10, 4
    blocks, scales = hf_mxfp4((Ex, R, G), seed=1)
    scales[0].view(-1)[:255] = torch.arange(255, dtype=torch.uint8)[: scales[0].numel()]
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype).float()  # (E, G * 32, R)
    ours = mxfp4_blocks(blocks, scales, "experts.gate_up_proj")  # (E, R, G * 17)
    assert ours.shape == (Ex, R, G * 17) and ours.dtype == torch.uint8
    got = gguf.quants.dequantize(ours.numpy(), MXFP4)  # (E, R, G * 32)
    np.testing.assert_array_equal(got, want.transpose(1, 2).numpy())


@needs_native
def test_hf_experts_multiply_exactly_after_repack():
    """The repacked checkpoint through the native linear: gpt-oss's gate and up are interleaved rows
    (gate 0::2, up 1::2); a row gather of whole blocks keeps each its exact values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = hf_mxfp4((2, 64, 4), seed=5, exponents=(118, 126))
    dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # (E, 2F, in)
    repacked = mxfp4_blocks(blocks, scales, "gate_up_proj")
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    for e in range(2):
        for rows in (slice(0, None, 2), slice(1, None, 2)):  # gate, up
            layer = QuantLinear(128, 32, gguf_scheme("MXFP4"))
            layer.blocks = repacked[e, rows].contiguous()
            layer.prepare(torch.float32)
            with torch.inference_mode():
                got = layer(x)
            torch.testing.assert_close(got.double(), x.double() @ dense[e, rows].double().t(), atol=1e-4, rtol=1e-5)


def test_hf_blocks_that_do_not_fit_are_one_line():
    from localllm.errors import LocalLLMError

    blocks, scales = hf_mxfp4((2, 4, 3), seed=0)
    with pytest.raises(LocalLLMError, match="do not fit"):
        mxfp4_blocks(blocks, scales[:, :, :2], "down_proj")
    with pytest.raises(LocalLLMError, match="expected uint8"):
        mxfp4_blocks(blocks.to(torch.int8), scales, "down_proj")


def gguf_to_hf(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 blocks (..., rows, G * 17) -> the HF checkpoint's ``_blocks`` (..., rows, G, 16) and
    ``_scales`` (..., rows, G): the inverse of :func:`mxfp4_blocks`."""
    b = raw.reshape(*raw.shape[:-1], -1, 17)
    qs = b[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # (..., G, 32) column order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), b[..., 0].contiguous()


def mxfp4_gpt_oss_folder(tmp_path):
    """A tiny gpt-oss saved as OpenAI publishes it: experts in MXFP4 (``*_blocks`` / ``*_scales``,
    quantized by gguf's MXFP4 quantizer), the rest float, ``quantization_config: mxfp4``; and the
    transformers model holding transformers' own dequantization of those experts."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.conftest import write_tiny_tokenizer
    from tests.test_gpt_oss import gpt_oss_model

    ref = gpt_oss_model()
    packed = {}
    with torch.no_grad():
        for p in ref.parameters():  # bf16 values, as OpenAI's non-expert weights (and the store's float rule)
            p.copy_(p.bfloat16().float())
        for i, layer in enumerate(ref.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, proj)  # (E, in, out): x @ W
                rows = p.transpose(1, 2).contiguous().numpy()  # (E, out, in)
                raw = torch.from_numpy(gguf.quants.quantize(rows.reshape(-1, rows.shape[-1]), MXFP4))
                blocks, scales = gguf_to_hf(raw.view(rows.shape[0], rows.shape[1], -1))
                assert torch.equal(mxfp4_blocks(blocks, scales, proj), raw.view(rows.shape[0], rows.shape[1], -1))
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    folder = tmp_path / "oss-mxfp4"
    ref.save_pretrained(folder)
    write_tiny_tokenizer(folder, ref.config.vocab_size)
    (shard,) = folder.glob("*.safetensors")
    tensors = {k: v for k, v in load_file(shard).items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **packed}, shard, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return ref, folder


def test_hf_mxfp4_checkpoint_loads_its_experts_exactly(tmp_path):
    """Read from ``quantization_config``; each expert's gate, up (de-interleaved rows) and down are the
    checkpoint's blocks repacked, and the logits equal transformers' on its own dequantized experts."""
    from localllm.loaders.hub_quant import MXFP4Checkpoint, open_hf_folder, source_format
    from localllm.loaders.load import load_model
    from tests.conftest import write_tiny_tokenizer
    from tests.test_gpt_oss import tokens

    ref, folder = mxfp4_gpt_oss_folder(tmp_path)
    ckpt = open_hf_folder(folder)
    assert isinstance(ckpt, MXFP4Checkpoint) and ckpt.default_scheme() == gguf_scheme("MXFP4")
    assert source_format(ckpt)["format"]["method"] == "mxfp4"
    lm = load_model(str(folder), dtype="fp32")  # the float modules' activations as transformers' here
    experts = lm.model.layers[1].mlp.experts
    f = experts.down.in_features
    for name, cols in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2)), ("down", slice(None))):
        p = experts.down if name == "down" else getattr(experts, name, None) or experts.gate_up
        rows = slice(None)
        if p is experts.gate_up:  # gate's rows, then up's, of each expert
            rows = slice(0, f) if name == "gate" else slice(f, 2 * f)
        assert p.scheme == gguf_scheme("MXFP4")
        hf = getattr(ref.model.layers[1].mlp.experts, "down_proj" if name == "down" else "gate_up_proj")
        for e in range(p.blocks.shape[0]):
            got = gguf.quants.dequantize(p.canonical()["blocks"][e, rows].numpy(), MXFP4)
            np.testing.assert_array_equal(got, hf[e][:, cols].t().detach().numpy())
    ids = tokens(12)
    with torch.no_grad():
        want = ref(ids).logits
    with torch.inference_mode():
        got = lm.model(ids).float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # By default on the CPU: fp32 activations, the float attention and tables held in bf16 apart from them
    # (their values are bf16's: nothing rounds), never in fp32 beside 4-bit experts
    auto = load_model(str(folder), device="cpu")
    attn = sum(1 for layer in auto.model.layers for m in layer.attn.modules() if isinstance(m, QuantLinear))
    assert auto.dtype == torch.float32 and attn > 0 and auto.kernels["bf16-rows-cpu"] == attn + 1  # and the head
    assert auto.model.embed.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        torch.testing.assert_close(auto.model(ids).float(), want, atol=1e-4, rtol=1e-4)
    # --quant int4: re-quantized from the exact values, as the float checkpoint of those values is
    dense = tmp_path / "oss-dense"
    ref.save_pretrained(dense)
    write_tiny_tokenizer(dense, ref.config.vocab_size)
    with torch.inference_mode():
        int4 = load_model(str(folder), quant="int4", dtype="fp32").model(ids)
        torch.testing.assert_close(int4, load_model(str(dense), quant="int4", dtype="fp32").model(ids), atol=1e-6, rtol=0)


def test_mxfp4_experts_in_a_gguf_import_bit_for_bit(tmp_path):
    """A MoE GGUF whose stacked experts are MXFP4 (as llama.cpp writes gpt-oss's; here a Qwen3-MoE,
    the family the GGUF loader reads): each expert keeps its blocks, and the logits equal transformers'
    on the experts' MXFP4 values."""
    from localllm.loaders.load import load_model
    from localllm.quant.expert_kernels import MoEBlocksCPU
    from tests.test_gguf_moe import moe_model, tokens, write_moe_gguf

    ref = moe_model("qwen3_moe")
    with torch.no_grad():  # the reference holds the values the file will: gguf's quantizer, dequantized
        for layer in ref.model.layers:
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, name)
                flat = p.detach().reshape(-1, p.shape[-1]).numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(flat, MXFP4), MXFP4)).view_as(p))
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # Q8_0, the file's most common type
                p = getattr(layer.self_attn, name).weight
                q8 = gguf.GGMLQuantizationType.Q8_0
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.detach().numpy(), q8), q8)))
    types = {"_exps.weight": "MXFP4", **{f"{n}.weight": "Q8_0" for n in ("attn_q", "attn_k", "attn_v", "attn_output")}}
    path = write_moe_gguf(ref, tmp_path / "mxfp4.gguf", types)
    lm = load_model(str(path), dtype="fp32")
    files = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    experts = lm.model.layers[0].mlp.experts
    held = experts.down.canonical()["blocks"]
    assert experts.down.scheme == gguf_scheme("MXFP4")
    assert experts.down.kernel is MoEBlocksCPU  # the native expert kernel, not the reference
    assert np.array_equal(held.numpy(), np.asarray(files["blk.0.ffn_down_exps.weight"].data))
    ids = tokens(9)
    with torch.no_grad():
        want = ref(ids).logits
    with torch.inference_mode():
        got = lm.model(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_stored_mxfp4_keeps_its_blocks_and_names_its_format(tmp_path):
    """Written to the store as pull writes a Hub-quantized repo (its own grid, the source's format in the
    manifest; float weights in 16 bits, lossless for the checkpoint's bf16) and loaded back: the
    experts' blocks as they were, the direct load's logits."""
    from localllm.loaders.convert import convert_to_store
    from localllm.loaders.hub_quant import open_hf_folder, source_format
    from localllm.loaders.load import load_model
    from localllm.loaders.store import Store
    from tests.test_gpt_oss import tokens

    _, folder = mxfp4_gpt_oss_folder(tmp_path)
    ckpt = open_hf_folder(folder)
    store = Store(tmp_path / "store")
    entry, _ = convert_to_store(ckpt, ckpt.default_scheme(), "tiny-oss", store,
                                {"path": str(folder), **source_format(ckpt)})
    assert entry.manifest["source"]["format"]["label"] == "MXFP4 experts (E2M1 in blocks of 32, E8M0 scales)"
    stored = load_model(entry.ref, store=store, dtype="fp32")
    direct = load_model(str(folder), dtype="fp32")
    a, b = stored.model.layers[2].mlp.experts, direct.model.layers[2].mlp.experts
    assert a.down.scheme == gguf_scheme("MXFP4")
    assert torch.equal(a.down.canonical()["blocks"], b.down.canonical()["blocks"])
    ids = tokens(10, seed=3)
    with torch.inference_mode():
        torch.testing.assert_close(stored.model(ids), direct.model(ids), atol=1e-6, rtol=0)


def test_mxfp4_config_is_read_and_other_architectures_refused(tmp_path):
    """``quant_method: mxfp4`` names the format (never refused as unknown); on an architecture whose
    experts are not gpt-oss's, one line."""
    import json

    import transformers

    from localllm.errors import LocalLLMError
    from localllm.loaders.hub_quant import open_hf_folder, read_hub_quant
    from tests.conftest import TINY, write_tiny_tokenizer

    hub = read_hub_quant({"quantization_config": {"quant_method": "mxfp4"}})
    assert hub is not None and hub.method == "mxfp4" and hub.scheme(64) == gguf_scheme("MXFP4")
    assert "MXFP4" in hub.label()
    torch.manual_seed(0)
    folder = tmp_path / "qwen3"
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY)).save_pretrained(folder)
    write_tiny_tokenizer(folder, TINY["vocab_size"])
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(LocalLLMError, match="MXFP4 experts are read for gpt-oss only, not in a qwen3 model"):
        open_hf_folder(folder)
