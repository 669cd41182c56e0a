"""Helpers for the server tests: ``localllm serve``'s app under uvicorn on a free loopback port, in a
thread of the test process (so that a test can look at the engines), and small HTTP helpers."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from localllm.server.app import create_app, run_serving
from localllm.server.config import ServerConfig
from localllm.server.limits import uvicorn_config
from localllm.server.models import ModelManager


class ServerThread:
    """uvicorn serving :func:`create_app` on 127.0.0.1 in a daemon thread; :meth:`stop` shuts it down
    as SIGTERM would (graceful, then the lifespan's shutdown)."""

    def __init__(self, config: ServerConfig) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        self.sock = sock
        config.host, config.port = "127.0.0.1", sock.getsockname()[1]
        self.config = config
        self.app = create_app(config)
        config.graceful_s = min(config.graceful_s, 2.0)  # tests stop fast; a test may ask for less
        self.server = uvicorn.Server(uvicorn_config(self.app, config))  # the limits `localllm serve` runs with
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    def _run(self) -> None:
        run_serving(self._serve())  # on the loop `localllm serve` runs (uvloop where installed)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self.sock])

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def manager(self) -> ModelManager:
        return self.app.state.server.manager  # type: ignore[no-any-return]


@contextmanager
def running_server(config: ServerConfig) -> Iterator[ServerThread]:
    server = ServerThread(config).start()
    try:
        yield server
    finally:
        server.stop()


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "the condition") -> Any:
    """Poll ``predicate`` until it is truthy (returned), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss
