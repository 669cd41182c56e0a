"""The public generation API: text in, streamed text out.

    engine = Engine(model, tokenizer, ctx=2048)
    for piece in engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0)):
        print(piece, end="", flush=True)
    engine.stats  # GenerationStats of that call

Token ids come from a :class:`runtime.batch.BatchEngine` of one sequence: the same engine, scheduler,
paged KV pool and compiled decode step that serve many requests at once (``localllm serve``), so
there is one generation path. Two exceptions run on the one-sequence path
(:class:`runtime.generate.Generator`) instead: a model with sliding-window layers (Gemma 3), whose
one-sequence ring caches have a compiled decode step where the batch engine's runs such models
eagerly (both hold only the window of those layers); and
``compile=True`` on CUDA, whose compiled step is that path's ``torch.compile`` (the batch engine's
compiled step is AOTInductor on the CPU). Text is decoded incrementally (never half a UTF-8
character) and cut at stop strings without printing any part of one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from localllm.runtime.batch import BatchEngine
from localllm.runtime.chat import encode_chat
from localllm.runtime.generate import GenerationStats, Generator, check_prompt
from localllm.runtime.kv_pool import DEFAULT_BLOCK_SIZE, block_bytes
from localllm.runtime.model import Transformer
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.textstream import StopStringFilter
from localllm.runtime.tokenizer import Tokenizer


class Engine:
    """A model, its tokenizer and a one-sequence :class:`BatchEngine` of its own, whose KV pool holds
    ``ctx`` positions. The pool's blocks are kept across calls (its prefix cache), so a follow-up
    prompt that shares a prefix with an earlier one (a chat's history) only prefills what is new.
    Engines sharing one model do not see each other's pools.

    ``compile``: False runs every step eagerly; "auto" runs decode steps through the compiled step
    when it is built for this model (``localllm compile``; :attr:`needs_build` says when it is not);
    True builds it now if missing (a minute or so on two cores). See :mod:`runtime.paged_aot`.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, ctx: int, compile: bool | str = False,
                 kv_dtype: str = "16bit") -> None:
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', not {compile!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.batch: BatchEngine | None = None
        self.generator: Generator | None = None
        if any(layer.attn.window is not None for layer in model.layers) or (
                compile is True and model.device.type == "cuda"):
            self.generator = Generator(model, ctx, compile=compile, kv_dtype=kv_dtype)
        else:
            blocks = math.ceil(ctx / DEFAULT_BLOCK_SIZE)
            budget = blocks * block_bytes(model.config, DEFAULT_BLOCK_SIZE, model.dtype, kv_dtype)
            # The whole prompt in one chunk: nothing else is waiting to run.
            self.batch = BatchEngine(model, kv_budget_bytes=budget, max_seq_len=ctx, chunk_tokens=ctx,
                                     max_running=1, max_waiting=1, kv_dtype=kv_dtype, compile=compile)
            if compile is True and self.batch.compile_note:
                warnings.warn(self.batch.compile_note)
        # Stop on the tokenizer's end tokens and the model config's (generation_config.json's).
        self.stop_ids = list(dict.fromkeys([*tokenizer.eos_ids, *model.config.eos_token_ids]))
        self._stats = GenerationStats()

    @property
    def stats(self) -> GenerationStats:
        """Figures of the last (or current) generation."""
        return self.generator.stats if self.generator is not None else self._stats

    @property
    def step_kind(self) -> str:
        """What runs the decode steps: "aot" (a compiled step), "torch.compile" or "eager"."""
        if self.generator is not None:
            return self.generator.step_kind
        assert self.batch is not None
        return "aot" if self.batch.compiled else "eager"

    @property
    def needs_build(self) -> bool:
        """"auto" found no compiled step for this model, and no build of it failed before."""
        return self.generator.needs_build if self.generator is not None else bool(self.batch and self.batch.needs_build)

    @property
    def compile_s(self) -> float:
        """Time spent building or loading the compiled step."""
        return self.generator.compile_s if self.generator is not None else self.batch.compile_s  # type: ignore[union-attr]

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        stop_ids: Sequence[int] | None = None,
    ) -> Iterator[int]:
        """Generated token ids one at a time (a stop id, by default the model's end tokens, ends
        generation and is not yielded); :attr:`stats` holds the call's figures."""
        check_prompt(prompt_ids, self.ctx)
        stop = self.stop_ids if stop_ids is None else stop_ids
        if self.generator is not None:
            yield from self.generator.generate(prompt_ids, params, max_tokens, stop)
            return
        assert self.batch is not None
        stats = self._stats = GenerationStats()
        handle = self.batch.submit(prompt_ids, params, max_tokens, stop)
        r = handle.stats
        last = None
        try:
            for tok in handle:  # each next() runs the engine's steps until the token is there
                if last is None:
                    stats.cached_tokens = r.cached_tokens
                    stats.prompt_tokens = len(prompt_ids) - r.cached_tokens
                    stats.prompt_s = (r.first_token_at or r.submitted_at) - r.submitted_at
                else:
                    stats.token_latencies_s.append(r.token_times[stats.generated_tokens] - last)
                    stats.decode_s = r.token_times[stats.generated_tokens] - r.token_times[0]
                last = r.token_times[stats.generated_tokens]
                stats.generated_tokens += 1
                yield tok
        finally:
            if not handle.done:  # the caller stopped reading (a stop string): free the sequence's blocks
                handle.cancel()
                self.batch.step()
        if r.finish_reason == "stop":
            stats.stop_reason = "eos"
            if last is None:  # an end token first: the prefill is all there was
                stats.cached_tokens = r.cached_tokens
                stats.prompt_tokens = len(prompt_ids) - r.cached_tokens
                stats.prompt_s = (r.finished_at or r.submitted_at) - r.submitted_at
        elif r.finish_reason == "length":
            limited = max_tokens is not None and stats.generated_tokens >= max_tokens
            stats.stop_reason = "max_tokens" if limited else "context"

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
        tokens = self.generate_ids(prompt_ids, params, max_tokens)
        try:
            for token in tokens:
                piece = cut.feed(decoder.feed(token))
                if piece:
                    yield piece
                if cut.stopped:
                    self.stats.stop_reason = "stop_string"
                    return
        finally:
            tokens.close()  # a reply cut short (stop string, caller gone) frees its sequence's blocks now
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
