"""Log-probability entries (:class:`runtime.batch.TokenLogprob`) in each API's shape: OpenAI chat's
``logprobs.content``, the legacy completions' ``logprobs`` object, Ollama's ``logprobs`` list. Every
value is the model's own distribution: log-softmax of its logits, before temperature, top-k/top-p,
penalties and grammar masks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from localllm.runtime.batch import TokenLogprob

TokenBytes = Callable[[int], bytes]


def _token(token_bytes: TokenBytes, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_content(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> list[dict[str, Any]]:
    """OpenAI chat's ``choices[].logprobs.content`` (and Ollama's ``logprobs``, the same fields)."""
    return [{**_token(token_bytes, e.token, e.logprob),
             "top_logprobs": [_token(token_bytes, i, v) for i, v in e.top]} for e in entries]


def completion_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes, offset: int) -> dict[str, Any]:
    """The legacy completions' ``logprobs``: tokens, their log-probabilities, each one's top
    alternatives as {token: logprob}, and where each token's text starts (``offset``: the first's)."""
    tokens = [token_bytes(e.token).decode("utf-8", errors="replace") for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_bytes(i).decode("utf-8", errors="replace"): v for i, v in e.top}
                             for e in entries],
            "text_offset": offsets}
