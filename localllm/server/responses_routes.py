"""OpenAI's Responses API: ``POST /v1/responses`` (one JSON response, or its typed SSE events when
``stream``), ``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A translation onto the chat pipeline that ``/v1/chat/completions`` runs: ``input`` items become chat
messages for the model's template, function ``tools``, ``tool_choice`` and ``text.format`` become the
same ToolAsk and grammars (:mod:`tool_calls`, :mod:`structured`), ``reasoning.effort`` the template's
thinking switch (harmony's level), and the reply is read by the same :class:`ReplyShape` into
reasoning, message and ``function_call`` output items. Stored responses (``store``, default true as
OpenAI's) live in a bounded in-memory :class:`ResponseStore`; ``previous_response_id`` continues one's
conversation.

Fields that would change a reply's meaning and that this server cannot honour (built-in tools,
``background``, ``conversation``, reusable ``prompt``, ``truncation: "auto"``, log-probabilities) are
refused with a 400 naming the field, never ignored.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localllm.runtime.constrain import Grammar
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.tools import ToolCall
from localllm.server import tool_calls
from localllm.server.common import check_prompt, endpoint, now_s, start_reply, state, whole_reply
from localllm.server.errors import OPENAI, ApiError, from_exception
from localllm.server.generation import Outcome
from localllm.server.models import Lease
from localllm.server.replies import ReplyShape, prepare_chat, stream_parts, was_cut
from localllm.server.responses_store import ResponseStore
from localllm.server.streaming import dumps, sse_response
from localllm.server.structured import openai_response_format
from localllm.server.tool_calls import ToolAsk
from localllm.server.validate import Fields, messages, read_json

#: Fields that ask for something this server does not do, with the values that ask for nothing.
_REFUSED: dict[str, tuple[Any, ...]] = {
    "background": (False,), "conversation": (), "prompt": (), "truncation": ("disabled",),
    "top_logprobs": (0,), "max_tool_calls": (), "context_management": (),
}
#: ``include`` values accepted: they ask for nothing this server leaves out (no encrypted reasoning
#: exists here; a reasoning item carries its text).
_INCLUDABLE = ("reasoning.encrypted_content",)
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _store(request: Request) -> ResponseStore:
    """The app's store of responses, made on first use."""
    app_state = request.app.state
    store = getattr(app_state, "responses", None)
    if store is None:
        store = app_state.responses = ResponseStore()
    return store  # type: ignore[no-any-return]


def _renamed(e: ApiError, old: str, new: str) -> ApiError:
    """A shared validator's error, its field named as this API names it."""
    param = e.param.replace(old, new) if e.param else e.param
    return ApiError(e.status, e.message.replace(old, new), param=param, code=e.code)


