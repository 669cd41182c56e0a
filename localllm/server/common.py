"""What both route sets share: the server's state, the endpoint wrapper that turns every failure
into the API's own error body (and counts requests), and the prompt checks."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from localllm.errors import LocalLLMError
from localllm.runtime import scheduler
from localllm.server.config import ServerConfig
from localllm.server.errors import ApiError, error_response, from_exception
from localllm.server.metrics import Metrics
from localllm.server.models import DEFAULT, Lease, ModelManager, ModelSlot
from localllm.server.generation import Outcome
from localllm.server.streaming import ClientGone, unless_disconnected

#: Status logged for a client that left before its answer (nginx's convention).
CLIENT_CLOSED = 499


@dataclass
class ServerState:
    config: ServerConfig
    manager: ModelManager
    metrics: Metrics
    started: float


def state(request: Request) -> ServerState:
    return request.app.state.server  # type: ignore[no-any-return]


Endpoint = Callable[[Request], Awaitable[Response]]


def endpoint(api: str, route: str) -> Callable[[Endpoint], Endpoint]:
    """Wrap a route: errors become ``api``'s error body (never a traceback), and every answer is counted."""

    def wrap(fn: Endpoint) -> Endpoint:
        @functools.wraps(fn)
        async def run(request: Request) -> Response:
            metrics = state(request).metrics
            try:
                response = await fn(request)
            except ClientGone:
                metrics.request(route, CLIENT_CLOSED)
                return Response(status_code=CLIENT_CLOSED)
            except Exception as e:  # noqa: BLE001 - every failure is answered in the API's shape
                err = from_exception(e)
                metrics.request(route, err.status)
                return error_response(err, api)
            metrics.request(route, response.status_code)
            return response

        return run

    return wrap


def check_prompt(ids: Sequence[int], slot: ModelSlot, ctx: int | None = None, param: str = "prompt") -> int:
    """The engine's prompt check (:func:`runtime.scheduler.check_prompt`) against the context the
    request may use (``ctx``, as Ollama's ``num_ctx``, capped by the model's), as the API's 400; that
    context."""
    limit = min(ctx, slot.context_length) if ctx else slot.context_length
    try:
        scheduler.check_prompt(len(ids), limit)
    except LocalLLMError as e:
        if not ids:
            raise ApiError(400, f"{e.message}; give some text", param=param) from None
        raise ApiError(400, f"{e.message}; shorten the prompt to at most {limit - 1} tokens", param=param,
                       code="context_length_exceeded") from None
    return limit


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


async def start_reply(request: Request, prepare: Callable[[Lease], Awaitable[None]], model: str,
                      keep_alive: object = DEFAULT) -> Lease:
    """Hold ``model`` (loading it if needed) and run ``prepare(lease)`` on it (encode the prompt, check
    it, :meth:`Lease.submit`), while listening for the client: one that leaves meanwhile, the model
    still loading included, ends it (:class:`ClientGone`) and releases what it held, as does a
    failure. The caller closes the lease it gets."""

    async def start() -> Lease:
        lease = await state(request).manager.lease(model, keep_alive)
        try:
            await prepare(lease)
        except BaseException:
            lease.close()
            raise
        return lease

    return await unless_disconnected(request, start)


async def whole_reply(request: Request, lease: Lease) -> tuple[str, Outcome]:
    """A non-streaming reply: its whole text (a client that leaves cancels it), the lease closed
    either way, and a failed generation raised as the API's error."""
    gen = lease.gen
    if gen is None:
        raise RuntimeError("whole_reply needs a submitted lease")
    try:
        text = await unless_disconnected(request, gen.text)
    finally:
        lease.close()
    o = gen.outcome
    if o is None:  # gen.text returns only once the pump has recorded the outcome
        raise RuntimeError("a generation ended without an outcome")
    if o.finish_reason == "error":
        raise from_exception(o.error or RuntimeError("generation failed"))
    return text, o
