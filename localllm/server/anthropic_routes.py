"""Anthropic's Messages API: ``POST /v1/messages`` (one JSON message, or SSE events in Anthropic's
order when ``stream``) and ``POST /v1/messages/count_tokens``.

A translation onto the chat pipeline the OpenAI routes use: the request becomes chat messages and a
:class:`ToolAsk` (:func:`replies.prepare_chat` builds the prompt with the model's template and the
call grammar), and the reply is read by the same :class:`ReplyShape` (thinking, answer, calls) into
Anthropic's content blocks. Errors come in Anthropic's shape (:func:`errors.anthropic_body`, picked by
path)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localllm.runtime.constrain import Grammar
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.tools import Tool, ToolCall
from localllm.server.common import check_prompt, endpoint, start_reply, state, whole_reply
from localllm.server.errors import ANTHROPIC, ApiError, anthropic_body, from_exception
from localllm.server.generation import Outcome
from localllm.server.models import Lease
from localllm.server.replies import ReplyShape, prepare_chat, stream_parts, was_cut
from localllm.server.streaming import dumps, sse_response
from localllm.server.tool_calls import ToolAsk
from localllm.server.validate import Fields, read_json
from localllm.server.validate import tools as parse_tools


@dataclass
class MessagesAsk:
    """A Messages request as the chat pipeline takes it."""

    model: str
    messages: list[dict[str, Any]]
    tools: ToolAsk | None
    params: SamplingParams
    max_tokens: int | None
    stop: list[str]
    stream: bool
    think: bool | None  # the template's enable_thinking (None: its default)
    budget: int | None  # thinking tokens allowed before the answer must start (None: no bound)


def _kind(value: Any) -> str:
    return type(value).__name__ if value is not None else "null"


def _text_blocks(value: Any, where: str) -> str:
    """A string, or text blocks (``[{"type": "text", "text": ...}]``) joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(400, f"'{where}' must be a string or an array of text blocks", param=where)
    texts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"'{where}[{i}]' must be a text block ({{\"type\": \"text\", \"text\": ...}}); "
                           "this server runs text models", param=f"{where}[{i}]")
        texts.append(block["text"])
    return "".join(texts)


def _user(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks: its ``tool_result`` blocks as tool messages (the chat templates' form),
    then its text as a user message."""
    out: list[dict[str, Any]] = []
    texts = []
    for i, block in enumerate(content):
        at = f"{where}[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise ApiError(400, f"'{at}.tool_use_id' is required", param=f"{at}.tool_use_id")
            result = _text_blocks(block.get("content") or "", f"{at}.content")
            if block.get("is_error") is True:
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise ApiError(400, f"'{at}' is a {kind!r} block; a user turn takes 'text' and 'tool_result' blocks "
                           "here (this server runs text models)", param=f"{at}.type")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    """An assistant turn's blocks: text, earlier ``tool_use`` calls, and thinking (passed to the
    template as ``reasoning_content``; redacted thinking has no text to pass)."""
    texts, thinking, calls = [], [], []
    for i, block in enumerate(content):
        at = f"{where}[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                raise ApiError(400, f"'{at}' needs 'id' and 'name'", param=at)
            if not isinstance(block.get("input", {}), dict):
                raise ApiError(400, f"'{at}.input' must be an object", param=f"{at}.input")
            calls.append({"type": "function", "id": block["id"],
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind != "redacted_thinking":
            raise ApiError(400, f"'{at}' is a {kind!r} block; an assistant turn takes 'text', 'tool_use', "
                           "'thinking' and 'redacted_thinking' blocks", param=f"{at}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def chat_messages(system: Any, value: Any) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages (``{"role", "content"}``, with ``tool_calls`` and
    tool results as the OpenAI routes pass them to the template)."""
    out: list[dict[str, Any]] = []
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(value, list):
        raise ApiError(400, f"'messages' must be an array of messages, not {_kind(value)}", param="messages")
    if not value:
        raise ApiError(400, "'messages' is empty; give at least one message", param="messages")
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"'{where}' must be an object with 'role' and 'content'", param=where)
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise ApiError(400, f"'{where}.role' must be 'user' or 'assistant' (the system prompt is 'system')",
                           param=f"{where}.role")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise ApiError(400, f"'{where}.content' must be a string or an array of blocks", param=f"{where}.content")
        if role == "user":
            out += _user(content, f"{where}.content")
        else:
            out.append(_assistant(content, f"{where}.content"))
    return out


