"""Ollama-compatible routes: ``/api/generate`` and ``/api/chat`` (NDJSON streaming by default,
``stream: false`` for one object), ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/pull`` (NDJSON
progress of the real pull), ``/api/delete``, ``/api/version``.

Statistics are Ollama's names and units (nanoseconds). ``prompt_eval_count`` counts the prompt
tokens actually run through the model: those the prefix cache served are left out, as Ollama's
own runner does with its cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import localllm
from localllm.errors import LocalLLMError
from localllm.runtime.batch import MAX_TOP_LOGPROBS, TokenLogprob
from localllm.runtime.tools import ToolCall
from localllm.runtime.constrain import Grammar
from localllm.runtime.sampling import SamplingParams
from localllm.server.common import check_prompt, endpoint, start_reply, state, whole_reply
from localllm.server.config import parse_duration
from localllm.server.embeddings import embed, inputs_of
from localllm.server.errors import OLLAMA, ApiError, ModelNotFound, from_exception
from localllm.server.generation import Outcome
from localllm.server.logprobs import chat_content
from localllm.server.models import DEFAULT, Lease
from localllm.server.names import (AS_RUN, REPO, Target, check_name, is_repo_id, is_store_name, pull_source, stored,
                                   stored_from_repo)
from localllm.server.streaming import ndjson_line, ndjson_response
from localllm.server import catalogue, tool_calls
from localllm.server.replies import ReplyShape, prepare_chat, stream_parts, was_cut
from localllm.server.structured import ollama_format
from localllm.server.tool_calls import ToolAsk
from localllm.server.validate import Fields, messages, read_json

if TYPE_CHECKING:
    from localllm.loaders.store import StoredModel

_DEFAULTS = SamplingParams()
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def iso_now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


@dataclass
class Run:
    """A generate/chat request's settings."""

    model: str
    params: SamplingParams
    max_tokens: int | None
    num_ctx: int | None
    stop: list[str]
    stream: bool
    keep_alive: object
    grammar: Grammar | None  # what the reply must match ("format"); None: free text
    logprobs: int | None  # alternatives each token's entry lists ("top_logprobs"); None: no entries
    tools: ToolAsk | None  # /api/chat's tools (None: none)
    think: bool | None  # the template's enable_thinking (None: its default)
    effort: str | None  # "think" as a level (low, medium, high): harmony's template takes it


def _run(f: Fields) -> Run:
    model = f.string("model", required=True)
    assert model is not None
    if not model.strip():
        raise ApiError(400, "'model' is empty", param="model")
    for key in ("images", "template", "suffix", "context"):
        if f.raw(key) not in (None, "", []):
            raise ApiError(400, f"'{key}' is not supported by this server", param=key)
    o = f.obj("options") or Fields({}, "options.")
    temperature = o.number("temperature", 0)
    top_k = o.integer("top_k", 0)
    top_p = o.number("top_p", 0, 1)
    min_p = o.number("min_p", 0, 1)
    repeat_penalty = o.number("repeat_penalty")
    repeat_last_n = o.integer("repeat_last_n", -1)
    seed = o.integer("seed", *_SEED_RANGE)
    num_ctx = o.integer("num_ctx", 1)
    num_predict = o.integer("num_predict", -2)
    stop = o.stop("stop")
    if num_predict == 0:
        raise ApiError(400, "'options.num_predict' is 0; give -1 (no limit), -2 (fill the context) or more than 0",
                       param="options.num_predict")
    try:
        params = SamplingParams(
            temperature=_DEFAULTS.temperature if temperature is None else temperature,
            top_k=_DEFAULTS.top_k if top_k is None else top_k,
            top_p=_DEFAULTS.top_p if top_p is None else top_p,
            min_p=_DEFAULTS.min_p if min_p is None else min_p,
            repeat_penalty=_DEFAULTS.repeat_penalty if repeat_penalty is None else repeat_penalty,
            repeat_last_n=_DEFAULTS.repeat_last_n if repeat_last_n is None else
            (num_ctx or 4096) if repeat_last_n == -1 else repeat_last_n,
            seed=seed)
    except LocalLLMError as e:
        raise ApiError(400, e.one_line(), param="options") from None
    keep_alive = _keep_alive(f)
    max_tokens = num_predict if num_predict is not None and num_predict > 0 else None
    top = f.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
    logprobs = (top or 0) if f.boolean("logprobs", False) else None
    if top and logprobs is None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    grammar, tools = ollama_format(f.raw("format")), tool_calls.ollama_tools(f.raw("tools"))
    if grammar is not None and tools is not None:
        raise ApiError(400, "'format' and 'tools' cannot be combined: a reply is either calls or the format",
                       param="format")
    think = f.raw("think")
    if think is not None and not isinstance(think, bool) and think not in ("low", "medium", "high"):
        raise ApiError(400, "'think' must be true, false, \"low\", \"medium\" or \"high\"", param="think")
    return Run(model, params, max_tokens, num_ctx, stop, f.boolean("stream", True), keep_alive,
               grammar, logprobs, tools, None if think is None else think is not False,
               think if isinstance(think, str) else None)


