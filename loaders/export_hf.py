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
from localllm.quant.formats import canonical_shapes, dequantize_weight
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
    if ckpt.config.arch not in _ARCHITECTURES:  # before the folder is made: nothing is left behind
        raise LocalLLMError(f"cannot export a {ckpt.config.arch} model as a Hugging Face folder yet",
                            f"export writes {', '.join(_ARCHITECTURES)} models; run this one with localllm")
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


# --------------------------------------------------------------------------- quantized (compressed-tensors)
#: The ``quantization_config`` format names of compressed-tensors (read by vLLM, SGLang, TGI and transformers).
_CT_FORMATS = {"int4": "pack-quantized", "int8": "int-quantized"}


def _ct_weights(scheme: Any) -> dict[str, Any]:
    """compressed-tensors' QuantizationArgs for ``scheme`` (symmetric integer weights)."""
    grouped = scheme.group_size is not None
    return {"num_bits": 4 if scheme.name == "int4" else 8, "type": "int", "symmetric": True,
            "strategy": "group" if grouped else "channel", "group_size": scheme.group_size if grouped else None,
            "dynamic": False, "observer": "minmax", "actorder": None, "block_structure": None}


def ct_quantization_config(scheme: Any) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for weights of ``scheme`` in every Linear but the head
    (``lm_head``, which leaves as float values: :func:`export_quantized_folder`), activations left in the
    model's dtype (W4A16 / W8A16)."""
    return {
        "quant_method": "compressed-tensors",
        "format": _CT_FORMATS[scheme.name],
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _ct_weights(scheme),
                                      "input_activations": None, "output_activations": None,
                                      "format": _CT_FORMATS[scheme.name]}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def _exact_scales(scales: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """``scales`` in ``dtype``, refused unless every value survives the conversion unchanged."""
    converted = scales.to(dtype)
    if not torch.equal(converted.float(), scales.float()):
        bad = int((converted.float() != scales.float()).sum())
        raise LocalLLMError(
            f"{where}: {bad} of {scales.numel()} scales are not exact in {_TORCH_NAMES[dtype]}, so the exported "
            "weights would differ from the stored ones",
            "export with --dtype fp32 (exact), or without --keep-quant (float weights)")
    return converted


def ct_tensors(module_hf: str, parts: dict[str, torch.Tensor], scheme: Any, dtype: torch.dtype
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """One quantized module's canonical tensors as compressed-tensors writes them, exactly, or a refusal.

    int4: ours is ``w = q * scale + offset`` (q in 0..15); compressed-tensors' symmetric int4 is
    ``w = s * scale`` with s in -8..7, stored as ``s + 8`` packed eight to an int32, low bits first
    (``weight_packed``). That is ours exactly when ``offset == -8 * scale`` (a symmetric grid: GGUF
    Q4_0, ``--quant int4`` with symmetric groups); an asymmetric grid would need a zero point per
    group that is an integer, which it is not in general, so it is refused. int8: ``w = q * scale``
    per channel or group, the same in both.
    """
    from localllm.quant.formats import unpack_int4

    scales = parts["scales"]
    if scheme.name == "int4":
        if not torch.equal(parts["offsets"].float(), -8 * scales.float()):
            raise LocalLLMError(
                f"{module_hf}: the int4 grid is asymmetric (w = q*scale + offset with free offsets), which "
                "compressed-tensors' integer zero points cannot hold exactly",
                "pull with a symmetric int4 grid, export int8, or export without --keep-quant (float weights)")
        q = unpack_int4(parts["qweight"]).to(torch.int32)  # (out, in) codes 0..15 = s + 8
        out, inp = q.shape
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        packed = (q.view(out, inp // 8, 8) << shifts).sum(-1, dtype=torch.int64)
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the int32 bit pattern
        yield f"{module_hf}.weight_packed", packed
        yield f"{module_hf}.weight_shape", torch.tensor([out, inp], dtype=torch.int32)
        yield f"{module_hf}.weight_scale", _exact_scales(scales, dtype, module_hf)
    else:
        yield f"{module_hf}.weight", parts["qweight"].to(torch.int8)
        s = scales if scales.dim() == 2 else scales[:, None]
        yield f"{module_hf}.weight_scale", _exact_scales(s, dtype, module_hf)


def _ct_layout(config: ModelConfig, plan: dict[str, Any], dtype: torch.dtype, untie: bool = False
               ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for ours, t in empty_model(config).state_dict().items():
        if config.tie_embeddings and ours == "output.weight" and not untie:
            continue
        module, _, leaf = ours.rpartition(".")
        hf = hf_name(ours)
        if module in plan and module != "output" and leaf == "weight":
            scheme = plan[module]
            out, inp = t.shape
            base = hf.removesuffix(".weight")
            groups = (inp // scheme.group_size,) if scheme.group_size else (1,)
            if scheme.name == "int4":
                layout[f"{base}.weight_packed"] = ((out, inp // 8), torch.int32)
                layout[f"{base}.weight_shape"] = ((2,), torch.int32)
            else:
                layout[f"{base}.weight"] = ((out, inp), torch.int8)
            layout[f"{base}.weight_scale"] = ((out, *groups), dtype)
        else:
            layout[hf] = (tuple(t.shape), dtype)
    return layout


def export_quantized_folder(source: Union[str, Path, Any], folder: Path, dtype: str = "bf16") -> Path:
    """Write a stored int4/int8 model as an HF folder whose quantized layers stay quantized, in the
    compressed-tensors format (``quantization_config`` in ``config.json``) that vLLM, SGLang and TGI
    load. Refused, naming the module and the reason, wherever the stored values would not come out
    exactly (an asymmetric int4 grid; scales that ``dtype`` cannot hold); float export has no such limit."""
    from localllm.loaders.artifact import ArtifactCheckpoint
    from localllm.loaders.load import load_tokenizer, open_checkpoint

    if dtype not in EXPORT_DTYPES:
        raise LocalLLMError(f"cannot export in '{dtype}'", f"use one of {', '.join(EXPORT_DTYPES)}")
    torch_dtype = EXPORT_DTYPES[dtype]
    ckpt = open_checkpoint(str(source)) if isinstance(source, (str, Path)) else source
    plan = ckpt.plan if isinstance(ckpt, ArtifactCheckpoint) else {}
    head = plan.get("output")
    schemes = {s for m, s in plan.items() if m != "output"}
    if not schemes or any(s.name not in _CT_FORMATS for s in schemes):
        what = ", ".join(sorted(s.label() for s in schemes)) or "float weights"
        raise LocalLLMError(f"{ckpt.describe()} holds {what}: --keep-quant exports stored int4 or int8 weights",
                            "pull the model with --quant int4 or int8 first, or export without --keep-quant")
    if any(s.act_order for s in schemes):
        raise LocalLLMError(f"{ckpt.describe()} holds GPTQ act-order layers (input columns stored in an order "
                            "of their own), which this compressed-tensors export does not describe",
                            "export without --keep-quant")
    if len(schemes) > 1:
        raise LocalLLMError(f"{ckpt.describe()} mixes {', '.join(sorted(s.label() for s in schemes))}: one "
                            "quantization config cannot describe it exactly", "export without --keep-quant")
    scheme = next(iter(schemes))
    # The head leaves as its float values (exact in fp32), whatever its stored scheme: a quantized lm_head is
    # where servers that read compressed-tensors disagree most. A tied head that serves as the embedding
    # is the tied table; one stored beside its own 16-bit table (older artifacts) is exported untied.
    tied = ckpt.config.tie_embeddings
    untie = tied and head is not None and ckpt.stores_embedding
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config(ckpt.config, torch_dtype)
    config["tie_word_embeddings"] = tied and not untie
    config["quantization_config"] = ct_quantization_config(scheme)
    layout = _ct_layout(ckpt.config, plan, torch_dtype, untie)
    head_name = hf_name("embed.weight" if tied and not untie else "output.weight")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in ckpt.iter_canonical(plan, False):
            module, _, leaf = key.rpartition(".")
            if module not in plan or leaf == "bias":
                if not (tied and key == "output.weight"):
                    yield hf_name(key), t
                continue
            parts = pending.setdefault(module, {})
            parts[leaf] = t
            own = plan[module]
            if set(parts) != set(canonical_shapes(own, 2, 64)):
                continue
            parts = pending.pop(module)
            if module == "output":
                yield head_name, dequantize_weight(parts, own).to(torch_dtype)
            else:
                yield from ct_tensors(hf_name(module + ".weight").removesuffix(".weight"), parts, own, torch_dtype)

    path = folder / WEIGHTS
    metadata = {"format": "pt", "producer": f"localllm {localllm.__version__}"}
    try:
        write_safetensors(path, layout, tensors(), metadata)
    except ValueError as e:
        path.unlink(missing_ok=True)
        raise LocalLLMError(f"{ckpt.describe()}: {e}", "the stored model does not match its config") from e
    except LocalLLMError:
        path.unlink(missing_ok=True)
        raise
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", generation_config(ckpt.config))
    _save_tokenizer(load_tokenizer(ckpt), folder, ckpt.config)
    return folder
