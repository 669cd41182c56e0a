"""OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming
ending in ``[DONE]``, or one JSON answer), ``GET /v1/models`` and ``GET /v1/models/{id}``."""

from __future__ import annotations

import base64
import dataclasses
import struct
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localllm.runtime.batch import MAX_TOP_LOGPROBS, TokenLogprob
from localllm.runtime.constrain import Grammar
from localllm.runtime.sampling import SamplingParams
from localllm.server.common import check_prompt, endpoint, now_s, request_id, start_reply, state, whole_reply
from localllm.server.embeddings import embed, inputs_of
from localllm.server.errors import OPENAI, ApiError, from_exception, openai_body
from localllm.server.generation import Outcome
from localllm.server.logprobs import chat_content, completion_logprobs
from localllm.server.models import Lease
from localllm.server.streaming import SSE_DONE, sse_event, sse_response
from localllm.server import catalogue, tool_calls
from localllm.server.replies import ReplyShape, end_reason, prepare_chat, stream_parts, was_cut
from localllm.server.structured import openai_response_format
from localllm.server.tool_calls import ToolAsk
from localllm.server.validate import Fields, messages, read_json

#: The legacy completions API's default reply length (OpenAI's own).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


#: Fields this server does not implement, and the values that ask for nothing (accepted).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "best_of": (1,), "suffix": ("",),
}


@dataclass
class Ask:
    """The fields both completion routes share."""

    model: str
    params: SamplingParams
    max_tokens: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    grammar: Grammar | None  # what the reply must match (response_format); None: free text
    logprobs: int | None  # alternatives each token's log-probability entry lists; None: no entries
    tools: ToolAsk | None = None  # chat: the tools offered and tool_choice (None: none)
    think: bool | None = None  # chat: the template's enable_thinking (None: its default)
    effort: str | None = None  # chat: reasoning_effort as asked (harmony's template takes its level)


def _logprobs(f: Fields, chat: bool) -> int | None:
    """Chat: ``logprobs`` true, with ``top_logprobs`` alternatives (0-20); completions: ``logprobs``
    as the number of alternatives."""
    if not chat:
        return f.integer("logprobs", 0, MAX_TOP_LOGPROBS)
    top = f.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not f.boolean("logprobs", False):
        if top:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return top or 0


def _ask(f: Fields, default_max_tokens: int | None, chat: bool) -> Ask:
    model = f.string("model", required=True)
    n = f.integer("n")
    if n is not None and n != 1:
        raise ApiError(400, f"'n' is {n}: this server generates one choice per request (n = 1 only)", param="n")
    for key, allowed in _UNSUPPORTED.items():
        value = f.raw(key)
        if value is not None and value not in allowed:
            raise ApiError(400, f"'{key}' is not supported by this server", param=key)
    max_tokens = f.integer("max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = f.integer("max_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = default_max_tokens
    temperature = f.number("temperature", 0, 2)
    top_p = f.number("top_p", 0, 1)
    if top_p == 0:
        top_p = None if temperature == 0 else 1e-9  # "only the most likely token": greedy in effect
    seed = f.integer("seed")
    options = f.obj("stream_options")
    stream = f.boolean("stream", False)
    include_usage = options.boolean("include_usage", False) if options is not None else False
    params = SamplingParams(temperature=1.0 if temperature is None else temperature, top_k=0,
                            top_p=1.0 if top_p is None else top_p, seed=seed)
    grammar = openai_response_format(f.raw("response_format"))
    return Ask(model, params, max_tokens, f.stop("stop", most=4), stream, include_usage, grammar,  # type: ignore[arg-type]
               _logprobs(f, chat))


def usage(o: Outcome) -> dict[str, Any]:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": o.cached_tokens}}


def finish_reason(o: Outcome) -> str:
    """"length", "stop", or "constraint": the grammar allowed no further token (the server logs why)."""
    return o.finish_reason if o.finish_reason in ("length", "constraint") else "stop"


async def _start(request: Request, ask: Ask, prompt: Any, chat: bool) -> tuple[Lease, ReplyShape | None]:
    """Load the model, encode the prompt (on a worker thread: templates and long prompts take time),
    check it fits, and queue it; a client that leaves meanwhile ends it (:func:`start_reply`). Also,
    for a chat, how to read its reply (thinking, calls)."""
    shape: ReplyShape | None = None

    async def prepare(lease: Lease) -> None:
        nonlocal shape
        tok = lease.slot.lm.tokenizer
        grammar = ask.grammar
        if chat:
            ids, grammar, shape = await anyio.to_thread.run_sync(prepare_chat, tok, prompt, ask.tools, grammar,
                                                                 ask.think, None, ask.effort)
        elif isinstance(prompt, str):
            ids = await anyio.to_thread.run_sync(tok.encode, prompt)
        else:
            ids = list(prompt)
            if any(not 0 <= i < tok.vocab_size for i in ids):
                raise ApiError(400, f"'prompt' has token ids outside the vocabulary (0..{tok.vocab_size - 1})",
                               param="prompt")
        check_prompt(ids, lease.slot, param="messages" if chat else "prompt")
        if ask.logprobs is not None:
            await lease.token_bytes()
        lease.submit(ids, ask.params, ask.max_tokens, ask.stop, await lease.constraint(grammar), ask.logprobs)

    lease = await start_reply(request, prepare, ask.model)
    return lease, shape


def _prompt_of(f: Fields) -> str | list[int]:
    value = f.raw("prompt")
    if value is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(s, str) for s in value):
        raise ApiError(400, "'prompt' holds several prompts: send one per request", param="prompt")
    raise ApiError(400, "'prompt' must be a string or an array of token ids", param="prompt")


