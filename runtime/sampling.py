"""Turning logits into the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty.

Everything stays on the logits' device; only the chosen token id needs to leave it. A sampled token
is drawn by inverse CDF from a uniform number fixed by the request's seed and the token's position
(:func:`unit_random`), so a seeded request gives the same tokens however its steps are batched or
speculated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm import native
from localllm.errors import LocalLLMError

#: The CPU's greedy pick over a row of logits in one pass (``csrc/greedy.cpp``), built by
#: :mod:`localllm.native`; where it cannot be, :func:`greedy` takes torch's ops.
LIBRARY = native.NativeLibrary(
    "localllm_sampling", (Path(__file__).resolve().parent / "csrc" / "greedy.cpp",), ("greedy_argmax",))


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


MASK64 = (1 << 64) - 1


def unit_random(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on ``seed`` and ``position`` (splitmix64 of the
    two, 53 bits): the draw that picks the token at that position of a sequence.

    Tying each draw to its position, not to how many draws came before, makes a seeded request's
    tokens a function of its seed alone: the same whether its tokens were sampled one per step or
    several at once by speculative decoding (:mod:`runtime.speculate`), on any device."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


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

    With top-k the work is on k values, not the vocabulary: no full sort per token, and the
    temperature (which keeps the order) scales only the k kept.
    """
    idx = None
    if p.top_k and p.top_k < logits.shape[-1]:
        logits, idx = top_k(logits.float(), p.top_k)  # descending
        logits = logits / p.temperature
    else:
        logits = logits.float() / p.temperature
        if p.top_p < 1.0:
            logits, idx = logits.sort(dim=-1, descending=True)
    if p.min_p > 0:  # prob < min_p * best prob  <=>  logit < best logit + log(min_p)
        logits = logits.masked_fill(logits < logits.amax(-1, keepdim=True) + math.log(p.min_p), float("-inf"))
    if p.top_p < 1.0:  # candidates are sorted here
        probs = logits.softmax(-1)
        # Drop a token when the ones before it already reach top_p (the first one always stays).
        logits = logits.masked_fill(probs.cumsum(-1) - probs >= p.top_p, float("-inf"))
    return logits, idx


#: A vocabulary this large takes :func:`top_k`'s chunked search on the CPU; a smaller one, torch.topk.
CHUNKED_VOCAB = 1 << 16
CHUNK = 256


