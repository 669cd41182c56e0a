"""The public generation API: text in, streamed text out.

    engine = Engine(model, tokenizer, ctx=2048)
    for piece in engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0)):
        print(piece, end="", flush=True)
    engine.stats  # GenerationStats of that call

Token ids come from :class:`runtime.generate.Generator`; text is decoded incrementally (never half
a UTF-8 character) and cut at stop strings without printing any part of one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from localllm.runtime.chat import encode_chat
from localllm.runtime.generate import GenerationStats, Generator
from localllm.runtime.model import Transformer
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.textstream import StopStringFilter
from localllm.runtime.tokenizer import Tokenizer


class Engine:
    """A model, its tokenizer and a :class:`Generator` of its own, whose KV cache of ``ctx`` positions
    is kept across calls. Engines sharing one model do not see each other's caches."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, ctx: int, compile: bool | str = False,
                 kv_dtype: str = "16bit") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.generator = Generator(model, ctx, compile=compile, kv_dtype=kv_dtype)
        # Stop on the tokenizer's end tokens and the model config's (generation_config.json's).
        self.stop_ids = list(dict.fromkeys([*tokenizer.eos_ids, *model.config.eos_token_ids]))

    @property
    def ctx(self) -> int:
        return self.generator.ctx

    @property
    def stats(self) -> GenerationStats:
        """Figures of the last (or current) generation."""
        return self.generator.stats

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
    ) -> Iterator[str]:
        """Text pieces generated after ``prompt_ids``, as soon as each is printable."""
        decoder = self.tokenizer.stream(skip_special=True)
        cut = StopStringFilter(stop)
        for token in self.generator.generate(prompt_ids, params, max_tokens, self.stop_ids):
            piece = cut.feed(decoder.feed(token))
            if piece:
                yield piece
            if cut.stopped:
                self.stats.stop_reason = "stop_string"
                return
        tail = cut.feed(decoder.flush()) + cut.flush()
        if tail:
            yield tail

    def complete(
        self, prompt: str, params: SamplingParams, max_tokens: int | None = None, stop: Sequence[str] = ()
    ) -> Iterator[str]:
        """Continue raw ``prompt`` text (no chat template)."""
        return self.stream_ids(self.tokenizer.encode(prompt), params, max_tokens, stop)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        think: bool | None = None,
    ) -> Iterator[str]:
        """The assistant's reply to ``messages`` ({"role", "content"} dicts), via the chat template.

        ``think``: the template's ``enable_thinking`` (Qwen3: False writes an empty thinking block into
        the prompt); None leaves the template's default. The reply's own ``<think>`` block is part of
        the text (:class:`runtime.textstream.ThinkingSplitter` separates it).

        Calling again with the same history plus new turns reuses the cached keys/values of the
        shared prefix, so a multi-turn chat only processes what is new.
        """
        extra = {} if think is None else {"enable_thinking": think}
        return self.stream_ids(encode_chat(self.tokenizer, messages, **extra), params, max_tokens, stop)
