"""Quantized artifacts in the store: written streaming, loaded without re-quantizing, damage detected."""

from __future__ import annotations

import json

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.loaders.artifact import WEIGHTS, plan_from_manifest
from localllm.loaders.convert import convert_to_store
from localllm.loaders.load import load_model, open_checkpoint
from localllm.loaders.safetensors_stream import read_header
from localllm.loaders.store import Store
from localllm.quant.formats import parse_scheme

IDS = torch.tensor([[1, 4093, 198, 6004, 28, 2, 1, 520, 2000, 300]])


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "store")


def stored_tiny(store, tiny_folder, scheme="int4", group=32):
    _, folder = tiny_folder("llama")
    entry, _ = convert_to_store(open_checkpoint(str(folder)), parse_scheme(scheme, group), "tiny", store,
                                {"path": str(folder)})
    return entry, folder


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int8", None), ("nf4", 64), ("bf16", None)])
def test_stored_model_equals_quantizing_at_load(store, tiny_folder, scheme, group):
    entry, folder = stored_tiny(store, tiny_folder, scheme, group)
    manifest = entry.manifest
    assert manifest["config"]["n_layers"] == 2
    if scheme == "bf16":
        assert manifest["quant"]["scheme"] is None and manifest["dtype"] == "bf16"
    else:
        assert manifest["quant"]["scheme"]["name"] == scheme and len(manifest["quant"]["modules"]) == 15
        assert "output" in manifest["quant"]["modules"]  # the 14 linears and the head: int8, in groups of 32
        assert plan_from_manifest(manifest["quant"])["output"] == parse_scheme("int8", None if scheme == "int8" else 32)
    stored = load_model(f"tiny:{scheme}", store=store)
    direct = load_model(str(folder), quant=scheme, group_size=group)
    ids = IDS % 384
    assert torch.equal(stored.model(ids), direct.model(ids))
    assert stored.kernels == direct.kernels


@pytest.mark.slow
def test_gguf_int4_entry_is_the_file_s_blocks(store, smollm2_path):
    entry, _ = convert_to_store(open_checkpoint(str(smollm2_path)), parse_scheme("int4", 32), "smol", store, {})
    header, _ = read_header(entry.path / WEIGHTS)
    assert header["layers.0.attn.q.qweight"]["dtype"] == "U8" and header["layers.0.attn.q.qweight"]["shape"] == [576, 288]
    # The tied Q8_0 head is stored as the file's int8 blocks.
    assert "output.weight" not in header
    assert header["output.qweight"]["dtype"] == "I8" and header["output.scales"]["shape"] == [49152, 18]
    stored = load_model("smol:int4", store=store)
    # A Q4_1 file runs as int4 group 32 with its Q8_0 head as it is, stored or run directly.
    direct = load_model(str(smollm2_path))
    assert direct.scheme == stored.scheme == parse_scheme("int4", 32)
    assert stored.kernels == direct.kernels
    with torch.no_grad():
        assert torch.equal(stored.model(IDS), direct.model(IDS))


def test_loading_does_not_requantize(store, tiny_folder, monkeypatch):
    stored_tiny(store, tiny_folder)
    import localllm.quant.convert

    def boom(*a, **k):
        raise AssertionError("quantized again")

    monkeypatch.setattr(localllm.quant.convert, "quantize", boom)
    load_model("tiny:int4", store=store)


def test_an_entry_from_a_newer_format_is_refused_in_one_line(store, tiny_folder):
    import json

    from localllm.loaders.store import FORMAT_VERSION, MANIFEST

    entry, _ = stored_tiny(store, tiny_folder)
    manifest = json.loads((entry.path / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    load_model("tiny:int4", store=store)  # its own format loads
    manifest["format_version"] = FORMAT_VERSION + 1
    (entry.path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(LocalLLMError, match=f"stored in format {FORMAT_VERSION + 1}, newer than this localllm reads"):
        load_model("tiny:int4", store=store)


def test_first_load_verifies_then_trusts_the_stamp(store, tiny_folder, monkeypatch):
    entry, _ = stored_tiny(store, tiny_folder)
    load_model("tiny:int4", store=store)
    assert (entry.path / ".verified.json").is_file()
    import localllm.loaders.store as store_mod

    calls = []
    monkeypatch.setattr(store_mod, "verify", lambda e: calls.append(e))
    load_model("tiny:int4", store=store)
    assert calls == []


def test_flipped_byte_is_caught_at_load(store, tiny_folder):
    entry, _ = stored_tiny(store, tiny_folder)
    path = entry.path / WEIGHTS
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(LocalLLMError, match=r"tiny:int4' is corrupted: model.safetensors does not match its sha256"):
        load_model("tiny:int4", store=store)


def test_truncated_file_is_caught(store, tiny_folder):
    entry, _ = stored_tiny(store, tiny_folder)
    path = entry.path / WEIGHTS
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(LocalLLMError, match="corrupted.*bytes instead of"):
        load_model("tiny:int4", store=store)


def test_wrong_shapes_are_caught(store, tiny_folder):
    """A manifest whose config does not match the tensors (hashes intact): a clear error, no crash."""
    entry, _ = stored_tiny(store, tiny_folder)
    manifest_path = entry.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["config"]["intermediate_size"] = 256
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(LocalLLMError, match="has shape .* the config implies"):
        load_model("tiny:int4", store=store)


def test_failed_conversion_leaves_nothing(store, tiny_folder, monkeypatch):
    import localllm.loaders.convert as conv

    def broken(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "write_artifact", broken)
    with pytest.raises(KeyboardInterrupt):
        stored_tiny(store, tiny_folder)
    assert store.list() == []
    assert not [p for p in store.models.iterdir() if p.name.startswith(".tmp-")]


def test_unknown_stored_name_suggests(store, tiny_folder):
    stored_tiny(store, tiny_folder)
    with pytest.raises(LocalLLMError, match="did you mean 'tiny"):
        load_model("tinny", store=store)


def test_int8_head_is_recorded_and_reloaded(store, tiny_folder):
    _, folder = tiny_folder("llama")
    entry, _ = convert_to_store(open_checkpoint(str(folder)), parse_scheme("int4", 32), "tiny", store, {},
                                quantize_head="int8")
    assert entry.manifest["quant"]["overrides"]["output"]["name"] == "int8"
    stored = load_model("tiny:int4", store=store)
    direct = load_model(str(folder), quant="int4", quantize_head="int8")
    assert stored.kernels == direct.kernels and stored.kernels["int8-group-cpu"] == 1
    ids = IDS % 384
    assert torch.equal(stored.model(ids), direct.model(ids))
