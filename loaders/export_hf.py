"""Write any checkpoint our loaders read (GGUF file, HF folder, store entry) as a Hugging Face model folder.

The folder is what ``transformers`` and the Hub hold: ``config.json`` (the family's ``*Config`` fields),
``generation_config.json``, ``model.safetensors`` with transformers' parameter names (the inverse of
:mod:`loaders.checkpoint`'s map; no ``lm_head`` when the embeddings are tied) and the tokenizer files.
Quantized weights are dequantized: the export is a float model in the dtype asked for.

The weights are written in one pass, one tensor at a time (:func:`loaders.safetensors_stream.write_safetensors`
lays the header out first from the model's structure): memory stays at one tensor, whatever the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import torch

import localllm
from localllm.errors import LocalLLMError
from localllm.loaders.build import empty_model
from localllm.loaders.checkpoint import LAYER_MAP, TOP_MAP
from localllm.loaders.safetensors_stream import write_safetensors
from localllm.runtime.config import ModelConfig

WEIGHTS = "model.safetensors"
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TORCH_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_LAYER_INVERSE = {ours: hf for hf, ours in LAYER_MAP.items()}
_TOP_INVERSE = {ours: hf for hf, ours in TOP_MAP.items()}


def hf_name(ours: str) -> str:
    """transformers' parameter name for one of ours (``layers.3.attn.q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if ours in _TOP_INVERSE:
        return _TOP_INVERSE[ours]
    prefix, index, rest = ours.split(".", 2)
    if prefix != "layers" or rest not in _LAYER_INVERSE:
        raise LocalLLMError(f"no transformers name for tensor '{ours}'")
    return f"model.layers.{index}.{_LAYER_INVERSE[rest]}"


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``config``: the fields of transformers' Llama / Mistral / Qwen2 configs."""
    if config.rope_freq_factors is not None:
        # A Llama 3.x GGUF's rope_freqs: per-frequency divisors that an HF config can only express as
        # llama3 scaling parameters, which the file does not keep. Written without them, the export
        # would be another model.
        raise LocalLLMError(
            "cannot export a model whose RoPE comes with per-frequency factors (a Llama 3.x GGUF's "
            "rope_freqs): an HF config.json has no field for them",
            "export the original HF checkpoint instead, or run this model with localllm",
        )
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[config.arch]],
        "model_type": config.arch,
        "hidden_size": config.dim,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_seq_len,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _one_or_list(config.eos_token_ids),
        "torch_dtype": _TORCH_NAMES[dtype],
    }
    if config.arch == "llama":
        hf["attention_bias"] = config.attention_bias
        hf["mlp_bias"] = False
    if config.arch in ("mistral", "qwen2"):
        hf["sliding_window"] = config.sliding_window
        hf["use_sliding_window"] = config.sliding_window is not None
    return hf


def _one_or_list(ids: list[int]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def generation_config(config: ModelConfig) -> dict[str, Any]:
    return {"bos_token_id": config.bos_token_id, "eos_token_id": _one_or_list(config.eos_token_ids)}


# --------------------------------------------------------------------------- weights
def weights_layout(config: ModelConfig, dtype: torch.dtype) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]],
                                                                     dict[str, str]]:
    """HF name -> (shape, dtype) of every tensor of the model (built on ``meta``, nothing allocated), and
    our name -> HF name.  A tied head is left out: transformers ties it back to the embedding."""
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    names: dict[str, str] = {}
    for ours, t in empty_model(config).state_dict().items():
        if config.tie_embeddings and ours == "output.weight":
            continue
        names[ours] = hf_name(ours)
        layout[names[ours]] = (tuple(t.shape), dtype)
    return layout, names


def _hf_tensors(ckpt: Any, names: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's float tensors under HF names; a tied head some files still store is dropped."""
    for ours, t in ckpt.iter_tensors():
        if ours in names:
            yield names[ours], t
        elif not (ckpt.config.tie_embeddings and ours == "output.weight"):
            raise LocalLLMError(f"{ckpt.describe()}: unexpected tensor '{ours}'",
                                "the checkpoint does not match its config")


def write_weights(ckpt: Any, path: Path, dtype: torch.dtype) -> None:
    """Stream ``ckpt``'s float tensors into ``path`` (safetensors, HF names), one tensor in memory at a time."""
    layout, names = weights_layout(ckpt.config, dtype)
    metadata = {"format": "pt", "producer": f"localllm {localllm.__version__}"}
    try:
        write_safetensors(path, layout, _hf_tensors(ckpt, names), metadata)
    except ValueError as e:  # a missing, repeated or misshapen tensor
        path.unlink(missing_ok=True)
        raise LocalLLMError(f"{ckpt.describe()}: {e}", "the checkpoint does not match its config") from e


# --------------------------------------------------------------------------- the folder
def export_hf_folder(source: Union[str, Path, Any], folder: Path, dtype: str = "bf16") -> Path:
    """Write ``source`` (a path or name :func:`loaders.load.open_checkpoint` takes, or a checkpoint) as an
    HF model folder in ``folder`` (created if needed), weights in ``dtype`` (bf16, fp16 or fp32)."""
    from localllm.loaders.load import load_tokenizer, open_checkpoint

    if dtype not in EXPORT_DTYPES:
        raise LocalLLMError(f"cannot export in '{dtype}'", f"use one of {', '.join(EXPORT_DTYPES)}")
    torch_dtype = EXPORT_DTYPES[dtype]
    ckpt = open_checkpoint(str(source)) if isinstance(source, (str, Path)) else source
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", hf_config(ckpt.config, torch_dtype))
    _write_json(folder / "generation_config.json", generation_config(ckpt.config))
    write_weights(ckpt, folder / WEIGHTS, torch_dtype)
    _save_tokenizer(load_tokenizer(ckpt), folder, ckpt.config)
    return folder


def _save_tokenizer(tokenizer: Any, folder: Path, config: ModelConfig) -> None:
    """``Tokenizer.save``, plus the keys transformers' ``AutoTokenizer`` wants in tokenizer_config.json."""
    tokenizer.save(folder)
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text(encoding="utf-8"))
    settings.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    settings.setdefault("model_max_length", config.max_seq_len)
    _write_json(path, settings)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