def _stats(o: Outcome, started: float, load_s: float) -> dict[str, Any]:
    first = o.first_token_at if o.first_token_at is not None else o.finished_at
    return {
        "total_duration": _ns(time.perf_counter() - started),
        "load_duration": _ns(load_s),
        "prompt_eval_count": max(0, o.prompt_tokens - o.cached_tokens),
        "prompt_eval_duration": _ns(first - o.submitted_at),
        "eval_count": o.completion_tokens,
        "eval_duration": _ns(o.finished_at - first),
    }


def _done_reason(o: Outcome) -> str:
    """"length", "stop", or "constraint": the grammar allowed no further token (the server logs why)."""
    return o.finish_reason if o.finish_reason in ("length", "constraint") else "stop"


async def _load_or_unload(request: Request, run: Run) -> Response | None:
    """A request with nothing to generate loads the model (or with ``keep_alive: 0`` unloads it)."""
    manager = state(request).manager
    if run.keep_alive == 0:
        await manager.unload(run.model)
        return None
    slot, _ = await manager.acquire(run.model, run.keep_alive)
    manager.release(slot)
    return None


async def _generate(request: Request, run: Run, prompt: Any, chat: bool) -> Response:
    started = time.perf_counter()
    if not prompt:  # load (or unload) only
        await _load_or_unload(request, run)
        done = {"model": run.model, "created_at": iso_now(), "done": True,
                "done_reason": "unload" if run.keep_alive == 0 else "load"}
        done.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        return JSONResponse(done)

    shape: ReplyShape | None = None

    async def prepare(lease: Lease) -> None:
        nonlocal shape
        tok = lease.slot.lm.tokenizer
        grammar = run.grammar
        if isinstance(prompt, list):
            ids, grammar, shape = await anyio.to_thread.run_sync(prepare_chat, tok, prompt, run.tools, grammar,
                                                                 run.think, None, run.effort)
        else:
            ids = await anyio.to_thread.run_sync(tok.encode, prompt)
        ctx = check_prompt(ids, lease.slot, run.num_ctx, param="messages" if chat else "prompt")
        max_tokens = run.max_tokens
        if run.num_ctx is not None:  # the reply ends where the asked-for context is full
            room = ctx - len(ids)
            max_tokens = room if max_tokens is None else min(max_tokens, room)
        if run.logprobs is not None:
            await lease.token_bytes()
        lease.submit(ids, run.params, max_tokens, run.stop, await lease.constraint(grammar), run.logprobs)

    lease = await start_reply(request, prepare, run.model, run.keep_alive)
    gen = lease.gen
    assert gen is not None  # start_reply submitted it
    token_bytes = lease.slot.constraints.token_bytes if run.logprobs is not None else None  # built in prepare

    def piece_obj(text: str, entries: list[TokenLogprob] | None = None,
                  calls: list[ToolCall] | None = None, thinking: str = "") -> dict[str, Any]:
        base: dict[str, Any] = {"model": run.model, "created_at": iso_now()}
        base.update({"message": {"role": "assistant", "content": text}} if chat else {"response": text})
        if thinking:
            (base["message"] if chat else base)["thinking"] = thinking
        if calls:
            base["message"]["tool_calls"] = tool_calls.ollama_calls(calls)
        if token_bytes is not None and entries is not None:
            base["logprobs"] = chat_content(entries, token_bytes)
        return base

    def final(o: Outcome, text: str, entries: list[TokenLogprob] | None = None,
              calls: list[ToolCall] | None = None, thinking: str = "") -> dict[str, Any]:
        body = piece_obj(text, entries, calls, thinking)
        body.update({"done": True, "done_reason": _done_reason(o), **_stats(o, started, lease.load_s)})
        return body

    if run.stream:
        async def lines() -> AsyncGenerator[str, None]:
            async for kind, text, entries in stream_parts(gen, shape):
                if kind == "thinking":
                    yield ndjson_line({**piece_obj("", thinking=text), "done": False})
                else:
                    yield ndjson_line({**piece_obj(text, entries), "done": False})
            o = gen.outcome
            assert o is not None
            if shape is not None and shape.found:  # each call whole, in one chunk
                yield ndjson_line({**piece_obj("", [], shape.found), "done": False})
            if o.finish_reason == "error":
                yield ndjson_line({"error": from_exception(o.error or RuntimeError("failed")).message})
            else:
                yield ndjson_line(final(o, ""))

        return ndjson_response(lines(), on_close=lease.close)
    text, o = await whole_reply(request, lease)
    thinking, answer, calls = shape.whole(text, was_cut(o.finish_reason)) if shape is not None else ("", text, [])
    return JSONResponse(final(o, answer, gen.logprobs, calls, thinking))


