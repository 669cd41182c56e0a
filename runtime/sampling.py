"""Turning logits into the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty.

Everything stays on the logits' device; only the chosen token id needs to leave it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from localllm.errors import LocalLLMError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (argmax); the filters then do nothing."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    #: >1 makes tokens already in the last ``repeat_last_n`` tokens less likely (CTRL-style).
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise LocalLLMError(f"temperature {self.temperature} is negative", "use 0 (greedy) or more")
        if not 0.0 < self.top_p <= 1.0:
            raise LocalLLMError(f"top-p {self.top_p} is out of range", "use a value in (0, 1]")
        if not 0.0 <= self.min_p < 1.0:
            raise LocalLLMError(f"min-p {self.min_p} is out of range", "use a value in [0, 1)")
        if self.top_k < 0:
            raise LocalLLMError(f"top-k {self.top_k} is negative", "use 0 (off) or more")
        if self.repeat_penalty <= 0:
            raise LocalLLMError(f"repeat penalty {self.repeat_penalty} must be positive", "1.0 turns it off")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A seeded generator on ``device`` for reproducible sampling, or None (global RNG)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def apply_repeat_penalty(logits: torch.Tensor, recent: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (B, V); recent (B, N) token ids. Positive logits are divided, negative multiplied."""
    if penalty == 1.0 or recent.numel() == 0:
        return logits
    picked = logits.gather(-1, recent)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(-1, recent, picked)


def candidates(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, then top-k, top-p and min-p: the surviving candidates' scaled logits (B, n), -inf
    for those filtered out, and their token ids (B, n) (None: n is the whole vocabulary, in order).

    With top-k the work is on k values, not the vocabulary: no full sort per token.
    """
    logits = logits.float() / p.temperature
    idx = None
    if p.top_k and p.top_k < logits.shape[-1]:
        logits, idx = torch.topk(logits, p.top_k, dim=-1)  # sorted, descending
    elif p.top_p < 1.0:
        logits, idx = logits.sort(dim=-1, descending=True)
    if p.min_p > 0:  # prob < min_p * best prob  <=>  logit < best logit + log(min_p)
        logits = logits.masked_fill(logits < logits.amax(-1, keepdim=True) + math.log(p.min_p), float("-inf"))
    if p.top_p < 1.0:  # candidates are sorted here
        probs = logits.softmax(-1)
        # Drop a token when the ones before it already reach top_p (the first one always stays).
        logits = logits.masked_fill(probs.cumsum(-1) - probs >= p.top_p, float("-inf"))
    return logits, idx


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """:func:`candidates` as a mask over the whole vocabulary (B, V) in fp32."""
    vals, idx = candidates(logits, p)
    if idx is None:
        return vals
    return torch.full(logits.shape, float("-inf"), device=logits.device).scatter(-1, idx, vals)


def sample(
    logits: torch.Tensor,
    p: SamplingParams,
    recent: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V)."""
    if recent is not None:
        logits = apply_repeat_penalty(logits, recent, p.repeat_penalty)
    if p.greedy:
        return logits.argmax(-1)
    vals, idx = candidates(logits, p)
    choice = torch.multinomial(vals.softmax(-1), 1, generator=generator)  # (B, 1)
    return (choice if idx is None else idx.gather(-1, choice)).squeeze(-1)
