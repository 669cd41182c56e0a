"""Local Hugging Face model folders: ``config.json`` + safetensors shards, read one tensor at a time."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from localllm.errors import LocalLLMError
from localllm.loaders.safetensors_stream import iter_safetensors
from localllm.quant.convert import Plan, quantize_stream
from localllm.quant.formats import QuantScheme
from localllm.runtime.config import ModelConfig

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

# HF Llama/Mistral/Qwen2 parameter names -> ours (see runtime/model.py).
LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.q_proj.bias": "attn.q.bias",
    "self_attn.k_proj.bias": "attn.k.bias",
    "self_attn.v_proj.bias": "attn.v.bias",
    "self_attn.o_proj.weight": "attn.o.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
TOP_MAP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Buffers some checkpoints carry that we compute ourselves.
_IGNORED_RE = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


def rename(name: str, top: dict[str, str], layer_re: re.Pattern[str], layer: dict[str, str]) -> str | None:
    """Our name for a checkpoint name through a format's tables (top-level names, and per-layer
    suffixes after ``layer_re``'s layer number); None when the tables do not know it."""
    if name in top:
        return top[name]
    m = layer_re.match(name)
    if m and m.group(2) in layer:
        return f"layers.{m.group(1)}.{layer[m.group(2)]}"
    return None


def map_hf_name(name: str) -> str | None:
    """Our parameter name for an HF checkpoint name; None for entries we recompute (rope buffers)."""
    ours = rename(name, TOP_MAP, _LAYER_RE, LAYER_MAP)
    if ours is not None:
        return ours
    if _IGNORED_RE.search(name):
        return None
    raise LocalLLMError(f"unexpected tensor '{name}' in the checkpoint", "is this a Llama, Mistral or Qwen2 model?")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LocalLLMError(f"cannot read {path}: {e}", "the model folder looks damaged; download it again") from e


def refuse_pickles(folder: Path) -> None:
    """Raise if a folder holds weights only as pickles: loading a pickle can run arbitrary code."""
    if any(folder.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise LocalLLMError(
            f"{folder} has weights only as pickle files ({', '.join(pickles[:3])}), which localllm refuses to load "
            "because unpickling can run arbitrary code",
            "use a safetensors export of the model (many repos have one), or convert it yourself in a sandbox",
        )


class HFCheckpoint:
    """A local HF-format model folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        if not folder.is_dir():
            raise LocalLLMError(f"model folder not found: {folder}", "check the path")
        refuse_pickles(folder)
        if not (folder / "config.json").is_file():
            raise LocalLLMError(f"{folder} has no config.json", "point at a Hugging Face model folder or a .gguf file")
        gen_path = folder / "generation_config.json"
        self.hf_config = _read_json(folder / "config.json")
        gen = _read_json(gen_path) if gen_path.is_file() else None
        self.config = ModelConfig.from_hf(self.hf_config, gen)
        self.files = self._weight_files()

    def _weight_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(_read_json(index)["weight_map"].values()))
            files = [self.folder / n for n in names]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise LocalLLMError(
                    f"{self.folder} lacks shard(s) {', '.join(missing)} named by its index", "download the model again"
                )
            return files
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise LocalLLMError(f"{self.folder} has no *.safetensors weights", "point at a folder with safetensors weights")
        return files

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, tensor) pairs, one tensor in memory at a time."""
        for path in self.files:
            for key, tensor in iter_safetensors(path):
                ours = map_hf_name(key)
                if ours is not None:
                    yield ours, tensor

    def default_scheme(self) -> QuantScheme | None:
        """Float checkpoints run as they are unless a scheme is asked for."""
        return None

    def default_head(self, scheme: QuantScheme | None) -> QuantScheme | None:
        """A float checkpoint's head stays 16-bit unless asked."""
        return None

    def exact_plan(self, plan: Plan) -> Plan:
        """Float weights quantize into any scheme asked for: the plan stands."""
        return plan

    def iter_canonical(self, plan: Plan, tied_head: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors with the modules in ``plan`` quantized on the fly, one tensor at a time."""
        return quantize_stream(self.iter_tensors(), plan, tied_head)

    def describe(self) -> str:
        return str(self.folder)
