"""The Starlette app: the two route sets, ``/metrics``, bearer-key authentication on every
endpoint, the Host and Origin checks (:mod:`localllm.server.origins`), errors in each API's shape for
unknown routes and methods and for requests cut at shutdown, and the models' lifecycle (started with
the app, everything cancelled and unloaded when it stops)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localllm.server import anthropic_routes, ollama_routes, openai_routes
from localllm.server import responses_routes
from localllm.server.common import ServerState, state
from localllm.server.config import ServerConfig
from localllm.server.errors import ApiError, api_of_path, error_response, ollama_body, openai_body
from localllm.server.metrics import CONTENT_TYPE, Metrics
from localllm.server.models import ModelManager
from localllm.server.origins import add_origin_checks
from localllm.server.streaming import ndjson_line, sse_event


T = TypeVar("T")


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop where it is installed (as uvicorn's "standard" set runs), else asyncio's: a streamed
    token's cost in the loop is CPU time the model's step loses on a machine whose cores it all uses."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_serving(main: Coroutine[Any, Any, T]) -> T:
    """``main`` (uvicorn's ``Server.serve`` and what goes with it) to its end on a loop of its own
    (:func:`event_loop_factory`), as ``asyncio.run`` would run it."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(main)
    loop = event_loop_factory()()  # Python 3.10: no asyncio.Runner
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


class BearerAuth:
    """Every HTTP request must carry ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as
    Anthropic's clients send it); else 401 in the path's API shape."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer":
                token = headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token.strip(), self.key):
                err = ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>' or "
                               "'x-api-key: <key>'", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(err, api_of_path(scope["path"]))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CutAtShutdown:
    """Requests still running when the grace period at shutdown ends are cancelled (uvicorn cancels
    their tasks); each is answered in its API's shape instead of ending in a traceback: a reply not
    yet started gets a 503, a stream a closing error event (an SSE ``data: {"error": {...}}`` event,
    an NDJSON ``{"error": "..."}`` line) and its end. What the request held is released on the way
    out (its stream's ``on_close``, its lease's ``finally``)."""

    #: How long the closing answer may take to send (a client that reads nothing gets no more).
    SEND_S = 1.0

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        media: list[bytes] = []  # the response's content type, once it has started
        ended = False

        async def watch(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                media.append(dict(message.get("headers", [])).get(b"content-type", b""))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            if ended:
                return
            err = ApiError(503, "the server is shutting down and cut this reply short; retry once it is back",
                           code="server_shutting_down")
            api = api_of_path(scope["path"])
            with anyio.move_on_after(self.SEND_S, shield=True):
                if not media:
                    await error_response(err, api)(scope, receive, send)
                    return
                if media[0].startswith(b"text/event-stream"):
                    closing = sse_event(openai_body(err))
                elif media[0].startswith(b"application/x-ndjson"):
                    closing = ndjson_line(ollama_body(err))
                else:
                    closing = ""
                await send({"type": "http.response.body", "body": closing.encode(), "more_body": False})
            # not raised again: the request is answered and over, and uvicorn would log a traceback


async def metrics(request: Request) -> Response:
    st = state(request)
    engines = [(name, slot.engine.usage(), slot.engine.plan.bytes) for name, slot in list(st.manager.slots.items())]
    return PlainTextResponse(st.metrics.render(engines), media_type=CONTENT_TYPE)


async def root(request: Request) -> Response:
    return PlainTextResponse("localllm is running")


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 in the API's shape."""
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    err = ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)), headers=dict(exc.headers or {}))
    return error_response(err, api_of_path(request.url.path))


def create_app(config: ServerConfig) -> Starlette:
    """The ASGI app for ``config`` (serve it with uvicorn; the CLI's ``serve`` does)."""
    metrics_ = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        manager = ModelManager(config, metrics_)
        app.state.server = ServerState(config, manager, metrics_, time.time())
        manager.start()
        try:
            yield
        finally:
            await manager.close()

    routes = [
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/metrics", metrics, methods=["GET"]),
        *openai_routes.ROUTES,
        *responses_routes.ROUTES,
        *ollama_routes.ROUTES,
        *anthropic_routes.ROUTES,
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    if config.api_key:
        app.add_middleware(BearerAuth, key=config.api_key)
    add_origin_checks(app, config.host, config.allowed_hosts, config.allowed_origins)
    app.add_middleware(CutAtShutdown)  # outermost: it answers whatever the others had begun
    return app
