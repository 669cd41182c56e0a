"""Response bodies that stream (SSE for OpenAI, NDJSON for Ollama), and waiting for a whole reply
while watching for the client to go away: either way a disconnect cancels the generation."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

T = TypeVar("T")


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_event(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def ndjson_line(obj: Any) -> str:
    return dumps(obj) + "\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events. Starlette's StreamingResponse listens for the client's disconnect and
    cancels ``events``; its ``finally`` cancels the generation."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def ndjson_response(lines: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(lines, media_type="application/x-ndjson")


class ClientGone(Exception):
    """The client disconnected before its reply was ready."""


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work()`` (the body already read) while listening for ``http.disconnect``; a disconnect
    cancels ``work`` (whose ``finally`` cancels its generation) and raises :class:`ClientGone`."""
    result: list[T] = []
    gone = False

    async with anyio.create_task_group() as tg:
        async def run() -> None:
            result.append(await work())
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
    if gone and not result:
        raise ClientGone()
    return result[0]