@endpoint(OLLAMA, "/api/generate")
async def generate(request: Request) -> Response:
    f = Fields(await read_json(request, state(request).config.max_body_bytes))
    run = _run(f)
    if run.tools is not None:
        raise ApiError(400, "'tools' is for /api/chat", param="tools")
    prompt = f.string("prompt", default="") or ""
    system = f.string("system")
    if prompt and not f.boolean("raw", False):
        chat = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return await _generate(request, run, chat, chat=False)
    return await _generate(request, run, prompt, chat=False)


@endpoint(OLLAMA, "/api/chat")
async def chat(request: Request) -> Response:
    f = Fields(await read_json(request, state(request).config.max_body_bytes))
    run = _run(f)
    msgs = messages(f.raw("messages") or [])
    return await _generate(request, run, msgs, chat=True)


# --------------------------------------------------------------------------- models
def _details(config: dict[str, Any] | Any, fmt: str, level: str) -> dict[str, Any]:
    from localllm.format import human_count
    from localllm.runtime.config import ModelConfig

    cfg = ModelConfig.from_dict(config) if isinstance(config, dict) else config
    return {"parent_model": "", "format": fmt, "family": cfg.arch, "families": [cfg.arch],
            "parameter_size": human_count(cfg.num_parameters()), "quantization_level": level.upper()}


def _tags() -> list[dict[str, Any]]:
    """Every model ``run`` can name without a path: the store's entries and the embedded default."""
    from localllm.format import human_count

    return [{"name": m.name, "model": m.name, "modified_at": m.modified.isoformat(), "size": m.size,
             "digest": m.digest,
             "details": {"parent_model": "", "format": m.format, "family": m.arch, "families": [m.arch],
                         "parameter_size": human_count(m.parameters), "quantization_level": m.scheme.upper()}}
            for m in catalogue.listed()]


@endpoint(OLLAMA, "/api/tags")
async def tags(request: Request) -> Response:
    return JSONResponse({"models": await anyio.to_thread.run_sync(_tags)})


def _show(name: str, target: Target) -> tuple[dict[str, Any], StoredModel | None]:
    """The facts about what ``name`` resolved to, and its store entry (None for files and folders);
    ``show`` never downloads, so a Hub repo must be stored."""
    from localllm.loaders import describe
    from localllm.loaders.store import Store

    try:
        if target.kind == REPO:
            entry = stored_from_repo(Store(), target.ref)
            if entry is None:
                raise ModelNotFound(f"model '{name}' not found",
                                    f"pull it first (/api/pull, or `localllm pull {name}`)")
            return describe.describe_stored(entry), entry
        if target.entry is not None:
            return describe.describe_stored(target.entry), target.entry
        if target.kind == AS_RUN:
            return describe.describe_ref(target.ref)
        return describe.describe_path(Path(target.ref)), None
    except LocalLLMError as e:
        if "not found" in e.message or "does not exist" in e.message or "no such" in e.message:
            raise ModelNotFound(e.message, e.hint) from None
        raise


