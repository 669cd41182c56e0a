"""Response bodies that stream (SSE for OpenAI, NDJSON for Ollama), and waiting for a whole reply
while watching for the client to go away: either way a disconnect cancels the generation.

A streamed reply is :class:`ClosingStream`, not Starlette's ``StreamingResponse``: when the client
leaves, Starlette cancels the task that sends, and a body generator suspended at a ``yield`` (its
chunk being sent) is then left unfinished until the garbage collector closes it, with its request's
sequence still running and its model still held. :class:`ClosingStream` closes the body and runs
its ``on_close`` as soon as the stream ends, whatever ended it."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_event(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def ndjson_line(obj: Any) -> str:
    return dumps(obj) + "\n"


class ClosingStream(Response):
    """A streamed body sent while listening for the client's disconnect. However the stream ends (the
    body done, the client gone, a failed send, the server shutting down), the body generator is
    closed and ``on_close`` runs, once, before this response returns."""

    def __init__(self, body: AsyncGenerator[str, None], media_type: str, on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        failed: list[Exception] = []
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await send({"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
                        async for chunk in self.body_iterator:
                            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    except OSError:  # the connection broke while sending: the client is gone
                        pass
                    except Exception as e:  # noqa: BLE001 - raised below, once the stream is closed
                        failed.append(e)
                    tg.cancel_scope.cancel()

                async def listen() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(listen)
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()
        if failed:  # the ASGI server logs it and drops the connection: the client sees a broken stream
            raise failed[0]


def sse_response(events: AsyncGenerator[str, None], on_close: Callable[[], None]) -> ClosingStream:
    """Server-sent events; ``on_close`` runs when the stream ends, however it ends."""
    return ClosingStream(events, "text/event-stream", on_close,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def ndjson_response(lines: AsyncGenerator[str, None], on_close: Callable[[], None] | None = None) -> ClosingStream:
    """Newline-delimited JSON; ``on_close`` as for :func:`sse_response`."""
    return ClosingStream(lines, "application/x-ndjson", on_close)


class ClientGone(Exception):
    """The client disconnected before its reply was ready."""


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work()`` (the body already read) while listening for ``http.disconnect``; a disconnect
    cancels ``work`` (whose ``finally`` cancels its generation) and raises :class:`ClientGone`.
    What ``work`` raises is raised as it is. A result that came with the disconnect is returned: the
    caller owns it, and its response finds the client gone."""
    result: list[T] = []
    failed: list[Exception] = []
    gone = False

    async with anyio.create_task_group() as tg:
        async def run() -> None:
            try:
                result.append(await work())
            except Exception as e:  # noqa: BLE001 - raised below, outside the task group's wrapping
                failed.append(e)
            tg.cancel_scope.cancel()

        async def listen() -> None:
            nonlocal gone
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    gone = True
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(run)
        tg.start_soon(listen)
    if failed:
        raise failed[0]
    if gone and not result:
        raise ClientGone()
    return result[0]
