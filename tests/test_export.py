"""``localllm export NAME DIR``: float HF folders, and stored int4/int8 weights kept quantized in the
compressed-tensors format, read back by transformers' compressed-tensors loader (what vLLM, SGLang
and TGI also read) to exactly the stored values; refusals where the format cannot hold them exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from localllm.cli import main
from localllm.loaders.convert import convert_to_store
from localllm.loaders.export_hf import hf_name
from localllm.loaders.load import load_model, open_checkpoint
from localllm.loaders.store import Store
from localllm.quant.formats import parse_scheme


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOCALLLM_DEBUG", raising=False)
    return tmp_path / "home"


def stored(folder: Path, name: str, quant: str, group: int | None = None, symmetric: bool = False) -> str:
    ckpt = open_checkpoint(str(folder))
    entry, _ = convert_to_store(ckpt, parse_scheme(quant, group, symmetric), name, Store(), {"path": str(folder)}, None)
    return entry.ref


def test_export_float_through_the_cli(home: Path, tiny_folder, tmp_path: Path) -> None:
    _, folder = tiny_folder("qwen2")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(folder), str(out), "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    assert open_checkpoint(str(out)).config == open_checkpoint(str(folder)).config


@pytest.mark.parametrize("quant,group,symmetric,tied", [("int4", 32, True, False), ("int8", None, False, False),
                                                        ("int8", 32, False, True)])
def test_keep_quant_reads_back_exactly_in_transformers(home: Path, tiny_folder, tmp_path: Path, quant: str,
                                                       group: int | None, symmetric: bool, tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    _, folder = tiny_folder("llama", **({"tie_word_embeddings": True} if tied else {}))
    ref = stored(folder, "tiny-tied" if tied else "tiny", quant, group, symmetric)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", ref, str(out), "--keep-quant", "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == ("pack-quantized" if quant == "int4" else "int-quantized")
    # the int8 head (beside int4 in groups of 32) leaves as its float values, tied where the model is
    assert q["ignore"] == ["lm_head"] and config["tie_word_embeddings"] is tied
    decompress = transformers.CompressedTensorsConfig(run_compressed=False)  # float Linear weights to compare
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                           quantization_config=decompress).eval()
    params = hf.state_dict()
    # Every weight decompresses to the stored values (the store's own dequantization), bit for bit.
    compared = 0
    for ours, w in open_checkpoint(ref).iter_tensors():
        if ours.endswith(".weight") and hf_name(ours) in params:
            assert torch.equal(params[hf_name(ours)].detach(), w.float()), ours
            compared += 1
    assert compared == 21  # the 14 linears, the 5 norms, the embedding and the head (tied or not)
    ids = torch.tensor([[1, 5, 9, 20, 30, 40]])
    ours_lm = load_model(ref, device="cpu", dtype="fp32")
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours_lm.model(ids), atol=1e-4, rtol=1e-4)


def test_keep_quant_refuses_what_it_cannot_hold_exactly(home: Path, tiny_folder, tmp_path: Path) -> None:
    _, folder = tiny_folder("llama")
    asymmetric = stored(folder, "tiny", "int4")  # the default int4 grid: free offsets
    result = CliRunner().invoke(main, ["export", asymmetric, str(tmp_path / "a"), "--keep-quant", "--dtype", "fp32"])
    assert result.exit_code == 1 and "asymmetric" in result.output
    int8 = stored(folder, "tiny8", "int8")  # fp32 scales: not exact in bf16
    result = CliRunner().invoke(main, ["export", int8, str(tmp_path / "b"), "--keep-quant"])
    assert result.exit_code == 1 and "not exact in bfloat16" in result.output and "--dtype fp32" in result.output
    assert not (tmp_path / "b" / "model.safetensors").exists()
    result = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "c"), "--keep-quant"])
    assert result.exit_code == 1 and "--keep-quant exports stored int4 or int8" in result.output