def _show_reply(name: str, target: Target) -> dict[str, Any]:
    facts, entry = _show(name, target)
    template = catalogue.chat_template(str(entry.path) if entry is not None else str(facts["path"]))
    arch = facts["architecture"]
    info = {"general.architecture": arch, "general.parameter_count": facts["parameters"],
            f"{arch}.context_length": facts["context_length"], f"{arch}.embedding_length": facts["embedding_length"],
            f"{arch}.block_count": facts["layers"], f"{arch}.attention.head_count": facts["heads"],
            f"{arch}.attention.head_count_kv": facts["kv_heads"], "general.file_type": facts["scheme"]}
    details = {"parent_model": "", "format": "gguf" if str(facts["path"]).endswith(".gguf") else "safetensors",
               "family": arch, "families": [arch], "parameter_size": _count(facts["parameters"]),
               "quantization_level": str(facts["scheme"]).upper()}
    return {"modelfile": f"# localllm model {facts['name'] or name}\nFROM {facts['path']}\n",
            "parameters": "", "template": template, "details": details, "model_info": info,
            "capabilities": catalogue.capabilities(template), "modified_at": facts.get("created") or iso_now()}


def _count(n: int) -> str:
    from localllm.format import human_count

    return human_count(n)


@endpoint(OLLAMA, "/api/show")
async def show(request: Request) -> Response:
    f = Fields(await read_json(request, state(request).config.max_body_bytes))
    name = f.string("model") or f.string("name")
    if not name:
        raise ApiError(400, "'model' is required", param="model")
    manager = state(request).manager
    target = await anyio.to_thread.run_sync(manager.target, name)
    return JSONResponse(await anyio.to_thread.run_sync(_show_reply, name, target))


@endpoint(OLLAMA, "/api/ps")
async def ps(request: Request) -> Response:
    models = []
    for name, slot in list(state(request).manager.slots.items()):
        level = slot.lm.scheme_label
        models.append({
            "name": name, "model": name, "size": slot.size_bytes + slot.host_bytes,  # size_vram: the GPU's share
            "digest": hashlib.sha256(name.encode()).hexdigest(),
            "details": _details(slot.lm.config, "gguf" if name.endswith(".gguf") else "safetensors", level),
            "expires_at": slot.expires_at_wall().isoformat(),
            "size_vram": slot.size_bytes if slot.lm.device.type == "cuda" else 0,
            "context_length": slot.context_length,
        })
    return JSONResponse({"models": models})


@endpoint(OLLAMA, "/api/delete")
async def delete(request: Request) -> Response:
    from localllm.loaders.store import Store

    f = Fields(await read_json(request, state(request).config.max_body_bytes))
    name = f.string("model") or f.string("name")
    if not name:
        raise ApiError(400, "'model' is required", param="model")

    check_name(name, state(request).config)

    def remove() -> str:
        store = Store()
        if is_repo_id(name):
            entry = stored_from_repo(store, name)
            if entry is None:
                raise ModelNotFound(f"model '{name}' not found", "/api/tags lists the stored models")
        elif is_store_name(name):
            entry = stored(store, name)
        else:
            raise ApiError(400, f"'{name}' is not a stored model's name; /api/delete removes stored models, "
                                "named NAME[:SCHEME] as /api/tags lists them", param="model")
        try:
            return store.remove(entry.ref).ref
        except LocalLLMError as e:  # deleted meanwhile
            raise ModelNotFound(e.message, e.hint) from None

    ref = await anyio.to_thread.run_sync(remove)
    for key in {name, ref}:
        await state(request).manager.forget(key)
    return Response(status_code=200)


