"""Clients that leave at any moment, through real HTTP on 127.0.0.1: while their model loads, before
the first chunk, at the role chunk, mid-stream, during a non-streaming reply; and a generation that
fails right after it was queued. Each must leave nothing behind: no sequence in the engine, no KV
block, no ``--parallel`` slot, no pump thread, and no hold on the model (a ``keep_alive: 0`` model
unloads). Requests waiting for a cold load count against the queue limit; the text queue between
the engine and a slow client is bounded.

A tiny random-weight Llama (milliseconds to load) served in this process, its steps slowed to
:data:`STEP_S` and its stop ids cleared, so that a stream lasts as long as its ``max_tokens`` says.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import anyio
import httpx
import pytest

from localllm.loaders import load
from localllm.server import models as server_models
from localllm.server.config import ServerConfig
from localllm.server.generation import Generation
from localllm.server.streaming import ClosingStream
from tests.server_fixtures import ServerThread, running_server, wait_for

PARALLEL = 2
QUEUE = 2
STEP_S = 0.03
#: How long a cancelled request may take to be retired; an uncancelled one runs 200 steps (6 s).
RETIRED_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("serve-home")))
        config = ServerConfig(parallel=PARALLEL, queue=QUEUE, kv_memory=2 << 20, device="cpu", keep_alive_s=300,
                              allow_local_paths=True)
        with running_server(config) as srv:
            yield srv


def slowed(server: ServerThread, name: str) -> None:
    """Stop ids cleared and every step slowed to STEP_S, on the loaded model ``name``."""
    slot = server.manager.slots[name]
    slot.stop_ids = []
    engine = slot.engine
    if getattr(engine, "_test_slowed", False):
        return
    run = engine.runner.forward

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(STEP_S)
        return run(*args, **kwargs)

    engine.runner.forward = slow  # type: ignore[method-assign]
    engine._test_slowed = True  # type: ignore[attr-defined]


@pytest.fixture
def model(server: ServerThread, tiny_folder) -> str:
    """The tiny Llama, loaded (again, if a test unloaded it) and slowed."""
    name = str(tiny_folder("llama")[1])
    r = httpx.post(f"{server.url}/api/generate", json={"model": name}, timeout=60)
    assert r.status_code == 200, r.text
    slowed(server, name)
    wait_for(lambda: settled(server, name), what="a settled server")
    return name


def pumps() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("localllm-req-")]


def settled(server: ServerThread, name: str) -> bool:
    """Nothing of any request left: no hold, no generation, no sequence, no block, no pump thread."""
    slot = server.manager.slots.get(name)
    if slot is not None:
        u = slot.engine.usage()
        if slot.active or slot.generations or u["running"] or u["waiting"] or u["blocks_used"]:
            return False
    return not pumps() and not server.manager._load_waiters


def usage(server: ServerThread, name: str) -> dict[str, int]:
    return server.manager.slots[name].engine.usage()


def requests(server: ServerThread, route: str, status: int) -> int:
    return server.app.state.server.metrics.requests[(route, status)]


def raw_post(url: str, path: str, body: dict[str, object]) -> socket.socket:
    """A request sent on a socket of its own, which the test closes whenever it likes."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def status_of(sock: socket.socket) -> int:
    head = b""
    while b"\r\n" not in head:
        more = sock.recv(4096)
        assert more, "the server closed the connection without an answer"
        head += more
    return int(head.split(b" ", 2)[1])


def open_stream(url: str, path: str, body: dict[str, object]) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=30)
    response = client.send(client.build_request("POST", url + path, json=body), stream=True)
    assert response.status_code == 200
    return client, response


def long_stream(url: str, name: str) -> tuple[httpx.Client, httpx.Response]:
    return open_stream(url, "/api/generate", {"model": name, "prompt": "hi", "raw": True,
                                              "options": {"num_predict": 200, "temperature": 0}})


def close(*streams: tuple[httpx.Client, httpx.Response]) -> None:
    for client, response in streams:
        response.close()
        client.close()


