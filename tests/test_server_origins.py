"""What a web page may make the server do: requests addressed by a foreign name (DNS rebinding), from a
foreign browser origin (cross-site) or with a non-JSON body on a store route are refused in the API's
error shape before any route runs; loopback pages and the origins allowed get CORS answers. Real HTTP
on loopback, no model loaded."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from localllm.server.config import ServerConfig
from localllm.server.origins import host_allowed, origin_allowed
from tests.server_fixtures import ServerThread, running_server

EVIL = "rebind.evil.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("origins-home")))
        config = ServerConfig(device="cpu", api_key="k", allowed_hosts=("my.lan",),
                              allowed_origins=("https://app.example",))
        with running_server(config) as srv:
            yield srv


def call(server: ServerThread, method: str, path: str, **headers: str) -> httpx.Response:
    body = headers.pop("body", None)
    return httpx.request(method, server.url + path, content=body, timeout=30,
                         headers={"Authorization": "Bearer k", **{k.replace("_", "-"): v for k, v in headers.items()}})


def test_a_rebinding_host_is_refused_in_each_apis_shape(server: ServerThread) -> None:
    port = server.config.port
    r = call(server, "DELETE", "/api/delete", Host=f"{EVIL}:{port}", Content_Type="application/json",
             body=b'{"model": "smollm2"}')
    assert r.status_code == 403 and "--allowed-hosts rebind.evil.example" in r.json()["error"]
    r = call(server, "GET", "/v1/models", Host=EVIL)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "my.lan", "[::1]:80", "ui.localhost",
                 f"{socket.gethostname()}:{port}"):
        assert call(server, "GET", "/v1/models", Host=host).status_code == 200, host


def test_a_foreign_origin_is_refused_and_an_allowed_one_gets_cors(server: ServerThread) -> None:
    r = call(server, "POST", "/api/pull", Origin="http://evil.example", Content_Type="application/json",
             body=b'{"model": "org/repo"}')
    assert r.status_code == 403 and "--allowed-origins http://evil.example" in r.json()["error"]
    r = call(server, "POST", "/v1/chat/completions", Origin="http://evil.example", Content_Type="application/json",
             body=b"{}")
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "https://app.example"):
        r = call(server, "GET", "/api/tags", Origin=origin)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
    # a browser's preflight: answered without the API key, for allowed origins only
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = httpx.options(server.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"},
                      timeout=30)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_store_routes_take_only_json(server: ServerThread) -> None:
    for path, method in (("/api/pull", "POST"), ("/api/delete", "DELETE")):
        for content_type in ("text/plain", "application/x-www-form-urlencoded"):
            r = call(server, method, path, Content_Type=content_type, body=b'{"model": "org/repo"}')
            assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"], (path, content_type)
    r = call(server, "DELETE", "/api/delete", Content_Type="application/json; charset=utf-8",
             body=b'{"model": "nothing-here"}')
    assert r.status_code == 404  # through the guard to the route


def test_host_and_origin_rules_hold_at_their_edges() -> None:
    assert host_allowed("10.0.0.5:11435", "127.0.0.1", ())  # an address is never a rebinding name
    assert host_allowed("[fe80::1]:80", "127.0.0.1", ())
    assert host_allowed("myhost:11435", "myhost", ())  # the name it was bound to
    for bad in ("localhost.evil.example", "127.0.0.1.evil.example", "evil.example:80:1", "evil.example"):
        assert not host_allowed(bad, "127.0.0.1", ()), bad
    assert host_allowed("anything.example", "127.0.0.1", ("*",))
    assert origin_allowed("http://[::1]:5173", ()) and origin_allowed("https://localhost", ())
    for bad in ("null", "http://localhost.evil.example", "http://127.0.0.1.evil.example", "file://", "http://evil.example"):
        assert not origin_allowed(bad, ()), bad
    assert origin_allowed("https://app.example/", ("https://app.example",)) and origin_allowed("null", ("*",))
