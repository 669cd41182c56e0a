"""Embeddings: one L2-normalized vector per input, pooled from a decoder model's final hidden states.

Pooling is the model's own where it says (a sentence-transformers ``1_Pooling/config.json``, as
Qwen3-Embedding ships; a GGUF's ``pooling_type``): the last token's state (what decoder embedding
models are trained for, and the default), the mean over the input's tokens, or the first token's.

Inputs run whole, a batch at a time (shortest first, padded on the right: a causal model's states
of real tokens never see the padding), through the model's cache-free forward: no KV block is taken
from generation's pool, nothing is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import ContextManager

import torch

from localllm.runtime.model import Transformer

POOLINGS = ("last", "mean", "cls")
#: Padded tokens one forward takes at most (batch rows x the longest input).
BATCH_TOKENS = 4096


class EmbeddingStopped(Exception):
    """:func:`embed` was asked to stop (its caller's ``stop`` said so) before its last batch."""


@torch.inference_mode()
def embed(model: Transformer, inputs: Sequence[Sequence[int]], pooling: str = "last",
          batch_tokens: int = BATCH_TOKENS, turn: ContextManager | None = None,
          stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """(len(inputs), dim) float32 on the CPU, each row of unit length, in the inputs' order. ``turn``:
    held around each batch's forward (an engine's step lock: batches take turns with its steps).
    ``stop``: asked before each batch; true raises :class:`EmbeddingStopped` (a client that left
    stops its work between batches)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, not {pooling!r}")
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out = torch.empty(len(inputs), model.config.dim)
    start = 0
    while start < len(order):
        end = start + 1  # grow the batch while its padded size fits (the longest is the last)
        while end < len(order) and (end + 1 - start) * len(inputs[order[end]]) <= batch_tokens:
            end += 1
        rows = [list(inputs[i]) for i in order[start:end]]
        longest = len(rows[-1])
        tokens = torch.tensor([r + [0] * (longest - len(r)) for r in rows], device=model.device)  # (B, T)
        with turn if turn is not None else contextlib.nullcontext():
            if stop is not None and stop():  # asked once its turn came: a wait for it may be long
                raise EmbeddingStopped(f"stopped after {start} of {len(inputs)} inputs")
            h = model.hidden(tokens).float()  # (B, T, D)
        lengths = torch.tensor([len(r) for r in rows], device=h.device)
        if pooling == "last":
            pooled = h[torch.arange(len(rows), device=h.device), lengths - 1]  # (B, D)
        elif pooling == "cls":
            pooled = h[:, 0]
        else:
            real = (torch.arange(longest, device=h.device)[None, :] < lengths[:, None]).float()  # (B, T)
            pooled = (h * real[..., None]).sum(1) / lengths[:, None]
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
        out[torch.tensor(order[start:end])] = pooled.cpu()
        start = end
    return out