@endpoint(OLLAMA, "/api/pull")
async def pull(request: Request) -> Response:
    from localllm.loaders.pull import PULL_SCHEMES, PullOptions, pull_model

    st = state(request)
    f = Fields(await read_json(request, st.config.max_body_bytes))
    name = f.string("model") or f.string("name")
    if not name:
        raise ApiError(400, "'model' is required", param="model")
    stream = f.boolean("stream", True)
    f.boolean("insecure", False)
    # the server's --quant where it names a scheme to store; else the pull's own default (a quantized
    # repo's or GGUF file's weights as they are, a float model as int4)
    quant = st.config.quant if st.config.quant in PULL_SCHEMES else None
    # a name the server does not pull is a 400 before anything starts
    source = await anyio.to_thread.run_sync(pull_source, name, st.config)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def notify(message: str) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, {"status": message})

    def work() -> None:
        try:
            result = pull_model(source, PullOptions(quant), notify=notify)
            loop.call_soon_threadsafe(queue.put_nowait, {"status": "success", "model": result.entry.ref})
        except BaseException as e:  # noqa: BLE001 - reported to the client
            err = from_exception(e)
            loop.call_soon_threadsafe(queue.put_nowait, {"error": err.message, "_status": err.status})

    # The pull runs to its end on a worker thread even if the client leaves: the store stays consistent.
    task = asyncio.ensure_future(anyio.to_thread.run_sync(work))

    async def messages_() -> AsyncIterator[dict[str, Any]]:
        while True:
            item = await queue.get()
            yield item
            if "error" in item or item.get("status") == "success":
                await task
                return

    if stream:
        async def lines() -> AsyncGenerator[str, None]:
            async for item in messages_():
                item.pop("_status", None)
                item.pop("model", None)
                yield ndjson_line(item)

        return ndjson_response(lines())
    last: dict[str, Any] = {}
    async for item in messages_():
        last = item
    if "error" in last:
        raise ApiError(int(last["_status"]), str(last["error"]))
    return JSONResponse({"status": "success"})


#: The Ollama version this server answers ``/api/version`` with: the release whose API it serves
#: (chat, tools, thinking, structured outputs, OpenAI's Responses and Anthropic's Messages routes).
#: Clients of Ollama gate features on this version and refuse or degrade a server older than they
#: need, so it is Ollama's number, not localllm's (which is under ``localllm_version``).
OLLAMA_VERSION = "0.14.0"


@endpoint(OLLAMA, "/api/version")
async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION, "localllm_version": localllm.__version__})


def _keep_alive(f: Fields) -> object:
    if f.raw("keep_alive") is None:
        return DEFAULT
    try:
        return parse_duration(f.raw("keep_alive"))
    except LocalLLMError as e:
        raise ApiError(400, f"'keep_alive': {e.one_line()}", param="keep_alive") from None


@endpoint(OLLAMA, "/api/embed")
async def embed_route(request: Request) -> Response:
    """Ollama's embed: ``input`` (a string or strings), ``truncate`` (default true: an input past the
    context is cut to it; false: refused), ``dimensions``."""
    f = Fields(await read_json(request, state(request).config.max_body_bytes))
    model = f.string("model", required=True)
    inputs = inputs_of(f.raw("input"), ids_allowed=False)
    done = await embed(request, model, inputs, truncate=f.boolean("truncate", True),  # type: ignore[arg-type]
                       dimensions=f.integer("dimensions", 1), keep_alive=_keep_alive(f))
    return JSONResponse({"model": model, "embeddings": done.vectors, "total_duration": _ns(done.total_s),
                         "load_duration": _ns(done.load_s), "prompt_eval_count": done.prompt_tokens})


@endpoint(OLLAMA, "/api/embeddings")
async def embeddings_route(request: Request) -> Response:
    """Ollama's older embeddings: one ``prompt``, one ``embedding``."""
    f = Fields(await read_json(request, state(request).config.max_body_bytes))
    model = f.string("model", required=True)
    prompt = f.string("prompt", required=True)
    done = await embed(request, model, [prompt], truncate=True, dimensions=None,  # type: ignore[arg-type,list-item]
                       keep_alive=_keep_alive(f))
    return JSONResponse({"embedding": done.vectors[0]})


ROUTES = [
    Route("/api/embed", embed_route, methods=["POST"]),
    Route("/api/embeddings", embeddings_route, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/pull", pull, methods=["POST"]),
    Route("/api/delete", delete, methods=["DELETE"]),
    Route("/api/version", version, methods=["GET"]),
]