# ---------------------------------------------------------------------------------------- the request
def _text_of(content: Any, where: str) -> str:
    """A content field: a string, or text parts (``input_text``, ``output_text``) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}' must be a string or an array of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"'{where}[{j}]' must be a text part ({{\"type\": \"input_text\", \"text\": ...}}), "
                           f"not {kind!r}: this server runs text models", param=f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(value: Any, earlier: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``input`` (a string, or items: messages, ``function_call``, ``function_call_output``,
    ``reasoning``) as chat messages in OpenAI's chat shape, checked by the chat routes' own
    :func:`validate.messages`. A reasoning item is accepted and left out, as chat templates drop
    earlier turns' thinking. ``earlier``: the conversation it continues, whose calls its
    ``function_call_output`` items may answer."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(400, "'input' must be a string or an array of input items", param="input")
    out: list[dict[str, Any]] = []
    names = {c["id"]: c["function"]["name"] for m in earlier or [] for c in m.get("tool_calls", []) if "id" in c}
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"'{where}' must be an object (an input item)", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ApiError(400, f"'{where}.role' must be user, assistant, system or developer, not {role!r}",
                               param=f"{where}.role")
            out.append({"role": _ROLES[role], "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            for key, v in (("call_id", call_id), ("name", name), ("arguments", args)):
                if not isinstance(v, str):
                    raise ApiError(400, f"'{where}.{key}' is required (a string)", param=f"{where}.{key}")
            try:
                parsed = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict):
                raise ApiError(400, f"'{where}.arguments' must be a JSON object's text", param=f"{where}.arguments")
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and ("tool_calls" in last or not last["content"]):
                last.setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ApiError(400, f"'{where}.call_id' is required (a string)", param=f"{where}.call_id")
            message = {"role": "tool", "tool_call_id": call_id, "content": _text_of(item.get("output"), f"{where}.output")}
            if call_id in names:
                message["name"] = names[call_id]
            out.append(message)
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(400, f"'{where}.type' is {kind!r}; this server takes message, function_call, "
                           "function_call_output and reasoning items", param=f"{where}.type")
    return messages(out, param="input")


#: An input item's type -> the prefix of the id a listed item gets when its request gave none.
_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_items(value: Any) -> list[dict[str, Any]]:
    """``input`` (already checked by :func:`input_messages`) as ``input_items`` lists it: items with
    ids and statuses, a string or a message's string content as one ``input_text`` part (an
    assistant's as ``output_text``)."""
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    out = []
    for item in items:
        kind = item.get("type", "message")
        listed = {"id": None, "type": kind, **item}
        listed["id"] = listed["id"] or _new_id(_ITEM_IDS[kind])
        if kind == "message" and isinstance(item["content"], str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            listed["content"] = [{"type": part, "text": item["content"]}]
        if kind != "reasoning":
            listed.setdefault("status", "completed")
        out.append(listed)
    return out


def _tools(f: Fields) -> tuple[ToolAsk | None, list[dict[str, Any]]]:
    """Function ``tools`` in the Responses shape (flat: ``{"type": "function", "name", "description",
    "parameters", "strict"}``) and ``tool_choice``, checked by the chat routes' :func:`openai_tools`;
    with the tools as the response echoes them. Any other tool type (built-in tools) is a 400."""
    value = f.raw("tools")
    if value is not None and not isinstance(value, list):
        raise ApiError(400, "'tools' must be an array of tools", param="tools")
    nested = []
    for i, t in enumerate(value or []):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise ApiError(400, f"'tools[{i}].type' is {kind!r}: this server runs function tools only",
                           param=f"tools[{i}].type")
        nested.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                        if t.get(k) is not None}})
    choice = f.raw("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"name\": ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    try:
        offered = tool_calls.openai_tools(nested, choice, f.raw("parallel_tool_calls"))
    except ApiError as e:
        raise _renamed(e, ".function.", ".") from None
    echoed = [{"type": "function", "name": t["name"], "description": t.get("description"),
               "parameters": t.get("parameters"), "strict": t.get("strict", True)} for t in value or []]
    return offered, echoed


def _text_format(f: Fields) -> tuple[Grammar | None, dict[str, Any]]:
    """``text.format`` (``text``, ``json_object``, or ``json_schema`` with ``name``, ``schema``,
    ``strict``) as the chat routes' ``response_format`` grammar; with the format as echoed."""
    text = f.obj("text")
    fmt = text.raw("format") if text is not None else None
    if fmt is None:
        return None, {"type": "text"}
    if not isinstance(fmt, dict):
        raise ApiError(400, "'text.format' must be an object such as {\"type\": \"json_object\"}", param="text.format")
    as_chat: dict[str, Any] = {"type": fmt.get("type")}
    if fmt.get("type") == "json_schema":
        as_chat["json_schema"] = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    try:
        grammar = openai_response_format(as_chat)
    except ApiError as e:
        raise _renamed(_renamed(e, "response_format.json_schema", "text.format"), "response_format", "text.format") \
            from None
    return grammar, fmt


@dataclass
class Ask:
    """A Responses request, translated."""

    model: str
    conversation: list[dict[str, Any]]  # the chat messages without the instructions
    instructions: str | None
    params: SamplingParams
    max_tokens: int | None
    stream: bool
    store: bool
    grammar: Grammar | None
    tools: ToolAsk | None
    think: bool | None
    effort: str | None  # reasoning.effort as asked: harmony's template takes its level
    items: list[dict[str, Any]]  # this request's input items, as input_items lists them
    echo: dict[str, Any] = field(default_factory=dict)  # request fields a response object repeats

    @property
    def chat(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return system + self.conversation


def _ask(request: Request, f: Fields) -> Ask:
    for key, allowed in _REFUSED.items():
        value = f.raw(key)
        if value is not None and value not in allowed:
            raise ApiError(400, f"'{key}' is not supported by this server", param=key)
    include = f.array("include") or []
    for i, value in enumerate(include):
        if value not in _INCLUDABLE:
            raise ApiError(400, f"'include[{i}]' is {value!r}; this server can include only {', '.join(_INCLUDABLE)}",
                           param=f"include[{i}]")
    model = f.string("model", required=True)
    instructions = f.string("instructions")
    if f.raw("input") is None:
        raise ApiError(400, "'input' is required", param="input")
    previous = f.string("previous_response_id")
    earlier: list[dict[str, Any]] = []
    if previous is not None:
        stored = _store(request).get(previous)
        if stored is None:
            raise ApiError(404, f"no stored response {previous!r} (never stored, deleted, or evicted)",
                           param="previous_response_id", code="previous_response_not_found")
        earlier = stored.conversation
    conversation = earlier + input_messages(f.raw("input"), earlier)
    if not conversation:
        raise ApiError(400, "'input' is empty; give at least one item", param="input")
    temperature = f.number("temperature", 0, 2)
    top_p = f.number("top_p", 0, 1)
    if top_p == 0:
        top_p = None if temperature == 0 else 1e-9  # "only the most likely token": greedy in effect
    params = SamplingParams(temperature=1.0 if temperature is None else temperature, top_k=0,
                            top_p=1.0 if top_p is None else top_p, seed=f.integer("seed"))
    reasoning = f.obj("reasoning")
    effort = reasoning.string("effort") if reasoning is not None else None
    if effort is not None and effort not in _EFFORTS:
        raise ApiError(400, f"'reasoning.effort' is {effort!r}; use {', '.join(_EFFORTS)}", param="reasoning.effort")
    grammar, fmt = _text_format(f)
    offered, tools = _tools(f)
    if offered is not None and grammar is not None:
        raise ApiError(400, "'text.format' and 'tools' cannot be combined: a reply is either calls or the format",
                       param="text.format")
    metadata = f.obj("metadata")
    f.string("user")
    choice = f.raw("tool_choice")
    echo = {"instructions": instructions, "max_output_tokens": f.raw("max_output_tokens"),
            "metadata": dict(metadata.data) if metadata is not None else {},
            "parallel_tool_calls": f.boolean("parallel_tool_calls", True), "previous_response_id": previous,
            "reasoning": {"effort": effort, "summary": None}, "temperature": temperature if temperature is not None
            else 1.0, "text": {"format": fmt}, "tool_choice": choice if choice is not None else "auto",
            "tools": tools, "top_p": top_p if top_p is not None else 1.0, "truncation": "disabled",
            "user": f.raw("user"), "store": f.boolean("store", True)}
    return Ask(model, conversation, instructions, params, f.integer("max_output_tokens", minimum=1),
               f.boolean("stream", False), f.boolean("store", True), grammar, offered,
               None if effort is None else effort != "none", effort, listed_items(f.raw("input")), echo)


# ---------------------------------------------------------------------------------------- the reply
async def _start(request: Request, ask: Ask) -> tuple[Lease, ReplyShape]:
    """The chat pipeline's start: the prompt through the model's template (tools, thinking), its
    grammar, checked against the context and queued."""
    shape = ReplyShape()

    async def prepare(lease: Lease) -> None:
        nonlocal shape
        ids, grammar, shape = await anyio.to_thread.run_sync(prepare_chat, lease.slot.lm.tokenizer, ask.chat,
                                                             ask.tools, ask.grammar, ask.think, None, ask.effort)
        check_prompt(ids, lease.slot, param="input")
        lease.submit(ids, ask.params, ask.max_tokens, [], await lease.constraint(grammar))

    lease = await start_reply(request, prepare, ask.model)
    return lease, shape


def _usage(o: Outcome, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": o.prompt_tokens, "input_tokens_details": {"cached_tokens": o.cached_tokens},
            "output_tokens": o.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": o.prompt_tokens + o.completion_tokens}


def _reasoning_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"id": rid, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def _message_item(mid: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
        else []
    return {"id": mid, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "call_id": call.id,
            "name": call.name, "arguments": json.dumps(call.arguments) if arguments is None else arguments,
            "status": status}


@dataclass
class _Response:
    """One response's object as it is built, and what is stored of it once it ends."""

    ask: Ask
    id: str = field(default_factory=lambda: _new_id("resp"))
    created: int = field(default_factory=now_s)

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": now_s() if status == "completed" else None, "error": error,
                "incomplete_details": incomplete, "model": self.ask.model, "output": output, "usage": usage,
                **self.ask.echo}

    def finish(self, request: Request, o: Outcome, thinking: str, content: str, calls: list[ToolCall],
               output: list[dict[str, Any]], tokenizer: Any) -> dict[str, Any]:
        """The final object (stored where ``store``)."""
        status = "incomplete" if o.finish_reason == "length" else "completed"
        reasoning_tokens = len(tokenizer.encode(thinking, add_special=False)) if thinking else 0
        body = self.body(status, output, _usage(o, reasoning_tokens))
        if self.ask.store:
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = [{"type": "function", "id": c.id,
                                        "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            _store(request).put(body, self.ask.conversation + [reply], self.ask.items)
        return body


def _item_status(o: Outcome) -> str:
    return "incomplete" if o.finish_reason == "length" else "completed"


async def _whole(request: Request, ask: Ask, lease: Lease, shape: ReplyShape, resp: _Response) -> Response:
    tokenizer = lease.slot.lm.tokenizer
    text, o = await whole_reply(request, lease)
    thinking, content, calls = shape.whole(text, was_cut(o.finish_reason))  # a cut call's text is no answer
    status = _item_status(o)
    output = []
    if thinking:
        output.append(_reasoning_item(_new_id("rs"), thinking, status))
    if content or not calls:
        output.append(_message_item(_new_id("msg"), content, status))
    output += [_call_item(c) for c in calls]
    return JSONResponse(resp.finish(request, o, thinking, content, calls, output, tokenizer))


class _Events:
    """The typed SSE events of one streamed response, numbered in order."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps(event)}\n\n"


def _stream(request: Request, ask: Ask, lease: Lease, shape: ReplyShape, resp: _Response) -> Response:
    gen = lease.gen
    if gen is None:
        raise RuntimeError("a streamed response needs a submitted lease")
    tokenizer = lease.slot.lm.tokenizer

    async def events() -> AsyncGenerator[str, None]:
        ev = _Events()
        yield ev("response.created", response=resp.body("in_progress", [], None))
        yield ev("response.in_progress", response=resp.body("in_progress", [], None))
        output: list[dict[str, Any]] = []
        open_kind: str | None = None  # "thinking" or "answer": the item being streamed
        texts = {"thinking": "", "answer": ""}
        item_text = ""
        item_id = ""

        def close(status: str) -> list[str]:
            nonlocal open_kind
            index = len(output)
            if open_kind == "thinking":
                item = _reasoning_item(item_id, item_text, status)
                done = [ev("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=item_text),
                        ev("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part={"type": "reasoning_text", "text": item_text})]
            else:
                item = _message_item(item_id, item_text, status)
                done = [ev("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=item_text, logprobs=[]),
                        ev("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=item["content"][0])]
            output.append(item)
            open_kind = None
            return done + [ev("response.output_item.done", output_index=index, item=item)]

        def open_item(kind: str) -> list[str]:
            nonlocal open_kind, item_text, item_id
            open_kind, item_text = kind, ""
            index = len(output)
            if kind == "thinking":
                item_id = _new_id("rs")
                item = {**_reasoning_item(item_id, "", "in_progress"), "content": []}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item_id = _new_id("msg")
                item = _message_item(item_id, "", "in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return [ev("response.output_item.added", output_index=index, item=item),
                    ev("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                       part=part)]

        async for kind, text, _ in stream_parts(gen, shape):
            if kind != open_kind:
                if open_kind is not None:
                    for e in close("completed"):
                        yield e
                for e in open_item(kind):
                    yield e
            item_text += text
            texts[kind] += text
            delta = "response.reasoning_text.delta" if kind == "thinking" else "response.output_text.delta"
            extra = {} if kind == "thinking" else {"logprobs": []}
            yield ev(delta, item_id=item_id, output_index=len(output), content_index=0, delta=text, **extra)
        o = gen.outcome
        if o is None or o.finish_reason == "error":
            err = from_exception((o.error if o is not None else None) or RuntimeError("generation failed"))
            error = {"code": err.code or "server_error", "message": err.message}
            yield ev("response.failed", response=resp.body("failed", output, None, error))
            return
        calls = shape.found
        status = _item_status(o)
        if open_kind is None and not calls and not any(i["type"] == "message" for i in output):
            for e in open_item("answer"):  # a reply with no text is still an (empty) message
                yield e
        if open_kind is not None:
            for e in close(status):
                yield e
        for call in calls:
            index = len(output)
            item = _call_item(call)
            yield ev("response.output_item.added", output_index=index, item=_call_item(call, "in_progress", ""))
            yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                     delta=item["arguments"])
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                     name=call.name, arguments=item["arguments"])
            output.append(item)
            yield ev("response.output_item.done", output_index=index, item=item)
        body = resp.finish(request, o, texts["thinking"], texts["answer"], calls, output, tokenizer)
        yield ev("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)

    return sse_response(events(), on_close=lease.close)


# ---------------------------------------------------------------------------------------- the routes
@endpoint(OPENAI, "/v1/responses")
async def create_response(request: Request) -> Response:
    f = Fields(await read_json(request, state(request).config.max_body_bytes))
    ask = _ask(request, f)
    lease, shape = await _start(request, ask)
    resp = _Response(ask)
    if ask.stream:
        return _stream(request, ask, lease, shape, resp)
    return await _whole(request, ask, lease, shape, resp)


def _stored_id(request: Request) -> str:
    return str(request.path_params["response_id"])


@endpoint(OPENAI, "/v1/responses/{id}")
async def get_response(request: Request) -> Response:
    rid = _stored_id(request)
    stored = _store(request).get(rid)
    if stored is None:
        raise ApiError(404, f"no stored response {rid!r} (never stored, deleted, or evicted)", param="response_id")
    return JSONResponse(stored.body)


@endpoint(OPENAI, "/v1/responses/{id}")
async def delete_response(request: Request) -> Response:
    rid = _stored_id(request)
    if not _store(request).delete(rid):
        raise ApiError(404, f"no stored response {rid!r} (never stored, deleted, or evicted)", param="response_id")
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


@endpoint(OPENAI, "/v1/responses/{id}/input_items")
async def list_input_items(request: Request) -> Response:
    """A stored response's input items, a page at a time (``limit`` 1-100, default 20; ``order``
    ``desc``, the default, or ``asc``; ``after`` / ``before`` an item id), as OpenAI's list object."""
    rid = _stored_id(request)
    stored = _store(request).get(rid)
    if stored is None:
        raise ApiError(404, f"no stored response {rid!r} (never stored, deleted, or evicted)", param="response_id")
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"'order' is {order!r}; use asc or desc", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, f"'limit' is {query.get('limit')!r}; give an integer from 1 to 100", param="limit")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    ids = [item["id"] for item in items]
    for key in ("after", "before"):
        if key in query and query[key] not in ids:
            raise ApiError(400, f"'{key}' is {query[key]!r}, which is no input item of response {rid!r}",
                           param=key)
    start = ids.index(query["after"]) + 1 if "after" in query else 0
    end = ids.index(query["before"]) if "before" in query else len(items)
    page = items[start:end][:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end})


ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
]
