"""Embeddings for both APIs: inputs (texts or token ids) encoded, fitted to the context (cut, or
refused), pooled by the model's engine (:meth:`runtime.batch.BatchEngine.embed`) on a thread of its
own that stops between batches once its request is over, and shortened to ``dimensions`` (the
leading ones, renormalized) where asked."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from starlette.requests import Request

from localllm.errors import LocalLLMError
from localllm.server.common import state
from localllm.server.errors import ApiError
from localllm.server.models import DEFAULT, in_own_thread
from localllm.server.streaming import unless_disconnected


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
    """``inputs`` embedded on ``model``, while listening for the client: one that leaves (then
    :class:`localllm.server.streaming.ClientGone`), or a shutdown that cuts the request, stops the
    work before its next batch. The work runs on a thread of its own, never waited for once the
    request is over."""
    started = time.perf_counter()
    manager = state(request).manager

    async def work() -> tuple[torch.Tensor, int, float]:
        slot, load_s = await manager.acquire(model, keep_alive)
        stop = threading.Event()
        tok, ctx = slot.lm.tokenizer, slot.engine.max_seq_len

        def run(_: str) -> tuple[torch.Tensor, int]:
            ids = [tok.encode(x) if isinstance(x, str) else list(x) for x in inputs]
            for i, one in enumerate(ids):
                if any(not 0 <= t < tok.vocab_size for t in one):
                    raise ApiError(400, f"'input[{i}]' has token ids outside the vocabulary", param="input")
                if truncate:
                    ids[i] = one[:ctx]
            try:  # the engine refuses an empty input, and one past the context
                return slot.engine.embed(ids, slot.lm.pooling, stop=stop.is_set), sum(len(one) for one in ids)
            except LocalLLMError as e:
                raise ApiError(400, e.one_line(), param="input") from None

        try:
            vectors, count = await in_own_thread(run, "embed")
        finally:
            stop.set()  # the request is over, however: what still runs ends before its next batch
            manager.release(slot)
        return vectors, count, load_s

    vectors, count, load_s = await unless_disconnected(request, work)
    if dimensions is not None:
        if dimensions > vectors.shape[1]:
            raise ApiError(400, f"'dimensions' is {dimensions}; this model's embeddings have {vectors.shape[1]}",
                           param="dimensions")
        vectors = torch.nn.functional.normalize(vectors[:, :dimensions], dim=-1)
    return Embedded(vectors.tolist(), count, load_s, time.perf_counter() - started)
