"""Embeddings for both APIs: inputs (texts or token ids) encoded, fitted to the context (cut, or
refused), pooled by the model's engine (:meth:`runtime.batch.BatchEngine.embed`) on a worker thread,
and shortened to ``dimensions`` (the leading ones, renormalized) where asked."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from starlette.requests import Request

from localllm.errors import LocalLLMError
from localllm.server.common import state
from localllm.server.errors import ApiError
from localllm.server.models import DEFAULT


@dataclass
class Embedded:
    vectors: list[list[float]]
    prompt_tokens: int
    load_s: float
    total_s: float


def inputs_of(value: Any, param: str = "input", ids_allowed: bool = True) -> list[str | list[int]]:
    """A string, strings, token ids, or lists of token ids (the last two OpenAI's only)."""
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)

    if isinstance(value, str):
        return [value]
    if ids_allowed and is_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or (ids_allowed and is_ids(v)) for v in value):
        return list(value)
    want = "a string, strings, token ids or lists of token ids" if ids_allowed else "a string or strings"
    raise ApiError(400, f"'{param}' must be {want}, not empty", param=param)


async def embed(request: Request, model: str, inputs: list[str | list[int]], truncate: bool,
                dimensions: int | None, keep_alive: object = DEFAULT) -> Embedded:
    started = time.perf_counter()
    manager = state(request).manager
    slot, load_s = await manager.acquire(model, keep_alive)
    try:
        tok, ctx = slot.lm.tokenizer, slot.engine.max_seq_len

        def run() -> tuple[torch.Tensor, int]:
            ids = [tok.encode(x) if isinstance(x, str) else list(x) for x in inputs]
            for i, one in enumerate(ids):
                if any(not 0 <= t < tok.vocab_size for t in one):
                    raise ApiError(400, f"'input[{i}]' has token ids outside the vocabulary", param="input")
                if truncate:
                    ids[i] = one[:ctx]
            try:  # the engine refuses an empty input, and one past the context
                return slot.engine.embed(ids, slot.lm.pooling), sum(len(one) for one in ids)
            except LocalLLMError as e:
                raise ApiError(400, e.one_line(), param="input") from None

        vectors, count = await anyio.to_thread.run_sync(run)
    finally:
        manager.release(slot)
    if dimensions is not None:
        if dimensions > vectors.shape[1]:
            raise ApiError(400, f"'dimensions' is {dimensions}; this model's embeddings have {vectors.shape[1]}",
                           param="dimensions")
        vectors = torch.nn.functional.normalize(vectors[:, :dimensions], dim=-1)
    return Embedded(vectors.tolist(), count, load_s, time.perf_counter() - started)