async def _respond(request: Request, ask: Ask, lease: Lease, chat: bool, shape: ReplyShape | None = None) -> Response:
    gen = lease.gen
    assert gen is not None  # start_reply submitted it
    token_bytes = lease.slot.constraints.token_bytes if ask.logprobs is not None else None  # built in prepare
    offset = 0  # legacy completions: where the next token's text starts

    def scored(entries: list[TokenLogprob]) -> dict[str, Any] | None:
        nonlocal offset
        if token_bytes is None:
            return None
        if chat:
            return {"content": chat_content(entries, token_bytes), "refusal": None}
        out = completion_logprobs(entries, token_bytes, offset)
        offset = out["text_offset"][-1] + len(out["tokens"][-1]) if entries else offset
        return out

    rid = request_id("chatcmpl" if chat else "cmpl")
    created = now_s()
    kind = "chat.completion" if chat else "text_completion"

    def choice(text: str | None, reason: str | None, first: bool = False, logprobs: dict[str, Any] | None = None,
               calls: list[dict[str, Any]] | None = None, thinking: str | None = None) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if thinking is not None:  # DeepSeek's name and the newer one, as servers send both
                delta["reasoning_content"] = delta["reasoning"] = thinking
            if calls is not None:
                delta["tool_calls"] = calls
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}

    def chunk(choices: list[dict[str, Any]], use: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created,
                                "model": ask.model, "system_fingerprint": None, "choices": choices}
        if ask.include_usage:
            body["usage"] = use
        return body

    if ask.stream:
        async def events() -> AsyncGenerator[str, None]:
            if chat:
                yield sse_event(chunk([choice("", None, first=True)]))
            async for kind, text, entries in stream_parts(gen, shape):
                if kind == "thinking":
                    yield sse_event(chunk([choice(None, None, thinking=text)]))
                else:
                    yield sse_event(chunk([choice(text, None, logprobs=scored(entries))]))
            o = gen.outcome
            assert o is not None
            calls = shape.found if shape is not None else []
            for deltas in tool_calls.openai_call_deltas(calls):
                yield sse_event(chunk([choice(None, None, calls=deltas)]))
            if o.finish_reason == "error":
                yield sse_event(openai_body(from_exception(o.error or RuntimeError("generation failed"))))
            else:
                reason = end_reason(o.finish_reason, calls) if chat else finish_reason(o)
                yield sse_event(chunk([choice(None if chat else "", reason)]))
                if ask.include_usage:
                    yield sse_event(chunk([], usage(o)))
            yield SSE_DONE

        return sse_response(events(), on_close=lease.close)

    text, o = await whole_reply(request, lease)
    if chat:
        thinking, content, calls = (shape.whole(text, was_cut(o.finish_reason)) if shape is not None
                                    else ("", text, []))
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else ""),
                                   "refusal": None}
        if thinking:
            message["reasoning_content"] = message["reasoning"] = thinking
        if calls:
            message["tool_calls"] = tool_calls.openai_calls(calls)
        answer = {"index": 0, "message": message, "logprobs": scored(gen.logprobs),
                  "finish_reason": end_reason(o.finish_reason, calls)}
    else:
        answer = {"index": 0, "text": text, "logprobs": scored(gen.logprobs), "finish_reason": finish_reason(o)}
    return JSONResponse({"id": rid, "object": kind, "created": created, "model": ask.model,
                         "system_fingerprint": None, "choices": [answer], "usage": usage(o)})


