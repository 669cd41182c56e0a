"""Decode with and without the KV cache: why the cache exists, measured.

Without a cache every step runs the whole sequence again, so a step's cost grows with the length;
with it a step runs one token against stored keys/values and stays flat, at the price of
``2 * layers * kv_heads * head_dim * bytes`` of memory per token.
"""

from __future__ import annotations

import time

import torch

from localllm.runtime.engine import sequence_engine
from localllm.runtime.model import Transformer
from localllm.runtime.sampling import SamplingParams


@torch.inference_mode()
def decode_latencies(model: Transformer, prompt: torch.Tensor, steps: int, use_cache: bool) -> list[float]:
    """Seconds taken by each of ``steps`` greedy decode steps after ``prompt`` (1, T).

    With ``use_cache`` the prompt is prefilled once and each step runs one token through the batch
    engine (its paged KV pool); without, each step runs a full forward over the prompt and every token
    generated so far.
    """
    times: list[float] = []
    T = prompt.shape[1]
    if use_cache:
        engine = sequence_engine(model, T + steps + 2, speculate=False)  # one token a step; its own pool
        handle = engine.submit(prompt[0].tolist(), SamplingParams(temperature=0), max_tokens=steps + 1)
        handle.result()
        return handle.stats.token_latencies_s[:steps]
    seq = prompt
    for _ in range(steps):
        t0 = time.perf_counter()
        token = model(seq)[:, -1].argmax(-1, keepdim=True)
        _ = token.item()
        times.append(time.perf_counter() - t0)
        seq = torch.cat([seq, token], dim=1)
    return times
