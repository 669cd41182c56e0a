"""The public generation API: text in, streamed text out.

    engine = Engine(model, tokenizer, ctx=2048)
    for piece in engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0)):
        print(piece, end="", flush=True)
    engine.stats  # GenerationStats of that call

Token ids come from a :class:`runtime.batch.BatchEngine` of one sequence: the same engine, scheduler,
paged KV pool, prefix cache and compiled decode step that serve many requests at once (``localllm
serve``), for every model family and device: there is one generation path. Text is decoded
incrementally (never half a UTF-8 character) and cut at stop strings without printing any part of one.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from localllm.runtime.batch import BatchEngine, GenerationStats, TokenLogprob
from localllm.runtime.cache import DEFAULT_KV_DTYPE
from localllm.runtime.chat import encode_chat, thinking_variables
from localllm.runtime.constrain import Constraints, Grammar, after_thinking, harmony_final
from localllm.runtime.kv_pool import layer_groups, sequence_pool_bytes
from localllm.runtime.model import Transformer
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.scheduler import check_prompt
from localllm.runtime.textstream import StopStringFilter, prompt_opens_thinking, template_channels, template_thinks
from localllm.runtime.tokenizer import Tokenizer
from localllm.runtime.tools import call_syntax, reply_stop_ids


def sequence_engine(model: Transformer, ctx: int, compile: bool | str = False, kv_dtype: str = DEFAULT_KV_DTYPE,
                    prefix_cache: bool = True, speculate: bool = True) -> BatchEngine:
    """A :class:`BatchEngine` for one sequence of ``ctx`` positions at a time, its pool sized to hold it.

    The whole prompt runs in one chunk (nothing else is waiting to run), unless a sliding window would
    then hold the whole prompt: chunks of the window's size keep its blocks to the window."""
    windows = [g.window for g in layer_groups(model.config) if g.window is not None]
    chunk = min([ctx, *windows])
    budget = sequence_pool_bytes(model.config, model.dtype, ctx, kv_dtype, chunk)
    return BatchEngine(model, kv_budget_bytes=budget, max_seq_len=ctx,
                       chunk_tokens=chunk, max_running=1, max_waiting=1, kv_dtype=kv_dtype, compile=compile,
                       prefix_cache=prefix_cache, speculate=speculate)