@endpoint(OPENAI, "/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    body = await read_json(request, state(request).config.max_body_bytes)
    f = Fields(body)
    ask = _ask(f, None, chat=True)
    if f.raw("messages") is None:
        raise ApiError(400, "'messages' is required", param="messages")
    msgs = messages(f.raw("messages"))
    if not msgs:
        raise ApiError(400, "'messages' is empty; give at least one message", param="messages")
    offered = tool_calls.openai_tools(f.raw("tools"), f.raw("tool_choice"), f.raw("parallel_tool_calls"))
    if offered is not None and ask.grammar is not None:
        raise ApiError(400, "'response_format' and 'tools' cannot be combined: a reply is either calls or the "
                       "format", param="response_format")
    think, effort = _think(f)
    ask = dataclasses.replace(ask, tools=offered, think=think, effort=effort)
    lease, shape = await _start(request, ask, msgs, chat=True)
    return await _respond(request, ask, lease, chat=True, shape=shape)


def _think(f: Fields) -> tuple[bool | None, str | None]:
    """Thinking on or off: ``reasoning_effort`` ("none" is off), or ``chat_template_kwargs``'
    ``enable_thinking`` (as vLLM takes it); None: the template's default. Also the effort itself, for
    a template with levels (harmony's ``reasoning_effort``)."""
    effort = f.string("reasoning_effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high"):
        raise ApiError(400, f"'reasoning_effort' is {effort!r}; use none, minimal, low, medium or high",
                       param="reasoning_effort")
    think = None if effort is None else effort != "none"
    kwargs = f.obj("chat_template_kwargs")
    if kwargs is not None and kwargs.has("enable_thinking"):
        think = kwargs.boolean("enable_thinking", True)
    return think, effort


@endpoint(OPENAI, "/v1/completions")
async def completions(request: Request) -> Response:
    body = await read_json(request, state(request).config.max_body_bytes)
    f = Fields(body)
    ask = _ask(f, COMPLETIONS_DEFAULT_MAX_TOKENS, chat=False)
    if f.raw("tools"):
        raise ApiError(400, "'tools' is for /v1/chat/completions", param="tools")
    prompt = _prompt_of(f)
    lease, _ = await _start(request, ask, prompt, chat=False)
    return await _respond(request, ask, lease, chat=False)


@endpoint(OPENAI, "/v1/embeddings")
async def embeddings(request: Request) -> Response:
    """OpenAI's embeddings: ``input`` (a string, strings, token ids), ``dimensions``, ``encoding_format``
    ("float" or "base64": little-endian float32 bytes); an input past the context is refused."""
    f = Fields(await read_json(request, state(request).config.max_body_bytes))
    model = f.string("model", required=True)
    inputs = inputs_of(f.raw("input"))
    dimensions = f.integer("dimensions", 1)
    encoding = f.string("encoding_format", default="float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, f"'encoding_format' is {encoding!r}; use 'float' or 'base64'", param="encoding_format")
    done = await embed(request, model, inputs, truncate=False, dimensions=dimensions)  # type: ignore[arg-type]

    def encoded(v: list[float]) -> list[float] | str:
        return v if encoding == "float" else base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()

    data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(done.vectors)]
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens}})


def _models(request: Request) -> Any:
    """(name, created unix time) of every model a request can name without a path (the catalogue),
    and of the models loaded now."""

    async def names() -> dict[str, int]:
        found = {m.name: int(m.modified.timestamp()) for m in await anyio.to_thread.run_sync(catalogue.listed)}
        for name, slot in state(request).manager.slots.items():
            found.setdefault(name, int(slot.loaded_at))
        return found

    return names()


@endpoint(OPENAI, "/v1/models")
async def list_models(request: Request) -> Response:
    names = await _models(request)
    data = [catalogue.openai_model(n, c) for n, c in sorted(names.items())]
    return JSONResponse({"object": "list", "data": data})


@endpoint(OPENAI, "/v1/models/{model}")
async def retrieve_model(request: Request) -> Response:
    """One model of ``/v1/models`` by its id (which may hold a ``/``: a Hub repo's); an id it does not
    list is a 404."""
    model = request.path_params["model"]
    created = (await _models(request)).get(model)
    if created is None:
        raise ApiError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
    return JSONResponse(catalogue.openai_model(model, created))


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
]