def anthropic_tools(value: Any, choice: Any) -> ToolAsk | None:
    """``tools`` (``{"name", "description", "input_schema"}``) and ``tool_choice`` (``auto``, ``any``,
    ``tool`` with ``name``, ``none``; ``disable_parallel_tool_use``) as the chat routes' ToolAsk."""
    if value is None:
        value = []
    if not isinstance(value, list):
        raise ApiError(400, "'tools' must be an array of tools", param="tools")
    specs = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise ApiError(400, f"'tools[{i}]' must be a client tool ({{\"name\", \"description\", \"input_schema\"}}); "
                           "this server runs no server tools", param=f"tools[{i}]")
        if not isinstance(t.get("input_schema"), dict):
            raise ApiError(400, f"'tools[{i}].input_schema' must be a JSON Schema object", param=f"tools[{i}].input_schema")
        specs.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                       "parameters": t["input_schema"]}})
    try:
        offered: list[Tool] = parse_tools(specs)
    except ApiError as e:  # the chat form's field names, as Anthropic's
        param = (e.param or "tools").replace(".function.parameters", ".input_schema").replace(".function.", ".")
        raise ApiError(400, e.message.replace(e.param or "", param), param=param) from None
    if choice is None:
        choice = {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ApiError(400, "'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'", param="tool_choice.type")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise ApiError(400, "'tool_choice.disable_parallel_tool_use' must be true or false",
                       param="tool_choice.disable_parallel_tool_use")
    kind = choice["type"]
    if kind == "none" or (kind == "auto" and not offered):
        return None
    if not offered:
        raise ApiError(400, f"'tool_choice.type' is {kind!r} but no 'tools' are given", param="tool_choice")
    name = {"auto": "auto", "any": "required"}.get(kind, choice.get("name"))
    if kind == "tool" and not any(t.name == name for t in offered):
        raise ApiError(400, f"'tool_choice.name' is {name!r}, which is not among the tools", param="tool_choice.name")
    return ToolAsk(offered, name, not parallel)  # type: ignore[arg-type]


def _think(f: Fields, max_tokens: int | None) -> tuple[bool | None, int | None]:
    """``thinking``: ``{"type": "enabled", "budget_tokens": N}`` (N below ``max_tokens``, as Anthropic
    requires) or ``{"type": "disabled"}``; not given: the template's default, unbounded."""
    thinking = f.obj("thinking")
    if thinking is None:
        return None, None
    kind = thinking.string("type", required=True)
    if kind == "disabled":
        return False, None
    if kind != "enabled":
        raise ApiError(400, f"'thinking.type' is {kind!r}; use 'enabled' or 'disabled'", param="thinking.type")
    budget = thinking.integer("budget_tokens", minimum=1)
    if budget is None:
        raise ApiError(400, "'thinking.budget_tokens' is required with thinking enabled", param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise ApiError(400, f"'thinking.budget_tokens' is {budget}; it must be less than 'max_tokens' ({max_tokens})",
                       param="thinking.budget_tokens")
    return True, budget


def _ask(f: Fields, counting: bool = False) -> MessagesAsk:
    model = f.string("model", required=True)
    max_tokens = f.integer("max_tokens", minimum=1)
    if max_tokens is None and not counting:
        raise ApiError(400, "'max_tokens' is required", param="max_tokens")
    temperature = f.number("temperature", 0, 1)
    top_p = f.number("top_p", 0, 1)
    top_k = f.integer("top_k", 0)
    f.obj("metadata")  # user_id: accepted; this server keeps no per-user records
    if top_p == 0:
        top_p = 1e-9  # "only the most likely token", as the chat routes read it
    params = SamplingParams(temperature=1.0 if temperature is None else temperature, top_k=top_k or 0,
                            top_p=1.0 if top_p is None else top_p)
    think, budget = _think(f, max_tokens)
    stop = f.stop("stop_sequences")
    return MessagesAsk(model, chat_messages(f.raw("system"), f.raw("messages")),  # type: ignore[arg-type]
                       anthropic_tools(f.raw("tools"), f.raw("tool_choice")), params, max_tokens, stop,
                       f.boolean("stream", False), think, budget)


def _prepare(tokenizer: Any, ask: MessagesAsk) -> tuple[list[int], Grammar | None, ReplyShape]:
    """The prompt, the grammar (the tools', and the thinking budget where the model thinks) and the
    reply's shape: :func:`prepare_chat`."""
    return prepare_chat(tokenizer, ask.messages, ask.tools, None, ask.think, ask.budget)


def _tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _usage(o: Outcome) -> dict[str, int]:
    """Anthropic counts prompt tokens the cache served apart from the rest (``input_tokens``); this
    server's prefix cache fills itself, so no tokens are counted as written to it."""
    return {"input_tokens": o.prompt_tokens - o.cached_tokens, "output_tokens": o.completion_tokens,
            "cache_read_input_tokens": o.cached_tokens, "cache_creation_input_tokens": 0}


def _stop_reason(o: Outcome, calls: list[ToolCall]) -> str:
    if o.finish_reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if o.stop is not None else "end_turn"


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {dumps(data)}\n\n"


@endpoint(ANTHROPIC, "/v1/messages")
async def messages(request: Request) -> Response:
    ask = _ask(Fields(await read_json(request, state(request).config.max_body_bytes)))
    shape: ReplyShape | None = None
    prompt_len = 0

    async def prepare(lease: Lease) -> None:
        nonlocal shape, prompt_len
        ids, grammar, shape = await anyio.to_thread.run_sync(_prepare, lease.slot.lm.tokenizer, ask)
        check_prompt(ids, lease.slot, param="messages")
        prompt_len = len(ids)
        lease.submit(ids, ask.params, ask.max_tokens, ask.stop, await lease.constraint(grammar))

    lease = await start_reply(request, prepare, ask.model)
    assert shape is not None and lease.gen is not None  # prepare ran
    mid = "msg_" + secrets.token_hex(12)
    message = {"id": mid, "type": "message", "role": "assistant", "model": ask.model}
    if ask.stream:
        return sse_response(_events(lease, shape, message, prompt_len), on_close=lease.close)
    text, o = await whole_reply(request, lease)
    thinking, answer, calls = shape.whole(text, was_cut(o.finish_reason))  # a cut call is no text
    content: list[dict[str, Any]] = []
    if thinking:
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if answer:
        content.append({"type": "text", "text": answer})
    content += [{"type": "tool_use", "id": _tool_id(c), "name": c.name, "input": c.arguments} for c in calls]
    return JSONResponse({**message, "content": content, "stop_reason": _stop_reason(o, calls),
                         "stop_sequence": o.stop, "usage": _usage(o)})


async def _events(lease: Lease, shape: ReplyShape, message: dict[str, Any], prompt_len: int) -> AsyncGenerator[str, None]:
    """The reply as Anthropic's events: ``message_start``, each content block (thinking, text, then
    each call) as ``content_block_start``, its deltas and ``content_block_stop`` (a ``ping`` after the
    first start), ``message_delta`` with the stop reason and usage, ``message_stop``; a failure ends
    it with an ``error`` event."""
    gen = lease.gen
    assert gen is not None
    start_usage = {"input_tokens": prompt_len, "output_tokens": 0, "cache_read_input_tokens": 0,
                   "cache_creation_input_tokens": 0}
    yield _event("message_start", {"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
    index = -1
    open_kind: str | None = None

    def start(block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = stop()
        index += 1
        open_kind = block["type"]
        out.append(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                  "content_block": block}))
        if index == 0:
            out.append(_event("ping", {"type": "ping"}))
        return out

    def stop() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        out = []
        if open_kind == "thinking":
            out.append(delta({"type": "signature_delta", "signature": ""}))
        open_kind = None
        return out + [_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def delta(body: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": body})

    async for kind, text, _ in stream_parts(gen, shape):
        if kind == "thinking":
            if open_kind != "thinking":
                for e in start({"type": "thinking", "thinking": "", "signature": ""}):
                    yield e
            yield delta({"type": "thinking_delta", "thinking": text})
        else:
            if open_kind != "text":
                for e in start({"type": "text", "text": ""}):
                    yield e
            yield delta({"type": "text_delta", "text": text})
    o = gen.outcome
    assert o is not None
    if o.finish_reason == "error":
        for e in stop():
            yield e
        yield _event("error", anthropic_body(from_exception(o.error or RuntimeError("generation failed"))))
        return
    for call in shape.found:
        for e in start({"type": "tool_use", "id": _tool_id(call), "name": call.name, "input": {}}):
            yield e
        yield delta({"type": "input_json_delta", "partial_json": json.dumps(call.arguments)})
    for e in stop():
        yield e
    yield _event("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": _stop_reason(o, shape.found), "stop_sequence": o.stop},
                                   "usage": _usage(o)})
    yield _event("message_stop", {"type": "message_stop"})


@endpoint(ANTHROPIC, "/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens for a Messages body (``max_tokens`` not needed): as the model's template
    renders it, tools included."""
    ask = _ask(Fields(await read_json(request, state(request).config.max_body_bytes)), counting=True)
    counted: list[int] = []

    async def prepare(lease: Lease) -> None:
        ids, _, _ = await anyio.to_thread.run_sync(_prepare, lease.slot.lm.tokenizer, ask)
        counted.append(len(ids))

    lease = await start_reply(request, prepare, ask.model)
    lease.close()
    return JSONResponse({"input_tokens": counted[0]})


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
