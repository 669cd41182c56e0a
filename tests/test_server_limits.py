"""What no client can hold or exhaust, through real sockets on 127.0.0.1: request heads past the
header limit (431, the connection closed before the rest is read), idle keep-alive connections and
heads that never finish (closed after their shortened timeouts); embeddings whose client left stop
between batches; streams opened and dropped leave the queue at once; and at shutdown each cut stream
ends with an error in its API's shape and the server stops within its grace period."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from localllm.server.config import ServerConfig
from tests.server_fixtures import ServerThread, running_server

HEADER_LIMIT = 4096
IDLE_S = 0.5
HEAD_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """No model: the limits hold before any route runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("limits-home")))
        config = ServerConfig(device="cpu", max_header_bytes=HEADER_LIMIT, idle_timeout_s=IDLE_S,
                              header_timeout_s=HEAD_S)
        with running_server(config) as srv:
            yield srv


def connect(server: ServerThread, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.config.port), timeout=timeout)


def head(server: ServerThread, method: str = "GET", path: str = "/", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.config.port}\r\n{extra}\r\n".encode()


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a reset ends it too)."""
    out = b""
    try:
        while more := sock.recv(65536):
            out += more
    except ConnectionResetError:
        pass
    return out


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"the connection closed mid-answer: {data!r}"
        data += more
    top, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in top.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return top


# --------------------------------------------------------------------------- request heads
def test_a_head_past_the_limit_gets_431_and_the_connection_closes(server: ServerThread) -> None:
    pad = "".join(f"X-Pad-{i}: {'a' * 60}\r\n" for i in range(HEADER_LIMIT // 70 + 2))
    with connect(server) as sock:
        sock.sendall(head(server, extra=pad))
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert f"over {HEADER_LIMIT} bytes".encode() in answer
    # just within the limit, and a body far larger than it: both answered by the app
    fits = "".join(f"X-Pad-{i}: {'a' * 60}\r\n" for i in range(HEADER_LIMIT // 70 - 3))
    with connect(server) as sock:
        sock.sendall(head(server, extra=fits))
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
    body = json.dumps({"model": "nothing-here", "pad": "x" * (20 * HEADER_LIMIT)})
    r = httpx.post(server.url + "/api/show", content=body, headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code in (400, 404), r.text


def test_a_megabyte_of_headers_is_refused_quickly_not_read(server: ServerThread) -> None:
    line = b"X-Pad: " + b"a" * 1017 + b"\r\n"
    started = time.monotonic()
    with connect(server) as sock:
        sent = 0
        try:
            sock.sendall(head(server)[:-2])
            for _ in range(1024):
                sock.sendall(line)
                sent += len(line)
            sock.sendall(b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the connection while the client was still sending
        answer = read_all(sock)
    assert not answer or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert time.monotonic() - started < 5


# --------------------------------------------------------------------------- timeouts
def test_an_idle_keep_alive_connection_is_closed(server: ServerThread) -> None:
    with connect(server) as sock:
        sock.sendall(head(server))
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        t0 = time.monotonic()
        assert read_all(sock) == b""  # the server closed it
        assert IDLE_S * 0.8 <= time.monotonic() - t0 < IDLE_S + 2


def test_a_head_that_never_finishes_is_cut_off(server: ServerThread) -> None:
    with connect(server) as sock:
        t0 = time.monotonic()
        sock.sendall(head(server)[:-2])  # the headers' blank line never comes
        answer = read_all(sock)
        assert HEAD_S * 0.8 <= time.monotonic() - t0 < HEAD_S + 2
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    with connect(server) as sock:  # nothing sent at all
        t0 = time.monotonic()
        assert read_all(sock) == b""
        assert time.monotonic() - t0 < HEAD_S + 2
    with connect(server) as sock:  # a second request on a connection, started and never finished
        sock.sendall(head(server))
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        t0 = time.monotonic()
        sock.sendall(b"GET / HTTP/1.1\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - t0 < HEAD_S + 2
