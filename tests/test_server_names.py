"""Model names through the server's API: a request names a stored model, the default model or a Hub
repo; a path on the server's disk only with ``allow_local_paths`` or inside ``models_dir``. Every
refusal is a 4xx in the route's API shape, is decided before the disk is touched, and reads the same
whether or not a file of that name exists. Tiny random-weight models, real HTTP on loopback."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localllm.server.config import ServerConfig
from tests.server_fixtures import ServerThread, running_server

CHAT = [{"role": "user", "content": "hi"}]


def requests_naming(name: str) -> list[tuple[str, str, dict[str, object]]]:
    """(method, path, body) of every route that takes a model name."""
    return [
        ("POST", "/v1/chat/completions", {"model": name, "messages": CHAT, "max_tokens": 2}),
        ("POST", "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2}),
        ("POST", "/v1/embeddings", {"model": name, "input": "hi"}),
        ("POST", "/api/generate", {"model": name, "prompt": "hi", "stream": False}),
        ("POST", "/api/generate", {"model": name}),  # load only
        ("POST", "/api/chat", {"model": name, "messages": CHAT, "stream": False}),
        ("POST", "/api/chat", {"model": name, "messages": [], "keep_alive": 0}),  # unload only
        ("POST", "/api/embed", {"model": name, "input": "hi"}),
        ("POST", "/api/embeddings", {"model": name, "prompt": "hi"}),
        ("POST", "/api/show", {"model": name}),
        ("POST", "/api/pull", {"model": name, "stream": False}),
        ("DELETE", "/api/delete", {"model": name}),
    ]


def error_of(r: httpx.Response, path: str) -> str:
    """The error message, checked to be in the route's API shape."""
    body = r.json()
    if path.startswith("/v1/"):
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
        return str(body["error"]["message"])
    assert isinstance(body["error"], str), body
    return body["error"]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("names-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(folder))
        yield folder


@pytest.fixture(scope="module")
def server(home: Path) -> Iterator[ServerThread]:
    with running_server(ServerConfig(parallel=1, queue=2, kv_memory=2 << 20, device="cpu")) as srv:
        yield srv


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def stored_models(home: Path) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir() if not p.name.startswith(".")) if models.is_dir() else []


def test_paths_are_refused_alike_whether_they_exist_or_not(http: httpx.Client, tiny_folder, tmp_path: Path,
                                                          home: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x")
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    folder = str(tiny_folder("llama")[1])
    # each existing path beside one of the same shape that does not exist
    pairs = [(str(secret), str(tmp_path / "nothing")), (str(tmp_path / "weights.gguf"), str(tmp_path / "none.gguf")),
             (folder, folder + "-none"), ("~root/", "~nosuchuser/"), ("..", "../nothing-here"),
             ("tests/../README.md", "tests/../NOTHING.md"), ("./README.md", "./NOTHING.md")]
    for there, missing in pairs:
        for (method, path, body), (_, _, body2) in zip(requests_naming(there), requests_naming(missing)):
            r = http.request(method, path, json=body)
            r2 = http.request(method, path, json=body2)
            assert r.status_code == 400 and r2.status_code == 400, (path, there, r.text, r2.text)
            said, said2 = error_of(r, path), error_of(r2, path)
            same = said.replace(f"'{there}'", "NAME", 1) == said2.replace(f"'{missing}'", "NAME", 1)
            assert same, (path, said, said2)
            assert "not a model this server serves" in said or "Hub repo id" in said, said
    assert stored_models(home) == []  # /api/pull copied nothing into the store


@pytest.mark.parametrize("name, says", [("a" * 300, "300 characters long"), ("tiny\x00x", "U+0000"),
                                        ("tiny\nx", "U+000A"), ("tiny\x7f", "U+007F")])
def test_long_names_and_control_characters_are_400s(http: httpx.Client, name: str, says: str) -> None:
    for method, path, body in requests_naming(name):
        r = http.request(method, path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert says in error_of(r, path), (path, r.text)


def test_a_refused_name_touches_no_disk(http: httpx.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big folder named by a request is never stat'ed nor walked (the server runs in this process)."""
    sentinel = tmp_path / "big"
    (sentinel / "sub").mkdir(parents=True)
    for i in range(50):
        (sentinel / "sub" / f"f{i}").write_bytes(b"x")
    touched: list[str] = []

    def watch(fn):  # type: ignore[no-untyped-def]
        def wrapper(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(path).startswith(str(sentinel)):
                touched.append(f"{fn.__name__}({path})")
            return fn(path, *args, **kwargs)
        return wrapper

    for name in ("stat", "lstat", "scandir", "listdir"):
        monkeypatch.setattr(os, name, watch(getattr(os, name)))
    monkeypatch.setattr(os, "walk", watch(os.walk))
    for method, path, body in requests_naming(str(sentinel)):
        assert http.request(method, path, json=body).status_code == 400, path
    assert touched == []


def test_a_local_folder_loads_with_allow_local_paths(home: Path, tiny_folder) -> None:
    folder = str(tiny_folder("llama")[1])
    with running_server(ServerConfig(kv_memory=2 << 20, device="cpu", allow_local_paths=True)) as srv:
        r = httpx.post(f"{srv.url}/api/generate", json={"model": folder, "prompt": "hi", "stream": False,
                                                        "options": {"num_predict": 2}}, timeout=120)
        assert r.status_code == 200 and r.json()["done"], r.text
        r = httpx.post(f"{srv.url}/api/show", json={"model": folder}, timeout=60)
        assert r.status_code == 200 and r.json()["details"]["family"] == "llama", r.text
        # still no '~' expansion (the home folder exists), no '..'
        for name, says in (("~/", "'~' is not expanded"), (folder + "/../" + Path(folder).name, "no '..' part")):
            r = httpx.post(f"{srv.url}/api/generate", json={"model": name}, timeout=60)
            assert r.status_code == 400 and says in r.json()["error"], r.text


def test_models_dir_serves_its_models_by_relative_name_only(home: Path, tiny_folder, tmp_path: Path) -> None:
    outside = tiny_folder("llama")[1]
    models = tmp_path / "models"
    shutil.copytree(outside, models / "tiny")
    (models / "escape").symlink_to(outside, target_is_directory=True)
    (tmp_path / "beside").mkdir()
    with running_server(ServerConfig(kv_memory=2 << 20, device="cpu", models_dir=models)) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        refused = {}
        for name in ("escape", "nothing", "escape/config.json", "nothing/config.json", "../beside", "../nothing",
                     str(models / "tiny"), "tiny/../tiny"):
            r = httpx.post(f"{srv.url}/api/generate", json={"model": name}, timeout=60)
            assert r.status_code in (400, 404), (name, r.text)
            refused[name] = (r.status_code, r.json()["error"].replace(f"'{name}'", "NAME"))
        # a link out of the folder reads as a name that is not there
        assert refused["escape"] == refused["nothing"] and refused["../beside"] == refused["../nothing"]
        assert refused["escape/config.json"] == refused["nothing/config.json"]
        # /api/pull stores a model of the folder, and nothing from outside it
        r = httpx.post(f"{srv.url}/api/pull", json={"model": "escape", "stream": False}, timeout=60)
        assert r.status_code == 400 and stored_models(home) == [], r.text


def test_names_are_checked_before_the_load_even_for_a_fast_answer(http: httpx.Client) -> None:
    """The root folder as a model name is answered at once (it was walked whole before)."""
    t0 = time.perf_counter()
    r = http.post("/api/generate", json={"model": "/", "prompt": "hi", "stream": False})
    assert r.status_code == 400 and time.perf_counter() - t0 < 5, r.text