# --------------------------------------------------------------------------- the moments a client can leave
def test_client_gone_while_its_model_loads_and_load_waiters_count_against_the_queue(
        server: ServerThread, tiny_folder, monkeypatch: pytest.MonkeyPatch) -> None:
    name = str(tiny_folder("qwen2")[1])
    gate = threading.Event()
    real = load.load_model

    def gated(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert gate.wait(30), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(load, "load_model", gated)
    body = {"model": name, "prompt": "hi", "options": {"num_predict": 3}}
    gone = raw_post(server.url, "/api/generate", body)
    wait_for(lambda: server.manager._load_waiters.get(name) == 1, what="the request to wait for the load")
    closed_before = requests(server, "/api/generate", 499)
    gone.close()
    wait_for(lambda: not server.manager._load_waiters, what="the gone client to stop waiting")
    assert requests(server, "/api/generate", 499) == closed_before + 1

    # parallel + queue requests may wait for a cold load; the next one is told the server is busy.
    waiting = [raw_post(server.url, "/api/generate", {**body, "stream": False}) for _ in range(PARALLEL + QUEUE)]
    try:
        wait_for(lambda: server.manager._load_waiters.get(name) == PARALLEL + QUEUE, what="a full load queue")
        r = httpx.post(f"{server.url}/api/generate", json=body, timeout=30)
        assert r.status_code == 503 and "waiting for the model to load" in r.json()["error"], r.text
        assert int(r.headers["Retry-After"]) >= 1
        gate.set()
        assert [status_of(s) for s in waiting] == [200] * (PARALLEL + QUEUE)
    finally:
        gate.set()
        for s in waiting:
            s.close()
    engine = server.manager.slots[name].engine
    assert engine._next_id == PARALLEL + QUEUE  # the client that left never queued a sequence
    # The thread that loaded the model has ended: alive, it would keep an OpenMP team that slows the
    # engine thread's parallel ops (models.in_own_thread).
    assert not [t for t in threading.enumerate() if t.name.startswith("localllm-load-")]
    wait_for(lambda: settled(server, name), what="a settled server")


def test_client_gone_before_the_first_chunk(server: ServerThread, model: str) -> None:
    busy = [long_stream(server.url, model) for _ in range(PARALLEL)]
    try:
        wait_for(lambda: usage(server, model)["running"] == PARALLEL, what="a full batch")
        queued = open_stream(server.url, "/api/chat", {"model": model, "messages": [{"role": "user", "content": "x"}]})
        wait_for(lambda: usage(server, model)["waiting"] == 1, what="the queued request")
        close(queued)  # headers came, no chunk yet: its request is still waiting for a slot
        wait_for(lambda: usage(server, model)["waiting"] == 0 and server.manager.slots[model].active == PARALLEL,
                 timeout=RETIRED_S, what="the queued request to be retired and its hold released")
        assert usage(server, model)["running"] == PARALLEL  # the others go on
    finally:
        close(*busy)
    wait_for(lambda: settled(server, model), what="a settled server")


def test_client_gone_at_the_role_chunk(server: ServerThread, model: str) -> None:
    busy = [long_stream(server.url, model) for _ in range(PARALLEL)]
    try:
        wait_for(lambda: usage(server, model)["running"] == PARALLEL, what="a full batch")
        client, response = open_stream(server.url, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 200})
        first = next(response.iter_lines())
        assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        close((client, response))
        wait_for(lambda: usage(server, model)["waiting"] == 0 and server.manager.slots[model].active == PARALLEL,
                 timeout=RETIRED_S, what="the request to be retired and its hold released")
    finally:
        close(*busy)
    wait_for(lambda: settled(server, model), what="a settled server")


