"""What no client can hold or exhaust, through real sockets on 127.0.0.1: request heads past the
header limit (431, the connection closed before the rest is read), idle keep-alive connections and
heads that never finish (closed after their shortened timeouts); embeddings whose client left stop
between batches; streams opened and dropped leave the queue at once; and at shutdown each cut stream
ends with an error in its API's shape and the server stops within its grace period."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from localllm.server import ollama_routes
from localllm.server.config import ServerConfig
from localllm.server.streaming import SSE_DONE
from tests.server_fixtures import ServerThread, running_server, wait_for

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


# --------------------------------------------------------------------------- a model's work
STEP_S = 0.3  # a slowed engine step: what a request still queued would wait to be retired


@pytest.fixture(scope="module")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """One slot and one queued request per model: a single stale entry in the queue means a 503."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("limits-model-home")))
        config = ServerConfig(device="cpu", parallel=1, queue=1, kv_memory=2 << 20, allow_local_paths=True)
        with running_server(config) as srv:
            yield srv


def loaded(server: ServerThread, name: str, step_s: float = STEP_S) -> Any:
    """The model ``name`` loaded on ``server``, its stop ids cleared and each step slowed to ``step_s``;
    its slot."""
    r = httpx.post(f"{server.url}/api/generate", json={"model": name}, timeout=60)
    assert r.status_code == 200, r.text
    slot = server.manager.slots[name]
    slot.stop_ids = []
    forward = slot.engine.runner.forward

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(step_s)
        return forward(*args, **kwargs)

    slot.engine.runner.forward = slow
    return slot


def open_stream(server: ServerThread, path: str, body: dict[str, Any]) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=30)
    response = client.send(client.build_request("POST", server.url + path, json=body), stream=True)
    return client, response


def generate_stream(server: ServerThread, name: str) -> tuple[httpx.Client, httpx.Response]:
    return open_stream(server, "/api/generate", {"model": name, "prompt": "hi", "raw": True,
                                                "options": {"num_predict": 200, "temperature": 0}})


def close(client: httpx.Client, response: httpx.Response) -> None:
    response.close()
    client.close()


def test_streams_dropped_while_queued_leave_the_queue_at_once(model_server: ServerThread, tiny_folder) -> None:
    name = str(tiny_folder("llama")[1])
    slot = loaded(model_server, name)
    live = generate_stream(model_server, name)
    try:
        assert live[1].status_code == 200
        wait_for(lambda: slot.engine.usage()["running"] == 1, what="the live stream to run")
        for _ in range(3):
            dropped = generate_stream(model_server, name)
            assert dropped[1].status_code == 200
            wait_for(lambda: slot.engine.usage()["waiting"] == 1, what="the stream to queue")
            close(*dropped)
            wait_for(lambda: slot.active == 1, what="the server to see the client leave")
            nxt = generate_stream(model_server, name)  # well within the running step
            try:
                assert nxt[1].status_code == 200, nxt[1].read()
            finally:
                close(*nxt)
            wait_for(lambda: slot.active == 1 and slot.engine.usage()["waiting"] == 0, what="a settled queue")
    finally:
        close(*live)


