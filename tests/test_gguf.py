"""GGUF files: Llama 3.x rope frequency factors against transformers, rope scalings we cannot run refused
by name, and files that are not GGUF or are cut short refused in one line with the numbers."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.loaders.build import empty_model, load_weights
from localllm.loaders.gguf import GGUFCheckpoint
from localllm.loaders.load import load_model
from localllm.quant.formats import parse_scheme
from localllm.runtime.config import ModelConfig
from tests.conftest import TINY, make_hf_model

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
THETA = 10000.0  # with head_dim 16 and a 32-token original context: factors 1, 8 and blended ones


def converter_rope_factors(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's convert_hf_to_gguf.py writes it for llama3 scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def add_model_shape(w: gguf.GGUFWriter, c) -> None:  # type: ignore[no-untyped-def]
    """The shape keys each test writer takes from a transformers config ``c``, as llama.cpp names them."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter q/k row permutation (HF half-split -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, path: Path, rope_freqs: np.ndarray | None = None,
                     scaling: tuple[gguf.RopeScalingType, float] | None = None,
                     types: dict[str, str] | None = None) -> Path:
    """A Llama GGUF of a transformers model, laid out as llama.cpp's converter writes it: F32, but for
    the tensors ``types`` names by their GGUF name's suffix (``{"attn_v.weight": "Q8_0"}``)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    add_tensor = w.add_tensor

    def add(name: str, value: np.ndarray) -> None:
        kind = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), "F32")
        if kind == "F32":
            return add_tensor(name, value)
        qtype = gguf.GGMLQuantizationType[kind]
        add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)

    w.add_tensor = add  # type: ignore[method-assign]
    if types:  # a loadable file (load_model reads the tokenizer too): byte-level tokens, no merges
        from localllm.runtime.tokenizer import bytes_to_unicode

        byte_tokens = sorted(set(bytes_to_unicode().values()))
        tokens = byte_tokens + ["Ġt"] + [f"<extra_{i}>" for i in range(c.vocab_size - len(byte_tokens) - 1)]
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1] * (len(byte_tokens) + 1) + [3] * (len(tokens) - len(byte_tokens) - 1))
        w.add_token_merges(["Ġ t"])
        w.add_eos_token_id(len(byte_tokens) + 1)
    add_model_shape(w, c)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(THETA)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    if scaling is not None:
        w.add_rope_scaling_type(scaling[0])
        w.add_rope_scaling_factor(scaling[1])
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:  # a tied file has no output.weight: token_embd serves as the head
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def from_gguf(ckpt: GGUFCheckpoint, config: ModelConfig | None = None):
    model = empty_model(config or ckpt.config)
    return load_weights(model, ckpt.iter_tensors(), torch.device("cpu"), torch.float32, str(ckpt.path))


@pytest.fixture(scope="module")
def llama3_ref():
    return make_hf_model("llama", rope_scaling=dict(LLAMA3), rope_theta=THETA)


def test_llama3_rope_freqs_match_transformers(llama3_ref, tmp_path):
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    factors = converter_rope_factors(head_dim, THETA, LLAMA3)
    assert {1.0, 8.0} < set(factors.tolist())  # unscaled, fully scaled and blended frequencies all occur
    ckpt = GGUFCheckpoint(write_llama_gguf(llama3_ref, tmp_path / "llama3.gguf", factors))
    assert ckpt.config.rope_freq_factors == pytest.approx(factors.tolist())
    assert ckpt.config.rope_scaling is None  # the factors are the scaling; none is applied twice
    ids = torch.randint(3, TINY["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = llama3_ref(ids).logits
    got = from_gguf(ckpt)(ids)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The test can fail: the same weights without the factors (the old behaviour) are far off.
    without = from_gguf(ckpt, dataclasses.replace(ckpt.config, rope_freq_factors=None))(ids)
    assert (without - want).abs().max() > 0.05
    # The factors survive a store manifest's round trip.
    assert ModelConfig.from_dict(ckpt.config.to_dict()) == ckpt.config


def test_rope_freqs_of_the_wrong_size_are_refused():
    with pytest.raises(LocalLLMError, match="3 rope frequency factors for a head size of 16"):
        ModelConfig(dim=64, n_heads=4, rope_freq_factors=[1.0, 2.0, 3.0])


@pytest.mark.parametrize("kind", [gguf.RopeScalingType.LONGROPE])  # without its factors (YaRN: test_gpt_oss_gguf)
def test_unsupported_gguf_rope_scaling_is_refused(llama3_ref, tmp_path, kind):
    path = write_llama_gguf(llama3_ref, tmp_path / "scaled.gguf", scaling=(kind, 4.0))
    with pytest.raises(LocalLLMError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert f"unsupported rope scaling '{kind.value}'" in msg and "linear" in msg and "\n" not in msg


def test_linear_gguf_rope_scaling_is_read(llama3_ref, tmp_path):
    path = write_llama_gguf(llama3_ref, tmp_path / "linear.gguf", scaling=(gguf.RopeScalingType.LINEAR, 2.0))
    assert GGUFCheckpoint(path).config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


HF_BASE = {"model_type": "llama", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 192,
           "num_hidden_layers": 2, "num_attention_heads": 4}


def test_unsupported_hf_rope_scaling_is_refused():
    with pytest.raises(LocalLLMError, match="unsupported rope scaling 'dynamic'") as e:
        ModelConfig.from_hf({**HF_BASE, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    assert "llama3, linear, longrope and yarn" in str(e.value)


def test_hf_yarn_rope_scaling_is_read_or_refused_in_one_line():
    """YaRN in either spelling (transformers 4's ``rope_scaling`` with ``type``, 5's ``rope_parameters``);
    without its original context it cannot be computed: the config is damaged, said in one line."""
    c = ModelConfig.from_hf({**HF_BASE, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32}})
    assert (c.rope_scaling["rope_type"], c.rope_scaling["factor"]) == ("yarn", 4.0)
    with pytest.raises(LocalLLMError, match="yarn rope scaling without original_max_position_embeddings"):
        ModelConfig.from_hf({**HF_BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}})


def _one_line_error(path: Path) -> str:
    with pytest.raises(LocalLLMError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert "\n" not in msg and "divisor" not in msg
    return msg


def test_a_file_that_is_not_gguf_is_said(tmp_path):
    noise = tmp_path / "notgguf.gguf"
    # the magic fixed: a random one holding a quote (0x27) would be shown in double quotes
    noise.write_bytes(b"\x00\x13\x01\x02" + os.urandom(4000))
    assert "notgguf.gguf is not a GGUF file (bad magic b'\\x00\\x13\\x01\\x02')" in _one_line_error(noise)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "empty.gguf is not a GGUF file (bad magic b'')" in _one_line_error(empty)


def test_a_truncated_gguf_is_said_with_its_size(smollm2_path, tmp_path):
    data = smollm2_path.read_bytes()
    reader = gguf.GGUFReader(str(smollm2_path))
    last = max(t.data_offset + t.n_bytes for t in reader.tensors)
    assert last == len(data)  # what the header declares is the whole file
    for cut in (4, 30, 200_000, reader.data_offset - 1):  # inside the header (the vocabulary is ~1 MB of it)
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        assert f"cut{cut}.gguf is truncated: {cut} bytes" in _one_line_error(path)
    for cut in (reader.data_offset + 1000, len(data) // 2, len(data) - 1):  # inside the tensor data
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        assert f"truncated: {cut} bytes, header says at least {len(data)}" in _one_line_error(path)


def test_a_mixed_gguf_keeps_every_tensor_on_its_own_grid(tmp_path):
    """Q4_0 blocks beside a Q8_0 and a Q5_0 tensor: each imports exactly into the scheme that holds
    its grid (Q5_0 in its own blocks, never re-rounded onto 4 bits nor widened to 16), and the load
    says per type what happened. With fp32 activations the logits are the file's own model."""
    from localllm.loaders.load import load_model
    from localllm.quant.formats import gguf_scheme
    from localllm.quant.linear import QuantLinear

    ref = make_hf_model("llama")
    types = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_0", "attn_output.weight": "Q4_0",
             "ffn_gate.weight": "Q4_0", "ffn_up.weight": "Q4_0", "attn_v.weight": "Q8_0", "ffn_down.weight": "Q5_0"}
    path = write_llama_gguf(ref, tmp_path / "mixed.gguf", types=types)
    lm = load_model(str(path), dtype="fp32")
    layer = lm.model.layers[0]
    assert lm.scheme == parse_scheme("int4", 32, symmetric=True)
    assert layer.attn.qkv is None  # q, k (4-bit) and v (8-bit) are not fused across schemes
    assert layer.attn.v.scheme == parse_scheme("int8", 32) and layer.attn.q.scheme == lm.scheme
    assert isinstance(layer.mlp.gate_up, QuantLinear)  # gate and up share Q4_0: fused
    assert isinstance(layer.mlp.down, QuantLinear) and layer.mlp.down.scheme == gguf_scheme("Q5_0")
    assert lm.tensor_import["Q4_0"] == "10 tensors -> int4 (group 32, symmetric), exact"
    assert lm.tensor_import["Q8_0"] == "2 tensors -> int8 (group 32), exact"
    assert lm.tensor_import["Q5_0"] == "2 tensors -> Q5_0 blocks (as in the file), exact"
    exact = load_model(str(path), quant="fp32")  # every tensor dequantized by gguf, in fp32
    assert exact.scheme_label == "fp32, dequantized from int4 (group 32, symmetric)"
    ids = torch.tensor([[1, 5, 77, 300, 12, 9, 250, 3]])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids), exact.model(ids), atol=1e-4, rtol=1e-4)


def test_export_refuses_a_llama3_gguf_whose_rope_it_cannot_write(llama3_ref, tmp_path):
    from localllm.loaders.export_hf import export_hf_folder

    factors = converter_rope_factors(TINY["hidden_size"] // TINY["num_attention_heads"], THETA, LLAMA3)
    path = write_llama_gguf(llama3_ref, tmp_path / "l3.gguf", rope_freqs=factors)
    with pytest.raises(LocalLLMError, match="per-frequency factors"):
        export_hf_folder(GGUFCheckpoint(path), tmp_path / "out", "fp32")
    assert not (tmp_path / "out" / "model.safetensors").exists()