def test_client_gone_mid_stream_releases_the_model_so_keep_alive_zero_unloads_it(
        server: ServerThread, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dropped_on: list[str] = []
    real = server_models.release_freed_memory
    monkeypatch.setattr(server_models, "release_freed_memory",
                        lambda: (dropped_on.append(threading.current_thread().name), real())[1])
    client, response = open_stream(server.url, "/api/generate", {
        "model": model, "prompt": "hi", "keep_alive": 0, "options": {"num_predict": 200}})
    lines = response.iter_lines()
    for _ in range(3):
        assert json.loads(next(lines))["done"] is False
    assert usage(server, model)["blocks_used"] > 0
    close((client, response))
    wait_for(lambda: model not in server.manager.slots, timeout=RETIRED_S, what="the model to be unloaded")
    wait_for(lambda: settled(server, model), what="a settled server")
    # Unloading and collecting the freed memory ran on a worker thread, not on the event loop's.
    wait_for(lambda: dropped_on, what="the unload to finish")
    assert "test-server" not in dropped_on


def test_client_gone_during_a_non_streaming_reply(server: ServerThread, model: str) -> None:
    before = requests(server, "/v1/completions", 499)
    sock = raw_post(server.url, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 200})
    wait_for(lambda: usage(server, model)["running"] == 1, what="the reply to be generating")
    sock.close()
    wait_for(lambda: settled(server, model), timeout=RETIRED_S, what="the gone client's sequence to be retired")
    wait_for(lambda: requests(server, "/v1/completions", 499) == before + 1, what="the 499 to be counted")


def test_a_generation_that_fails_after_it_was_queued_leaves_nothing(server: ServerThread, model: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no pump thread today")

    monkeypatch.setattr(server_models, "Generation", broken)
    engine = server.manager.slots[model].engine
    computed = engine.tokens_computed
    r = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 200}, timeout=30)
    assert r.status_code == 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    wait_for(lambda: settled(server, model), timeout=RETIRED_S, what="the queued sequence to be retired")
    assert engine.tokens_computed - computed < 20  # retired at once, not run to its 200 tokens


def test_a_stream_whose_send_hangs_is_closed_when_the_client_leaves() -> None:
    """The race behind the old leak, made certain: the client leaves while a chunk is being sent (the
    body generator suspended at its ``yield``). The body is closed and ``on_close`` runs before the
    response returns, not whenever the garbage collector finds the generator."""
    events: list[str] = []

    async def body():  # type: ignore[no-untyped-def]
        try:
            yield "role chunk"
            yield "never sent"
        finally:
            events.append("body closed")

    async def main() -> None:
        sent = anyio.Event()

        async def send(message: dict[str, object]) -> None:
            if message["type"] == "http.response.body":
                sent.set()
                await anyio.sleep_forever()  # the socket's buffer is full

        async def receive() -> dict[str, object]:
            await sent.wait()
            return {"type": "http.disconnect"}

        response = ClosingStream(body(), "text/event-stream", on_close=lambda: events.append("on_close"))
        with anyio.fail_after(5):
            await response({"type": "http"}, receive, send)
        events.append("returned")

    asyncio.run(main())
    assert events == ["body closed", "on_close", "returned"]


def test_the_text_queue_to_a_slow_client_is_bounded(tiny_folder) -> None:
    """A client that does not read holds at most ``max_pending`` pieces; the engine still runs its
    sequence to the end (blocks freed); cancelling wakes a pump blocked on the full queue."""
    from localllm.runtime.batch import BatchEngine
    from localllm.runtime.sampling import SamplingParams

    lm = load.load_model(str(tiny_folder("llama")[1]), device="cpu")
    engine = BatchEngine(lm.model, kv_budget_bytes=1 << 20, max_running=2)
    engine.start()

    async def until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
        with anyio.fail_after(10):  # the event loop runs meanwhile: the pump's pieces arrive
            while not predicate():
                await asyncio.sleep(0.01)

    async def main() -> None:
        params = SamplingParams(temperature=0)
        slow = Generation(engine.submit([1, 70, 80], params, max_tokens=40), lm.tokenizer, [], max_pending=4)
        await until(lambda: slow.handle.stats.finish_reason is not None, "the engine to finish the sequence")
        await asyncio.sleep(0.2)  # the pump has had time to hand over all it could
        assert slow.pending == 4  # blocked on the bound: not 40 pieces
        assert engine.usage()["blocks_used"] == 0  # finished in the engine although not read
        text = await slow.text()
        assert slow.outcome is not None and slow.outcome.completion_tokens == 40 and len(text) > 0

        stuck = Generation(engine.submit([1, 70, 81], params, max_tokens=40), lm.tokenizer, [], max_pending=2)
        await until(lambda: stuck.pending == 2, "the pump to fill the queue")
        stuck.cancel()
        stuck._thread.join(timeout=5)
        assert not stuck._thread.is_alive()

    try:
        asyncio.run(main())
    finally:
        engine.stop()