def _chunked(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) as its whole chunks (B, V // CHUNK, CHUNK), a view, and the tail past them
    (B, V % CHUNK), which starts at token id ``chunks * CHUNK``."""
    whole = logits.shape[1] // CHUNK * CHUNK
    return logits[:, :whole].reshape(logits.shape[0], -1, CHUNK), logits[:, whole:]


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values (B, k), descending, and their token ids (B, k). Among equal
    values the lower id comes first on the chunked search below; torch.topk orders them where it runs
    (either way the same every time for the same logits, and the candidates' probabilities alike).

    On the CPU torch.topk partially sorts a copy of the whole row, which over a 150k-260k-token
    vocabulary costs more than all the rest of sampling a token. Here: the row's maxima per chunk of
    CHUNK tokens, and the k-th largest of them (with the tail's values), ``floor``: at least k values
    reach it, so every one of the k largest does, and only the chunks whose maximum reaches it are
    searched. Rows whose floor is not finite (NaN, or fewer than k finite values, as under a grammar's
    mask) or is reached in most chunks (many equal values) go to torch.topk, as do a small
    vocabulary and another device.
    """
    B, V = logits.shape
    if logits.device.type != "cpu" or V < CHUNKED_VOCAB or V // CHUNK < 4 * k:
        return torch.topk(logits, k, dim=-1)
    blocks, tail = _chunked(logits)
    whole = blocks.shape[1] * CHUNK
    maxima = blocks.amax(-1)  # (B, chunks)
    floor = torch.cat([maxima, tail], dim=-1).topk(k, dim=-1).values[:, -1:]  # (B, 1)
    if not bool(torch.isfinite(floor).all()):
        return torch.topk(logits, k, dim=-1)
    values, ids = [], []
    for b in range(B):
        lo = floor[b]
        held = (maxima[b] >= lo).nonzero().squeeze(1)  # chunks holding a value >= lo, ascending
        if held.numel() > 8 * k:  # a row of many equal values: a search of the whole row anyway
            return torch.topk(logits, k, dim=-1)
        cand = blocks[b].index_select(0, held)  # (n, CHUNK)
        at = (cand >= lo).nonzero()  # (m, 2), row-major: ascending ids
        v, i = cand[at[:, 0], at[:, 1]], held[at[:, 0]] * CHUNK + at[:, 1]
        if tail.shape[1]:
            t = (tail[b] >= lo).nonzero().squeeze(1)
            v, i = torch.cat([v, tail[b, t]]), torch.cat([i, t + whole])
        order = v.sort(descending=True, stable=True).indices[:k]  # stable: equal values keep id order
        values.append(v[order])
        ids.append(i[order])
    return torch.stack(values), torch.stack(ids)


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """:func:`candidates` as a mask over the whole vocabulary (B, V) in fp32."""
    vals, idx = candidates(logits, p)
    if idx is None:
        return vals
    return torch.full(logits.shape, float("-inf"), device=logits.device).scatter(-1, idx, vals)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (B,) from logits (B, V), the first index on ties as ``argmax`` gives. On the
    CPU, fp32 logits over a vocabulary of :data:`CHUNKED_VOCAB` or more take localllm's one-pass
    kernel (:data:`LIBRARY`); else ``max(-1)``, which finds it faster than ``argmax`` (about a third
    of the time over a 262k vocabulary), and over a large vocabulary the first chunk holding the
    largest value, then the first place of it there, faster still."""
    if logits.device.type != "cpu":
        return logits.argmax(-1)
    B, V = logits.shape
    if (V >= CHUNKED_VOCAB and logits.dtype == torch.float32 and logits.is_contiguous()
            and native.available(LIBRARY)):
        return torch.ops.localllm.greedy_argmax(logits)
    if V < CHUNKED_VOCAB:
        return logits.max(-1).indices
    blocks, tail = _chunked(logits)
    best, at = blocks.amax(-1).max(-1)  # (B,): the largest value, and the first chunk holding it
    within = blocks.gather(1, at[:, None, None].expand(B, 1, CHUNK))[:, 0].max(-1).indices
    ids = at * CHUNK + within
    if tail.shape[1]:  # where the tail's best is larger (ties: the chunk's, the lower id)
        tail_best, tail_at = tail.max(-1)
        ids = torch.where(tail_best > best, tail_at + blocks.shape[1] * CHUNK, ids)
    return ids


def sample(
    logits: torch.Tensor,
    p: SamplingParams,
    u: torch.Tensor | None = None,
    recent: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V): the argmax when greedy, else the token where ``u`` (B,)
    (uniform in [0, 1), float64; see :func:`unit_random`) falls in the cumulative distribution of
    :func:`candidates` (inverse-CDF sampling: token t is picked with its probability). ``recent``: each
    row's last ``repeat_last_n`` token ids (1-D long tensors on the logits' device) for the repeat
    penalty (None: no penalty)."""
    if recent is not None and p.repeat_penalty != 1.0:
        logits = torch.cat([apply_repeat_penalty(logits[i : i + 1], ids[None], p.repeat_penalty)
                            for i, ids in enumerate(recent)])
    if p.greedy:
        return greedy(logits)
    if u is None:
        raise ValueError("sampling needs a uniform draw per row")
    vals, idx = candidates(logits, p)
    probs = vals.softmax(-1).double()  # (B, n)
    cdf = probs.cumsum(-1)
    # The first candidate whose cumulative probability exceeds u * total: never one of probability 0.
    u = u.to(cdf.device, non_blocking=True)  # a blocking upload would wait for the GPU (CUDA)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # (B, 1)
    # u * total rounded up to the total: past the end, where only the last candidate of probability
    # above 0 can be meant (the cumulative sum rises only there).
    last = (probs > 0).long().cumsum(-1).argmax(-1, keepdim=True)
    choice = torch.minimum(choice, last)
    return (choice if idx is None else idx.gather(-1, choice)).squeeze(-1)
