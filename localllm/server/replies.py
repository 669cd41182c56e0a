"""A reply as the APIs show it: its thinking block apart (Qwen3's and DeepSeek-R1's ``<think>``,
gpt-oss's analysis channel), its answer, and its tool calls, told apart as the text streams and from
the whole text alike."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from localllm.errors import LocalLLMError
from localllm.runtime.batch import TokenLogprob
from localllm.runtime.chat import thinking_variables
from localllm.runtime.constrain import FREE_TEXT, Grammar, after_thinking, harmony_final
from localllm.runtime.textstream import ThinkingSplitter, prompt_opens_thinking, template_thinks
from localllm.runtime.tools import (HARMONY, ReplySplitter, ToolCall, call_grammar, call_syntax,
                                    encode_tool_chat)
from localllm.server.errors import ApiError
from localllm.server.generation import Generation
from localllm.server.tool_calls import ToolAsk


@dataclass
class ReplyShape:
    """How to read one reply: ``thinks`` (split a thinking block off), ``opened`` (the prompt opened
    it), ``calls`` (the tool call splitter; None: no tools offered)."""

    thinks: bool = False
    opened: bool = False
    calls: ReplySplitter | None = None
    found: list[ToolCall] = field(default_factory=list)  # the calls, once :func:`stream_parts` has ended
    harmony: bool = False  # the reply is harmony's channels (gpt-oss): split whether or not it thinks

    def __post_init__(self) -> None:
        self._thinking = ThinkingSplitter(self.opened, self.harmony) if self.thinks or self.harmony else None

    def feed(self, text: str) -> list[tuple[str, str]]:
        """("thinking" or "answer", text) pairs to show now."""
        parts = self._thinking.feed(text) if self._thinking is not None else [("answer", text)]
        return self._route(parts)

    def finish(self, cut: bool = False) -> tuple[list[tuple[str, str]], list[ToolCall]]:
        """What was held back, and the reply's complete calls; ``cut``: the reply was cut short (see
        :meth:`ReplySplitter.finish`)."""
        out = self._route(self._thinking.flush()) if self._thinking is not None else []
        calls: list[ToolCall] = []
        if self.calls is not None:
            rest, calls = self.calls.finish(cut)
            if rest:
                out.append(("answer", rest))
        return out, calls

    def _route(self, parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
        out = []
        for kind, text in parts:
            if kind == "answer" and self.calls is not None:
                text = self.calls.feed(text)
            if text:
                out.append((kind, text))
        return out

    def whole(self, text: str, cut: bool = False) -> tuple[str, str, list[ToolCall]]:
        """A whole reply as (thinking, answer, complete calls); ``cut``: it was cut short
        (:func:`was_cut` of its finish reason)."""
        parts = self.feed(text)
        rest, calls = self.finish(cut)
        parts += rest
        return ("".join(t for k, t in parts if k == "thinking"), "".join(t for k, t in parts if k == "answer"), calls)


def was_cut(finish_reason: str) -> bool:
    """Whether a reply that ended with the engine's ``finish_reason`` was cut short of its end (by
    ``max_tokens``, or a grammar's limit), so that a tail which could have begun a call is no text."""
    return finish_reason in ("length", "constraint")


def end_reason(finish_reason: str, calls: list[ToolCall]) -> str:
    """How a reply ended, as the APIs tell it: "length" or "constraint" when it was cut short (with
    the calls it completed before the cut), "tool_calls" when it ended after its calls, else "stop"
    (an end token or a stop string)."""
    if was_cut(finish_reason):
        return finish_reason
    return "tool_calls" if calls else "stop"


def prepare_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: ToolAsk | None, grammar: Grammar | None,
                 think: bool | None, budget: int | None = None,
                 effort: str | None = None) -> tuple[list[int], Grammar | None, ReplyShape]:
    """A chat's prompt ids (the tools offered through the model's template, or the generic form;
    ``think`` as the template's ``enable_thinking``, None: its default; for harmony's template ``think``
    and ``effort`` as its ``reasoning_effort``), the grammar the reply is held to (the format's or the
    tools'; after a thinking block where the model thinks), and how to read the reply; ``budget``: the
    most thinking tokens, where the model thinks. Runs on a worker thread (templates, schemas)."""
    syntax = call_syntax(tokenizer.chat_template, tokenizer.token_to_id)
    harmony = syntax.kind == HARMONY
    extra = thinking_variables(harmony, think, effort)
    ids = encode_tool_chat(tokenizer, messages, tools.tools if tools is not None else [], syntax, **extra)
    if tools is not None:
        try:
            grammar = call_grammar(syntax, tools.tools, tools.choice, tools.parallel)
        except LocalLLMError as e:
            raise ApiError(400, e.one_line(), param="tools") from None
    elif harmony and (grammar is not None or budget is not None):  # the format holds the final message
        grammar = harmony_final(grammar or FREE_TEXT)
    thinks = harmony or (think is not False and template_thinks(tokenizer.chat_template))
    opened = thinks and not harmony and prompt_opens_thinking(tokenizer, ids)
    if budget is not None and thinks:
        grammar = after_thinking(grammar or FREE_TEXT, opened, budget, harmony)
    elif grammar is not None and thinks:  # the format holds the answer, not the thinking before it
        grammar = after_thinking(grammar, opened, harmony=harmony)
    calls = None if tools is None else ReplySplitter(syntax, tools.forced)
    return ids, grammar, ReplyShape(thinks, opened, calls, harmony=harmony)


async def stream_parts(gen: Generation, shape: ReplyShape | None) -> AsyncIterator[tuple[str, str, list[TokenLogprob]]]:
    """A streamed reply as ("thinking" or "answer", text, the log-probability entries of an answer
    part's tokens since the last answer part: a thinking part's are not the answer's); the calls are
    in ``shape.found`` once it ends."""
    entries: list[TokenLogprob] = []
    async with contextlib.aclosing(gen.parts()) as parts:
        async for part in parts:
            entries += part.logprobs
            for kind, text in shape.feed(part.text) if shape is not None else [("answer", part.text)]:
                yield kind, text, (entries if kind == "answer" else [])
                entries = []
    if shape is not None:
        rest, shape.found = shape.finish(gen.outcome is not None and was_cut(gen.outcome.finish_reason))
        for kind, text in rest:
            yield kind, text, (entries if kind == "answer" else [])
            entries = []
