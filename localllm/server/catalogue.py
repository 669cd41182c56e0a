"""The models a request can name without a path, as both APIs list them (OpenAI's ``/v1/models``,
Ollama's ``/api/tags``): the store's entries and the embedded default model; and what a model can do,
as Ollama's ``capabilities`` say it. On worker threads: these read the store and the disk."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from localllm.runtime.textstream import template_thinks


@dataclass(frozen=True)
class Listed:
    """One model the catalogue lists: its name, when it was stored, its size on disk, a digest that
    names its weights, and the facts Ollama's ``details`` are made of (architecture, parameters,
    scheme, format)."""

    name: str
    modified: datetime
    size: int
    digest: str
    arch: str
    parameters: int
    scheme: str
    format: str


def listed() -> list[Listed]:
    """Every model ``run`` can name without a path: the store's entries, then the embedded default
    model (unless the store holds a model of its name, which the name then means)."""
    from localllm.loaders.store import Store
    from localllm.paths import DEFAULT_MODEL, default_model_gguf
    from localllm.runtime.config import ModelConfig

    out = []
    for e in Store().list():
        cfg = ModelConfig.from_dict(e.manifest["config"])
        weights = (e.manifest.get("files") or {}).get("model.safetensors") or {}
        out.append(Listed(e.ref, e.modified, e.size_bytes,
                          weights.get("sha256") or hashlib.sha256(e.ref.encode()).hexdigest(),
                          cfg.arch, cfg.num_parameters(), str(e.scheme), "safetensors"))
    gguf = default_model_gguf()
    if gguf is not None and not any(e.name.split(":")[0] == DEFAULT_MODEL for e in out):
        stat = gguf.stat()
        arch, parameters, scheme = _gguf_facts(str(gguf), stat.st_mtime_ns)
        digest = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
        out.append(Listed(DEFAULT_MODEL, datetime.fromtimestamp(stat.st_mtime, timezone.utc), stat.st_size, digest,
                          arch, parameters, scheme, "gguf"))
    return out


@functools.lru_cache(maxsize=4)
def _gguf_facts(path: str, mtime_ns: int) -> tuple[str, int, str]:
    """A GGUF file's architecture, parameter count and scheme (read once per file version)."""
    from localllm.loaders.describe import describe_path

    facts = describe_path(Path(path))
    return facts["architecture"], facts["parameters"], str(facts["scheme"])


def capabilities(template: str | None) -> list[str]:
    """What a model with chat template ``template`` can do here, in Ollama's words: every model
    completes and embeds (``/api/embed`` pools any model's hidden states); one with a chat template
    takes tools (in its own call syntax, or the generic form where its template takes none); one
    whose template writes ``<think>`` blocks thinks. Never vision: no model here reads images."""
    out = ["completion"]
    if template:
        out.append("tools")
        if template_thinks(template):
            out.append("thinking")
    out.append("embedding")
    return out


def chat_template(path: str) -> str:
    """The chat template the model at ``path`` (a store entry's folder, a model folder or a GGUF file)
    renders its chats with; "" where it has none."""
    from localllm.loaders.load import load_tokenizer, open_checkpoint

    return load_tokenizer(open_checkpoint(path)).chat_template or ""


def openai_model(name: str, created: int) -> dict[str, Any]:
    """OpenAI's model object."""
    return {"id": name, "object": "model", "created": created, "owned_by": "localllm"}
