"""Known answers that hold on every CPU: greedy text checked against the fp32 model's own margins.

A greedy answer is decided, token by token, by the gap between the best and the second-best logit.
Where that gap is a near-tie, CPUs that round differently (AVX2, AVX-512, AMX) pick different tokens,
so a test that asserts the answer passes on one machine and fails on the next. These helpers run the
model in fp32 (whose rounding differs between CPUs by ~1e-5, not the ~1e-2 of bf16), record each
greedy step's margin, and let a test assert an answer only after checking that every token up to it
was decided by a wide margin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.loaders.load import load_model
from localllm.runtime.chat import encode_chat

#: Far above fp32's cross-CPU differences (summation order: ~1e-4 on logits of ~25), far below a
#: typical decided step's gap (SmolLM2's answer to the README's question opens on a 0.08 gap, then 0.3+).
WIDE_MARGIN = 0.02


@dataclass
class GreedyAnswer:
    text: str
    pieces: list[str]  # the decoded text after each generated token
    margins: list[float]  # best minus second-best fp32 logit at each step

    def margin_until(self, needle: str) -> float:
        """The narrowest margin among the steps up to the one whose text first contains ``needle``."""
        for i, text in enumerate(self.pieces):
            if needle in text:
                return min(self.margins[: i + 1])
        raise AssertionError(f"{needle!r} is not in the fp32 greedy answer {self.text!r}")


def fp32_greedy(ref: str, prompt: str, max_tokens: int, chat: bool = True) -> GreedyAnswer:
    """The fp32 greedy continuation of ``prompt`` (through the chat template unless ``chat`` is
    false), with each step's margin. Full forwards, no cache: the reference, not the fast path."""
    lm = load_model(ref, quant="fp32")
    tok = lm.tokenizer
    ids = encode_chat(tok, [{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    stop = {*tok.eos_ids, *lm.config.eos_token_ids}
    out: list[int] = []
    pieces: list[str] = []
    margins: list[float] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = lm.model(torch.tensor([ids + out]))[0, -1].float()  # (vocab,)
            top = logits.topk(2)
            margins.append(float(top.values[0] - top.values[1]))
            nxt = int(top.indices[0])
            if nxt in stop:
                break
            out.append(nxt)
            pieces.append(tok.decode(out, skip_special=True))
    return GreedyAnswer(pieces[-1] if pieces else "", pieces, margins)
