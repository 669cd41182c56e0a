"""Decode with and without the KV cache: why the cache exists, measured.

Without a cache every step runs the whole sequence again, so a step's cost grows with the length;
with it a step runs one token against stored keys/values and stays flat, at the price of
``2 * layers * kv_heads * head_dim * bytes`` of memory per token.
"""

from __future__ import annotations

import time

import torch

from localllm.runtime.generate import decode_one_token, prefill
from localllm.runtime.model import Transformer


@torch.inference_mode()
def decode_latencies(model: Transformer, prompt: torch.Tensor, steps: int, use_cache: bool) -> list[float]:
    """Seconds taken by each of ``steps`` greedy decode steps after ``prompt`` (1, T).

    With ``use_cache`` the prompt is prefilled once and each step runs one token; without, each step
    runs a full forward over the prompt and every token generated so far.
    """
    times: list[float] = []
    T = prompt.shape[1]
    if use_cache:
        cache = model.new_cache(T + steps + 1)  # this run's own, freed when it returns
        token = prefill(model, cache, prompt).argmax(-1, keepdim=True)  # (1, 1)
        pos_t = torch.empty(1, dtype=torch.long, device=prompt.device)
        for step in range(steps):
            t0 = time.perf_counter()
            pos_t.fill_(T + step)
            token = decode_one_token(model, cache, token, pos_t, T + step).argmax(-1, keepdim=True)
            _ = token.item()  # the step is done when its token is known
            times.append(time.perf_counter() - t0)
    else:
        seq = prompt
        for _ in range(steps):
            t0 = time.perf_counter()
            token = model(seq)[:, -1].argmax(-1, keepdim=True)
            _ = token.item()
            times.append(time.perf_counter() - t0)
            seq = torch.cat([seq, token], dim=1)
    return times
