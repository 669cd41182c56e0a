"""A model's config.json and GGUF metadata are untrusted: each size is checked for type and range, and
against the file's own tensors, before anything is built, so a damaged file is one line naming the
field (never a traceback, a misleading fix, or gigabytes of empty layers)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
from click.testing import CliRunner

from localllm.cli import main
from localllm.errors import LocalLLMError
from localllm.loaders.load import load_model
from tests.conftest import make_hf_model
from tests.test_gguf import write_llama_gguf

#: The fix every damaged-config message gives.
FIX = "is damaged or not a model localllm reads"


@pytest.fixture(scope="module", autouse=True)
def kernels_dir():
    """Every model here is refused before a kernel runs: the session's kernels need not be built."""
    yield None


@pytest.fixture(scope="module")
def gguf_model():
    return make_hf_model("llama")


def hf_with(folder: Path, tmp_path: Path, **edits: Any) -> Path:
    """A copy of the tiny HF folder with ``config.json`` keys replaced."""
    out = tmp_path / "model"
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config.update(edits)
    (out / "config.json").write_text(json.dumps(config))
    return out


def gguf_with(model, tmp_path: Path, monkeypatch, **edits: tuple[Any, gguf.GGUFValueType]) -> Path:
    """The tiny Llama as a loadable GGUF whose metadata keys ``edits`` replaces (value, GGUF type)."""

    class Edited(gguf.GGUFWriter):
        def write_header_to_file(self, *args: Any, **kwargs: Any) -> None:
            for key, (value, kind) in edits.items():
                self.add_key_value(key, value, kind)
            super().write_header_to_file(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFWriter", Edited)
    return write_llama_gguf(model, tmp_path / "model.gguf", types={"attn_v.weight": "F32"})


def refused(path: Path) -> str:
    with pytest.raises(LocalLLMError) as e:
        load_model(str(path), device="cpu")
    line = str(e.value)
    assert "\n" not in line and FIX in line and "--group-size" not in line, line
    return line


U32, I32, F32, STR = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32, gguf.GGUFValueType.FLOAT32,
                      gguf.GGUFValueType.STRING)


@pytest.mark.parametrize("edits, named", [
    ({"vocab_size": -1}, "vocab_size -1, outside 1.."),
    ({"num_attention_heads": 0}, "num_attention_heads 0, outside 1.."),
    ({"hidden_size": 10**9}, "hidden_size 1000000000, outside 1.."),
    ({"hidden_size": "big"}, "hidden_size as 'big', not an integer"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers as 2.5, not an integer"),
    ({"num_key_value_heads": 3}, "4 attention heads, not a multiple of its 3 kv heads"),
    ({"rms_norm_eps": 0}, "rms_norm_eps 0, which must be above 0 and at most 1"),
    ({"num_hidden_layers": 3}, "num_hidden_layers 3, but the file holds tensors for 2 layers"),
    ({"intermediate_size": 128}, "intermediate_size gives 128, but model.layers.0.mlp."),
    ({"vocab_size": 500}, "vocab_size gives 500, but "),
])
def test_a_damaged_config_json_is_one_line_naming_the_field(tiny_folder, tmp_path, edits, named):
    assert named in refused(hf_with(tiny_folder("llama")[1], tmp_path, **edits))


@pytest.mark.parametrize("edits, named", [
    ({"llama.attention.head_count": (0, U32)}, "llama.attention.head_count 0, outside 1.."),
    ({"llama.embedding_length": (10**9, U32)}, "llama.embedding_length 1000000000, outside 1.."),
    ({"llama.embedding_length": (128, U32)}, "llama.embedding_length gives 128, but token_embd.weight has shape (384, 64)"),
    ({"llama.feed_forward_length": ("x", STR)}, "llama.feed_forward_length as 'x', not an integer"),
    ({"llama.attention.key_length": (32, U32), "llama.rope.dimension_count": (32, U32)},
     "llama.attention.head_count x llama.attention.key_length gives 128, but blk.0.attn_q.weight has shape (64, 64)"),
    ({"llama.block_count": (3, U32)}, "llama.block_count 3, but the file holds tensors for 2 layers"),
    ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), F32)}, "layer_norm_rms_epsilon nan"),
    ({"llama.context_length": (-5, I32)}, "llama.context_length -5, outside 1.."),
])
def test_damaged_gguf_metadata_is_one_line_naming_the_field(gguf_model, tmp_path, monkeypatch, edits, named):
    assert named in refused(gguf_with(gguf_model, tmp_path, monkeypatch, **edits))


def test_show_and_run_say_the_same_in_one_error_line(tiny_folder, gguf_model, tmp_path, monkeypatch):
    folder = hf_with(tiny_folder("llama")[1], tmp_path, num_attention_heads=0)
    path = gguf_with(gguf_model, tmp_path, monkeypatch, **{"llama.attention.head_count": (0, U32)})
    for args in (["show", str(folder)], ["show", str(path)], ["run", str(path), "hi", "-n", "1"]):
        result = CliRunner().invoke(main, args, env={"LOCALLLM_DEBUG": ""})
        assert result.exit_code != 0
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: bad model:"), result.output
        assert "attention.head_count 0" in lines[0] or "num_attention_heads 0" in lines[0], result.output


_MEASURE = """
import resource, sys
from localllm.errors import LocalLLMError
from localllm.loaders.load import load_model
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_model(sys.argv[1], device="cpu")
    print("loaded")
except LocalLLMError as e:
    print(e)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def _peak_growth(path: Path) -> tuple[str, int]:
    """(the error line, peak RSS growth in bytes) of loading ``path`` in a process of its own."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())
    *lines, grown = proc.stdout.strip().splitlines()
    return lines[-1], int(grown)


def test_a_million_layers_are_refused_before_anything_grows(tiny_folder, gguf_model, tmp_path, monkeypatch):
    folder = hf_with(tiny_folder("llama")[1], tmp_path, num_hidden_layers=10**6)
    path = gguf_with(gguf_model, tmp_path, monkeypatch, **{"llama.block_count": (10**6, U32)})
    for what, named in ((folder, "num_hidden_layers 1000000"), (path, "llama.block_count 1000000")):
        line, grown = _peak_growth(what)
        assert named in line and FIX in line, line
        assert grown < 300_000_000, (what, grown)


def test_a_width_no_group_divides_is_not_sent_to_group_size(tiny_folder):
    """int4 takes groups of 32 to 256 only: a width none of them divides needs another scheme."""
    _, folder = tiny_folder("llama", hidden_size=72, intermediate_size=144)
    with pytest.raises(LocalLLMError) as e:
        load_model(str(folder), device="cpu", quant="int4")
    assert "does not divide the input width 72" in str(e.value) and "--group-size" not in str(e.value)
    assert "--quant int8 (per channel) or a float scheme" in str(e.value)
