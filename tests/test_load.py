"""The streaming load: fused on meta and filled slice by slice, each quantized layer prepared as it
completes, a tied int8 head serving as the embedding without a 16-bit table, and the warning about
layers left on the slow reference kernel."""

from __future__ import annotations

import warnings

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.loaders.artifact import WEIGHTS
from localllm.loaders.build import empty_model, fuse_projections, load_weights
from localllm.loaders.convert import convert_to_store
from localllm.loaders.load import load_model, model_tensors, open_checkpoint
from localllm.loaders.safetensors_stream import iter_safetensors, read_header
from localllm.loaders.store import Store
from localllm.quant import kernels
from localllm.quant.formats import dequantize, parse_scheme
from localllm.quant.linear import QuantLinear, TiedHeadEmbedding
from tests.conftest import make_hf_model, save_hf_folder


IDS = torch.tensor([[1, 200, 17, 300, 5, 99, 42, 7]])


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(kernels, "WARNED", set())


@pytest.fixture(scope="module")
def tied_folder(tiny_folder):
    """A tiny llama whose head is tied to its embedding."""
    return tiny_folder("llama", tie_word_embeddings=True)[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_before_loading_holds_the_checkpoint_s_rows(tiny_folder, arch):
    """The fused q/k/v (qwen2: with biases) and gate/up, filled slice by slice, are the separate
    projections stacked: float weights, and quantized codes and scales (the reference keeps them)."""
    _, folder = tiny_folder(arch)
    for quant, kernel in (("fp32", None), ("int4", "reference"), ("int8", "reference")):
        fused = load_model(str(folder), quant=quant, kernel=kernel).model
        plain = load_model(str(folder), quant=quant, kernel=kernel, fuse=False).model
        for i in range(2):
            a, b = fused.layers[i].attn, plain.layers[i].attn
            assert not hasattr(a, "q") and a.qkv.fused_from[1][0] == "k"
            names = ["weight", "bias"] if quant == "fp32" else ["qweight", "scales", "bias"]
            for name in names:
                if getattr(b.q, name, None) is None:
                    assert getattr(a.qkv, name, None) is None
                    continue
                want = torch.cat([getattr(m, name) for m in (b.q, b.k, b.v)])
                assert torch.equal(getattr(a.qkv, name), want), (quant, name)
            gate_up = torch.cat([getattr(plain.layers[i].mlp, p).state_dict()[names[0]] for p in ("gate", "up")])
            assert torch.equal(fused.layers[i].mlp.gate_up.state_dict()[names[0]], gate_up)
        with torch.no_grad():
            torch.testing.assert_close(fused(IDS % 384), plain(IDS % 384), atol=1e-4, rtol=1e-4)


def test_each_quantized_layer_is_prepared_as_its_tensors_arrive(tiny_folder):
    """No quantized layer waits in its canonical layout for the rest of the model."""
    _, folder = tiny_folder("llama")
    ckpt = open_checkpoint(str(folder))
    model, tensors, plan = model_tensors(ckpt, parse_scheme("int4", 32))
    fuse_projections(model)
    seen = []

    def watch():
        for name, t in tensors:
            seen.append(sum(m.kernel is not None for m in model.modules() if isinstance(m, QuantLinear)))
            yield name, t

    load_weights(model, watch(), torch.device("cpu"), torch.bfloat16, "tiny")
    assert seen[0] == 0 and 0 < seen[len(seen) // 2] < seen[-1]  # prepared along the way, not at the end
    assert all(m.kernel is not None for m in model.modules() if isinstance(m, QuantLinear))


def test_a_missing_or_misshapen_part_of_a_fused_tensor_is_named(tiny_folder):
    _, folder = tiny_folder("llama")
    ckpt = open_checkpoint(str(folder))

    def fused_model():
        return fuse_projections(empty_model(ckpt.config))

    without_k = ((n, t) for n, t in ckpt.iter_tensors() if n != "layers.1.attn.k.weight")
    with pytest.raises(LocalLLMError, match=r"missing tensor\(s\) layers.1.attn.k.weight"):
        load_weights(fused_model(), without_k, torch.device("cpu"), torch.float32, "tiny")
    short_up = ((n, t[:-1] if n == "layers.0.mlp.up.weight" else t) for n, t in ckpt.iter_tensors())
    with pytest.raises(LocalLLMError, match=r"'layers.0.mlp.up.weight' has shape \(191, 64\), "
                                            r"the config implies \(192, 64\)"):
        load_weights(fused_model(), short_up, torch.device("cpu"), torch.float32, "tiny")
    twice = [*ckpt.iter_tensors(), ("layers.0.attn.v.weight", torch.zeros(32, 64))]
    with pytest.raises(LocalLLMError, match="'layers.0.attn.v.weight' appears twice"):
        load_weights(fused_model(), twice, torch.device("cpu"), torch.float32, "tiny")


def test_a_tied_int8_head_serves_as_the_embedding_without_a_16_bit_table(tied_folder, tmp_path):
    # Rounded to nearest: the head's layout is the point here (calibration has its tests in test_awq).
    lm = load_model(str(tied_folder), quant="int4", quantize_head="int8", calibration="none")
    model = lm.model
    assert isinstance(model.embed, TiedHeadEmbedding)
    assert not any(name.startswith("embed") for name in model.state_dict())  # never allocated
    head = model.output
    # Stored once: the artifact holds the head, no embedding; loads the same; exports an embedding.
    store = Store(tmp_path / "store")
    entry, _ = convert_to_store(open_checkpoint(str(tied_folder)), parse_scheme("int4", 32), "tied", store, {},
                                quantize_head="int8", calibration="none")
    header, _ = read_header(entry.path / WEIGHTS)
    assert "output.qweight" in header and "embed.weight" not in header
    raw = dict(iter_safetensors(entry.path / WEIGHTS))
    stored_head = {"qweight": raw["output.qweight"], "scales": raw["output.scales"]}
    # the rows looked up (from whatever layout the head's kernel keeps) are the head's weights
    assert torch.equal(model.embed(IDS)[0], dequantize(stored_head, head.scheme)[IDS[0]].to(lm.dtype))
    stored = load_model("tied:int4", store=store)
    assert torch.equal(stored.model(IDS), model(IDS))
    floats = dict(open_checkpoint(str(entry.path)).iter_tensors())
    assert floats["embed.weight"] is floats["output.weight"]
    assert torch.equal(floats["embed.weight"], dequantize(stored_head, head.scheme))


def test_a_stored_16_bit_table_beside_an_int8_head_is_skipped(tied_folder):
    """Entries written before the head served as the embedding hold both: they still load."""
    ckpt = open_checkpoint(str(tied_folder))
    model, tensors, _ = model_tensors(ckpt, parse_scheme("int4", 32), "int8")
    with_table = [*tensors, ("embed.weight", torch.zeros(384, 64, dtype=torch.bfloat16))]
    loaded = load_weights(model, with_table, torch.device("cpu"), torch.bfloat16, "old entry")
    assert isinstance(loaded.embed, TiedHeadEmbedding)


def test_the_slow_reference_warning_says_what_runs(tiny_folder, monkeypatch):
    """fp32 activations without localllm's C++ kernels: int4's torch kernel needs bf16, so its layers
    run the reference, said once; int8 per channel has torch's kernel for fp32 and says nothing."""
    from localllm import native

    monkeypatch.setattr(native, "available", lambda lib, cache_dir=None: False)
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no C++ compiler")
    _, folder = tiny_folder("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        int4 = load_model(str(folder), quant="int4", dtype="fp32", attention_kernel=False)
        int8 = load_model(str(folder), quant="int8", dtype="fp32", attention_kernel=False)
    said = sorted(str(w.message) for w in caught if "reference" in str(w.message))
    assert said == ["int4 (group 32, asymmetric) layers run on the slow reference kernel (it dequantizes the weight "
                    "at every call): int4-tinygemm-cpu needs bfloat16 activations, not float32; int4-group-cpu "
                    "needs localllm's CPU kernels, which could not be built (no C++ compiler)",
                    "int8 (group 32) layers run on the slow reference kernel (it dequantizes the weight at every "
                    "call): int8-group-cpu needs localllm's CPU kernels, which could not be built (no C++ compiler); "
                    "int8-weight-only needs one scale per output channel, not per group"]  # the int8 head
    assert int4.kernels["reference"] == 9  # 2 blocks of qkv, o, gate_up, down; the head
    assert int8.kernels["int8-weight-only"] == 9 and "reference" not in int8.kernels  # its head per channel too


def test_fp32_activations_run_localllms_kernels_without_a_warning(tied_folder, tmp_path):
    """A quantized model runs fp32 activations on the CPU: int4 and int8 on localllm's C++ kernels.
    A float table it keeps is held in 16 bits apart from them: an untied embedding as the checkpoint
    stores it (fp16 here), a head kept float on the 16-bit row kernel, never doubled to fp32 and never
    holding the activations in bf16 (which put int4 on torch's bf16 kernel)."""
    untied = save_hf_folder(make_hf_model("llama").half(), tmp_path / "fp16")  # untied, stored in float16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        int4 = load_model(str(tied_folder), quant="int4", quantize_head="int8", device="cpu")
        int8 = load_model(str(tied_folder), quant="int8", quantize_head="int8", device="cpu")
        float_head = load_model(str(untied), quant="int4", quantize_head=False, device="cpu")
        tied_float = load_model(str(tied_folder), quant="int4", quantize_head=False, device="cpu")
    assert not [str(w.message) for w in caught if "reference" in str(w.message)]
    # tied, the 16-bit head (bf16: the folder stores fp32) serves as the embedding, held once
    assert tied_float.dtype == torch.float32 and tied_float.kernels["bf16-rows-cpu"] == 1
    assert isinstance(tied_float.model.embed, TiedHeadEmbedding)
    assert int4.dtype == int8.dtype == float_head.dtype == torch.float32
    assert int4.kernels["int4-group-cpu"] == 8 and int4.kernels["int8-group-cpu"] == 1  # the head
    assert int8.kernels["int8-group-cpu"] == 9
    assert float_head.kernels["int4-group-cpu"] == 8 and float_head.kernels["fp16-rows-cpu"] == 1
    m, cfg = float_head.model, float_head.config
    assert m.embed.weight.dtype == m.output.weight.dtype == torch.float16
    quantized = sum(b.numel() * b.element_size() for n, b in m.named_buffers() if n.startswith("layers."))
    norms = sum(p.numel() * 4 for p in m.parameters())
    assert float_head.weight_bytes == quantized + norms + 2 * 2 * cfg.vocab_size * cfg.dim  # two 16-bit tables
    tokens = torch.tensor([[1, 17, 42, 99, 5, 7]])
    as_before = load_model(str(untied), quant="int4", quantize_head=False, dtype="bf16", device="cpu")
    with torch.no_grad():
        got, want = m(tokens), as_before.model(tokens).float()
    assert got.dtype == torch.float32 and (got - want).abs().max() < 0.05 * want.abs().max() and want.std() > 0.1


def test_group_size_without_quant_on_a_grid_it_cannot_regroup_is_one_line():
    """A GGUF's blocks (or an imported Hub grid) have no group to change: --group-size alone asks
    for a re-quantization the user did not name, refused with the fix, never 'unknown scheme'."""
    from localllm.loaders.load import choose_scheme
    from localllm.quant.formats import gguf_scheme

    class Own:  # a checkpoint as choose_scheme reads it: its own scheme
        def default_scheme(self):
            return gguf_scheme("Q4_K")

    with pytest.raises(LocalLLMError, match="--group-size re-quantizes") as e:
        choose_scheme(Own(), None, 64)
    assert "--quant" in e.value.hint
    assert choose_scheme(Own(), "int4", 64).group_size == 64