class Engine:
    """A model, its tokenizer and a one-sequence :class:`BatchEngine` of its own, whose KV pool holds
    ``ctx`` positions. The pool's blocks are kept across calls (its prefix cache), so a follow-up
    prompt that shares a prefix with an earlier one (a chat's history) only prefills what is new.
    Engines sharing one model do not see each other's pools.

    ``compile``: False runs every step eagerly; "auto" runs decode steps through the compiled step
    when it is built for this model (``localllm compile``; :attr:`needs_build` says when it is not);
    True builds it now if missing (a minute or so on two cores). See :mod:`runtime.compiled_step`.
    ``speculate``: verify tokens proposed from the text's own history where it pays
    (:mod:`runtime.speculate`); the tokens are the same either way.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, ctx: int, compile: bool | str = False,
                 kv_dtype: str = DEFAULT_KV_DTYPE, speculate: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.batch = sequence_engine(model, ctx, compile, kv_dtype, speculate=speculate)
        if compile is True and self.batch.compile_note:
            warnings.warn(self.batch.compile_note)
        # Stop on the tokenizer's end tokens and the model config's (generation_config.json's), and
        # harmony's <|return|> and <|call|> (gpt-oss) whatever the files list.
        ends = reply_stop_ids(call_syntax(tokenizer.chat_template, tokenizer.token_to_id), tokenizer.token_to_id)
        self.stop_ids = list(dict.fromkeys([*tokenizer.eos_ids, *model.config.eos_token_ids, *ends]))
        #: harmony's replies (gpt-oss) are messages whose headers are special tokens: decoded with them
        self.harmony = template_channels(tokenizer.chat_template)
        self.constraints = Constraints(tokenizer, self.stop_ids)
        self.stats = GenerationStats(prompt_tokens=0)
        """Figures of the last (or current) generation."""
        self.logprobs: list[TokenLogprob] = []
        """The last generation's log-probability entries (when it asked for them), one per token."""

    @property
    def step_kind(self) -> str:
        """What runs the decode steps: "aot" (the compiled step), CUDA graphs, or "eager"."""
        if self.batch.graphs is not None:
            from localllm.runtime.cuda_graphs import describe

            return describe(self.batch.graphs)
        return "aot" if self.batch.compiled else "eager"

    @property
    def needs_build(self) -> bool:
        """"auto" found no compiled step for this model, and no build of it failed before."""
        return self.batch.needs_build

    @property
    def build_batch(self) -> int:
        """The batch size a build of this engine's compiled step covers (``localllm compile --batch``):
        with speculation, a verify step's rows too."""
        return self.batch.build_batch

    @property
    def compile_s(self) -> float:
        """Time spent building or loading the compiled step."""
        return self.batch.compile_s

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        stop_ids: Sequence[int] | None = None,
        grammar: Grammar | None = None,
        logprobs: int | None = None,
    ) -> Iterator[int]:
        """Generated token ids one at a time (a stop id, by default the model's end tokens, ends
        generation and is not yielded); :attr:`stats` holds the call's figures. ``grammar``: what the
        reply must match (:mod:`runtime.constrain`). ``logprobs``: record each token's log-probability
        and this many alternatives in :attr:`logprobs`."""
        check_prompt(len(prompt_ids), self.ctx)
        stop = self.stop_ids if stop_ids is None else stop_ids
        constraint = None if grammar is None else self.constraints.start(grammar)
        handle = self.batch.submit(prompt_ids, params, max_tokens, stop, constraint=constraint, logprobs=logprobs)
        self.stats = handle.stats
        self.logprobs = handle.logprobs
        try:
            yield from handle  # each next() runs the engine's steps until the token is there
        finally:
            if not handle.done:  # the caller stopped reading (a stop string): free the sequence's blocks
                handle.cancel()
                self.batch.step()

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        grammar: Grammar | None = None,
        logprobs: int | None = None,
    ) -> Iterator[str]:
        """Text pieces generated after ``prompt_ids``, as soon as each is printable (with a harmony
        template's special tokens: its messages' headers, for :class:`ThinkingSplitter` to read)."""
        decoder = self.tokenizer.stream(skip_special=not self.harmony)
        cut = StopStringFilter(stop)
        tokens = self.generate_ids(prompt_ids, params, max_tokens, grammar=grammar, logprobs=logprobs)
        try:
            for token in tokens:
                piece = cut.feed(decoder.feed(token))
                if piece:
                    yield piece
                if cut.stopped:
                    self.stats.stop_string = True
                    return
        finally:
            tokens.close()  # a reply cut short (stop string, caller gone) frees its sequence's blocks now
        tail = cut.feed(decoder.flush()) + cut.flush()
        if tail:
            yield tail

    def complete(
        self, prompt: str, params: SamplingParams, max_tokens: int | None = None, stop: Sequence[str] = (),
        grammar: Grammar | None = None, logprobs: int | None = None,
    ) -> Iterator[str]:
        """Continue raw ``prompt`` text (no chat template)."""
        return self.stream_ids(self.tokenizer.encode(prompt), params, max_tokens, stop, grammar, logprobs)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        think: bool | None = None,
        grammar: Grammar | None = None,
        logprobs: int | None = None,
    ) -> Iterator[str]:
        """The assistant's reply to ``messages`` ({"role", "content"} dicts), via the chat template.

        ``think``: the template's ``enable_thinking`` (Qwen3: False writes an empty thinking block into
        the prompt); None leaves the template's default. The reply's own ``<think>`` block is part of
        the text (:class:`runtime.textstream.ThinkingSplitter` separates it); a ``grammar`` holds the
        answer after it (:func:`runtime.constrain.after_thinking`). A harmony template's reply (gpt-oss)
        is its messages with their headers (``ThinkingSplitter(harmony=True)`` reads them); a
        ``grammar`` holds its final message, after an optional analysis one.

        Calling again with the same history plus new turns reuses the cached keys/values of the
        shared prefix, so a multi-turn chat only processes what is new.
        """
        ids = encode_chat(self.tokenizer, messages, **thinking_variables(self.harmony, think))
        if grammar is not None and self.harmony:  # the final message, after an optional analysis one
            grammar = after_thinking(harmony_final(grammar), False, harmony=True)
        elif grammar is not None and think is not False and template_thinks(self.tokenizer.chat_template):
            grammar = after_thinking(grammar, prompt_opens_thinking(self.tokenizer, ids))  # holds the answer
        return self.stream_ids(ids, params, max_tokens, stop, grammar, logprobs)
