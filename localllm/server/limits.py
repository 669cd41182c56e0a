"""Connection limits, and the one uvicorn ``Config`` the server runs under (``localllm serve`` and the
tests' server alike).

uvicorn's own settings carry what they can: the idle keep-alive timeout (``timeout_keep_alive``) and
the grace at shutdown. Its httptools protocol, the one it picks, bounds neither the request head nor
the time a client takes to send it (``h11_max_incomplete_event_size`` is h11's only), so
:class:`LimitedHttpToolsProtocol` adds both:

- a request head (request line and headers) past ``ServerConfig.max_header_bytes`` is answered 431
  and the connection closed, before the parser has read the rest; the number of headers is bounded
  through the same bytes (each takes at least four);
- a connection that has not sent a whole head within ``ServerConfig.header_timeout_s`` of opening,
  or of its next request's first byte, is closed (with a 408 where part of a head came).

The head is measured up to the first blank line of what arrives while a head is being read; requests
pipelined behind another in one read are bounded by that read's size.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from localllm.server.config import ServerConfig

#: The end of a request head: a blank line (llhttp takes a bare LF as a line's end too).
_HEAD_END = re.compile(rb"\r?\n\r?\n")


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on the request head's bytes and on the time a client
    takes to send it (see the module's docstring). One instance per connection; uvicorn makes it with
    its ``Config``, which :func:`uvicorn_config` extends with the two limits."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.max_head_bytes: int = config.max_header_bytes  # type: ignore[attr-defined]
        self.head_timeout_s: float = config.header_timeout_s  # type: ignore[attr-defined]
        #: Bytes of the request head being read; None while a request's body or answer is under way.
        self.head_bytes: int | None = 0
        self.head_tail = b""  # the last bytes read of a head: its blank line may straddle two reads
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self.head_bytes is not None:
            if self.head_timer is None:  # the first byte of a request after an idle keep-alive
                self._start_head_timer()
            seen = self.head_tail + data
            end = _HEAD_END.search(seen)
            size = self.head_bytes + (len(data) if end is None else end.end() - len(self.head_tail))
            if size > self.max_head_bytes:
                self._refuse(431, f"the request's headers are over {self.max_head_bytes} bytes")
                return
            self.head_bytes = size
            self.head_tail = seen[-3:]
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._stop_head_timer()
        self.head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.head_bytes, self.head_tail = 0, b""  # a next request's head may follow

    # ------------------------------------------------------------------ internals
    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.head_bytes is None or self.transport.is_closing():
            return
        if self.head_bytes or self.head_tail:
            self._refuse(408, f"the request's headers did not arrive within {self.head_timeout_s:g} s")
        else:  # a connection that never sent anything (or nothing since its last answer)
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with ``message`` and close the connection, reading nothing more."""
        self._stop_head_timer()
        self.head_bytes = None
        self.logger.warning("refused a connection from %s: %s", "%s:%d" % self.client if self.client else "?",
                            message)
        body = message.encode()
        head = [f"HTTP/1.1 {status} {'Request Header Fields Too Large' if status == 431 else 'Request Timeout'}",
                "content-type: text/plain; charset=utf-8", f"content-length: {len(body)}", "connection: close"]
        self.transport.write("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        self.transport.close()


def uvicorn_config(app: ASGIApp, config: ServerConfig) -> uvicorn.Config:
    """The uvicorn settings ``app`` is served with: ``config``'s connection limits and grace at
    shutdown, warnings only, no access log, the lifespan on."""
    settings = uvicorn.Config(app, http=LimitedHttpToolsProtocol, log_level="warning", access_log=False,
                              lifespan="on", timeout_keep_alive=config.idle_timeout_s,  # type: ignore[arg-type]
                              timeout_graceful_shutdown=config.graceful_s)  # type: ignore[arg-type]
    settings.max_header_bytes = config.max_header_bytes  # type: ignore[attr-defined]
    settings.header_timeout_s = config.header_timeout_s  # type: ignore[attr-defined]
    return settings