def raw_post(server: ServerThread, path: str, body: dict[str, Any]) -> socket.socket:
    """A request on a socket of its own, which the test closes whenever it likes."""
    sock = connect(server, timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(head(server, "POST", path, f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n")
                 + data)
    return sock


def counting_batches(slot: Any, batch_s: float) -> list[float]:
    """Each embedding batch's forward of ``slot``'s model slowed to ``batch_s``; the times they started."""
    model = slot.engine.model
    hidden = model.hidden
    started: list[float] = []

    def slow(tokens: Any) -> Any:
        started.append(time.monotonic())
        time.sleep(batch_s)
        return hidden(tokens)

    model.hidden = slow
    return started


def test_an_embedding_whose_client_left_stops_between_batches(model_server: ServerThread, tiny_folder) -> None:
    name = str(tiny_folder("llama")[1])
    slot = loaded(model_server, name, step_s=0)
    batches = counting_batches(slot, 0.2)
    try:
        gone = raw_post(model_server, "/v1/embeddings", {"model": name, "input": [[5] * 200] * 200})  # 10 batches
        wait_for(lambda: batches, what="the first batch")
        gone.close()
        left_at = time.monotonic()
        time.sleep(1.5)  # the time of several batches
        assert len([t for t in batches if t > left_at]) <= 1, f"{len(batches)} batches ran"
        t0 = time.monotonic()
        r = httpx.post(f"{model_server.url}/api/embed", json={"model": name, "input": "hello"}, timeout=30)
        assert r.status_code == 200 and len(r.json()["embeddings"]) == 1
        assert time.monotonic() - t0 < 1.5
        metrics = model_server.app.state.server.metrics
        wait_for(lambda: metrics.requests[("/v1/embeddings", 499)] == 1, what="the request counted as gone")
        wait_for(lambda: slot.active == 0, what="the embedding's hold released")
    finally:
        del slot.engine.model.hidden


# --------------------------------------------------------------------------- shutdown
GRACE_S = 0.5


def uvicorn_errors() -> list[logging.LogRecord]:
    """Records uvicorn's error logger gets from now on (it does not propagate to the root)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("uvicorn.error").addHandler(Keep())
    return records


def test_streams_cut_at_shutdown_end_with_an_error_in_their_apis_shape(tmp_path, monkeypatch, tiny_folder) -> None:
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    name = str(tiny_folder("llama")[1])
    config = ServerConfig(device="cpu", parallel=4, kv_memory=2 << 20, allow_local_paths=True, graceful_s=GRACE_S)
    server = ServerThread(config).start()
    records = uvicorn_errors()
    try:
        loaded(server, name, step_s=0.05)
        chat = [{"role": "user", "content": "hi"}]
        openai = open_stream(server, "/v1/chat/completions", {"model": name, "messages": chat, "stream": True,
                                                              "max_tokens": 200})
        ollama = open_stream(server, "/api/chat", {"model": name, "messages": chat, "options": {"num_predict": 200}})
        whole = raw_post(server, "/api/generate", {"model": name, "prompt": "hi", "stream": False,
                                                   "options": {"num_predict": 200}})
        openai_lines, ollama_lines = openai[1].iter_lines(), ollama[1].iter_lines()
        assert next(openai_lines).startswith("data: ") and json.loads(next(ollama_lines))["done"] is False
        t0 = time.monotonic()
        stopping = threading.Thread(target=server.stop)
        stopping.start()
        rest = [line for line in openai_lines if line]
        assert rest and rest[-1].startswith("data: ") and SSE_DONE.strip() not in rest
        error = json.loads(rest[-1].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
        last = json.loads([line for line in ollama_lines if line][-1])
        assert set(last) == {"error"} and "shutting down" in last["error"]
        status, _, body = read_all(whole).partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 503 ") and "shutting down" in json.loads(body)["error"], status
        stopping.join(timeout=30)
        assert time.monotonic() - t0 < GRACE_S + 2 and not server.thread.is_alive()
        for one in (openai, ollama):
            close(*one)
        whole.close()
    finally:
        server.stop()
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]


def test_shutdown_does_not_wait_for_work_stuck_in_a_worker_thread(tmp_path, monkeypatch, tiny_folder) -> None:
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    name = str(tiny_folder("llama")[1])
    config = ServerConfig(device="cpu", kv_memory=2 << 20, allow_local_paths=True, graceful_s=GRACE_S)
    server = ServerThread(config).start()
    release = threading.Event()
    try:
        slot = loaded(server, name, step_s=0)
        hidden = slot.engine.model.hidden
        slot.engine.model.hidden = lambda tokens: release.wait(30) and hidden(tokens)  # a batch that never ends
        real = ollama_routes.prepare_chat
        monkeypatch.setattr(ollama_routes, "prepare_chat", lambda *a: release.wait(30) and real(*a))  # a render
        embedding = raw_post(server, "/api/embed", {"model": name, "input": "hello"})
        chat = raw_post(server, "/api/chat", {"model": name, "messages": [{"role": "user", "content": "hi"}]})
        wait_for(lambda: slot.active == 2, what="both requests to start their work")
        t0 = time.monotonic()
        server.stop()
        assert time.monotonic() - t0 < GRACE_S + 3 and not server.thread.is_alive()
        assert read_all(embedding).startswith(b"HTTP/1.1 503 ")
        embedding.close()
        chat.close()
    finally:
        release.set()
        server.stop()
