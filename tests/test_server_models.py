"""``localllm serve``'s model lifecycle on tiny random-weight models (milliseconds to load): pulling
from the test Hub through the ``ollama`` client, list/show/ps/delete, keep-alive and unloading, one
load for concurrent first requests, the memory budget's LRU eviction; the API key and a clean
SIGTERM on a real ``localllm serve`` subprocess; the settings' parsers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localllm.commands.serve import exposure_warning
from localllm.errors import LocalLLMError
from localllm.paths import DEFAULT_MODEL, default_model_gguf
from localllm.server.config import ServerConfig, parse_duration, parse_size
from tests.hub_server import hub_env, running_hub
from tests.server_fixtures import ServerThread, running_server, wait_for

ROOT = Path(__file__).parents[1]
REPO = "tests/tiny-llama"
#: What /api/tags lists besides the store's entries: the embedded default model, where installed.
EMBEDDED = [DEFAULT_MODEL] if default_model_gguf() is not None else []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("serve-home")))
        config = ServerConfig(parallel=2, queue=4, kv_memory=2 << 20, device="cpu", keep_alive_s=60,
                              allow_local_paths=True)
        with running_server(config) as srv:
            yield srv


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def generate(http: httpx.Client, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "stream": False, "options": {"num_predict": 3, "seed": 0}, **extra}
    return http.post("/api/generate", json=body)


def loaded(http: httpx.Client) -> list[str]:
    return [m["name"] for m in http.get("/api/ps").json()["models"]]


def test_pull_list_show_generate_delete_with_the_ollama_client(server: ServerThread, tiny_folder,
                                                               tmp_path: Path) -> None:
    ollama = pytest.importorskip("ollama")
    _, folder = tiny_folder("llama")
    with running_hub() as hub, pytest.MonkeyPatch.context() as mp:
        hub.add_repo(REPO, folder)
        hub_env(mp, hub.url, tmp_path / "hf")
        client = ollama.Client(host=server.url)
        progress = list(client.pull(REPO, stream=True))
        assert progress[-1].status == "success" and len(progress) > 2, progress
        assert all(p.status for p in progress)
        assert client.pull(REPO).status == "success"  # already stored: kept
        with pytest.raises(ollama.ResponseError) as e:
            client.pull("tests/no-such-repo")
        assert e.value.status_code in (400, 404)
    names = [m.model for m in client.list().models]
    assert names == ["tiny-llama:int4", *EMBEDDED]
    listed = client.list().models[0]
    assert listed.size > 0 and listed.details.family == "llama" and listed.details.quantization_level == "INT4"
    shown = client.show("tiny-llama")
    assert shown.modelinfo["llama.block_count"] == 2 and shown.details.family == "llama"
    reply = client.generate(model="tiny-llama", prompt="hi", options={"num_predict": 4, "seed": 1})
    assert reply.done and reply.eval_count >= 1 and reply.load_duration > 0
    ps = client.ps().models
    assert "tiny-llama" in [m.model for m in ps]
    assert client.delete("tiny-llama").status == "success"
    assert [m.model for m in client.list().models] == EMBEDDED
    assert "tiny-llama" not in [m.model for m in client.ps().models]
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("tiny-llama")
    assert e.value.status_code == 404


def test_empty_prompt_loads_and_keep_alive_zero_unloads(http: httpx.Client, tiny_folder) -> None:
    model = str(tiny_folder("llama")[1])
    r = http.post("/api/generate", json={"model": model})
    assert r.status_code == 200 and r.json()["done_reason"] == "load" and model in loaded(http)
    r = http.post("/api/chat", json={"model": model, "messages": [], "keep_alive": 0})
    assert r.json()["done_reason"] == "unload" and model not in loaded(http)
    # A request with keep_alive 0 unloads the model once it is answered.
    assert generate(http, model, keep_alive=0).status_code == 200
    wait_for(lambda: model not in loaded(http), timeout=5, what="the unload")
    # A short keep-alive ("1s") shows in /api/ps and runs out.
    assert generate(http, model, keep_alive="1s").status_code == 200
    ps = http.get("/api/ps").json()["models"][0]
    assert ps["name"] == model and ps["context_length"] > 0 and ps["size"] > 0 and ps["expires_at"]
    wait_for(lambda: model not in loaded(http), timeout=5, what="the keep-alive to run out")


def test_ps_counts_the_weights_in_cpu_ram_in_size_not_size_vram(server: ServerThread, http: httpx.Client,
                                                                tiny_folder) -> None:
    """As Ollama's: ``size`` is the whole model, ``size_vram`` the GPU's share; weights a GPU run keeps in
    CPU RAM (``--n-cpu-moe``, ``--gpu-layers``: ModelSlot.host_bytes, set here by hand on a CPU run) count
    in the first alone."""
    model = str(tiny_folder("llama")[1])
    assert http.post("/api/generate", json={"model": model, "keep_alive": -1}).json()["done_reason"] == "load"
    slot = server.manager.slots[model]
    try:
        ps = next(m for m in http.get("/api/ps").json()["models"] if m["name"] == model)
        assert slot.host_bytes == 0 and ps["size"] == slot.size_bytes > 0 and ps["size_vram"] == 0
        slot.host_bytes = 12345
        ps = next(m for m in http.get("/api/ps").json()["models"] if m["name"] == model)
        assert ps["size"] == slot.size_bytes + 12345 and ps["size_vram"] == 0
        ollama = pytest.importorskip("ollama")  # the real client reads the same two fields
        (seen,) = [m for m in ollama.Client(host=server.url).ps().models if m.model == model]
        assert seen.size == slot.size_bytes + 12345 and seen.size_vram == 0
    finally:
        slot.host_bytes = 0
        http.post("/api/generate", json={"model": model, "keep_alive": 0})


def test_concurrent_first_requests_load_once(server: ServerThread, http: httpx.Client, tiny_folder) -> None:
    model = str(tiny_folder("qwen2")[1])
    before = server.app.state.server.metrics.models_loaded_total
    results: list[int] = []

    def ask() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            results.append(generate(client, model).status_code)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [200] * 4
    assert server.app.state.server.metrics.models_loaded_total == before + 1


def test_memory_budget_unloads_the_least_recently_used_idle_model(server: ServerThread, http: httpx.Client,
                                                                  tiny_folder) -> None:
    a, b, c = (str(tiny_folder(arch)[1]) for arch in ("llama", "qwen2", "mistral"))
    for model in (a, b):
        assert generate(http, model).status_code == 200
    size = max(slot.size_bytes for slot in server.manager.slots.values())
    try:
        server.config.models_memory = int(size * 2.5)  # room for two
        assert generate(http, a).status_code == 200  # a is now more recently used than b
        assert generate(http, c).status_code == 200
        assert sorted(loaded(http)) == sorted([a, c])
    finally:
        server.config.models_memory = None


# --------------------------------------------------------------------------- the real command
def test_serve_subprocess_api_key_and_clean_sigterm(tiny_folder, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    model = str(tiny_folder("llama")[1])
    env = {**os.environ, "LOCALLLM_HOME": str(tmp_path / "home"), "LOCALLLM_API_KEY": "s3cret", "LOCALLLM_DEBUG": ""}
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--port", "0", "--preload", model,
                             "--kv-memory", "2MB"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:  # type: ignore[union-attr]
            m = re.search(r"serving on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server did not print its URL"
        for path in ("/v1/models", "/api/tags", "/metrics", "/api/version"):
            r = httpx.get(url + path)
            assert r.status_code == 401, path
            error = r.json()["error"]
            assert (error["code"] == "invalid_api_key") if path.startswith("/v1") else ("API key" in error)
        assert httpx.get(url + "/api/tags", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + "/api/tags", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret")
        done = client.completions.create(model=model, prompt="hello", max_tokens=3, seed=0)
        assert done.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope").models.list()
        # A stream in flight at SIGTERM finishes (or is cancelled), and the process exits cleanly.
        with httpx.Client(timeout=30, headers={"Authorization": "Bearer s3cret"}) as c:
            with c.stream("POST", f"{url}/api/generate", json={"model": model, "prompt": "hi",
                                                               "options": {"num_predict": 50}}) as r:
                assert r.status_code == 200
                proc.send_signal(signal.SIGTERM)
                lines = list(r.iter_lines())
        assert lines and ('"done":true' in lines[-1] or lines[-1])
        assert proc.wait(timeout=30) == 0
        assert "server stopped" in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_exposure_warning() -> None:
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("localhost", None) is None and exposure_warning("0.0.0.0", "key") is None
    warning = exposure_warning("0.0.0.0", None)
    assert warning is not None and "--api-key" in warning


def test_parsers() -> None:
    assert parse_size("256MB") == 256 * 10**6 and parse_size("1GiB") == 2**30 and parse_size("1000") == 1000
    assert parse_duration("5m") == 300 and parse_duration("1h30m") == 5400 and parse_duration(90) == 90
    assert parse_duration("0") == 0 and parse_duration(-1) is None and parse_duration("-1m") is None
    assert parse_duration("250ms") == 0.25
    for bad in ("soon", "5 minutes", True, [1]):
        with pytest.raises(LocalLLMError):
            parse_duration(bad)
    with pytest.raises(LocalLLMError):
        parse_size("lots")
    assert ServerConfig(host="::1", port=1).url == "http://[::1]:1"
