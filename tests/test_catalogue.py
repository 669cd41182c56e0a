"""The catalogue tells the truth, through the real clients: with an empty store, Ollama's ``list``
and OpenAI's ``models.retrieve`` see the embedded default model; ``show`` gives what it can do and the
template it chats with; ``/api/version`` is a version Ollama's clients accept. No model is loaded."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localllm.server.catalogue import capabilities
from localllm.server.config import ServerConfig
from tests.server_fixtures import ServerThread, running_server

MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("catalogue-home")))  # an empty store
        with running_server(ServerConfig(quant="fp32", device="cpu")) as srv:
            yield srv


def test_ollama_list_and_show_see_the_default_model(server: ServerThread, smollm2_path: Path) -> None:
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.url)
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.size == smollm2_path.stat().st_size
    assert listed.details.family == "llama" and listed.details.format == "gguf"
    assert listed.details.quantization_level and listed.details.parameter_size and len(listed.digest) == 64
    shown = client.show(MODEL)
    assert shown.capabilities == ["completion", "tools", "embedding"]  # SmolLM2 does not think; no vision
    assert "<|im_start|>" in shown.template and "add_generation_prompt" in shown.template  # its chat template
    assert not server.manager.slots  # listing and showing load nothing


def test_capabilities_follow_the_template() -> None:
    thinking = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}<think>\n"
    assert capabilities(thinking) == ["completion", "tools", "thinking", "embedding"]
    assert capabilities("") == ["completion", "embedding"]  # no chat template: no chat, no tools


def test_openai_retrieves_a_model_and_404s_an_unknown_one(server: ServerThread) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "localllm") and model.created > 0
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such/model")
    body = e.value.response.json()["error"]  # OpenAI's error shape
    assert body["param"] == "model" and body["code"] == "model_not_found" and "no-such/model" in body["message"]


def test_version_is_one_ollama_clients_accept(server: ServerThread) -> None:
    version = httpx.get(f"{server.url}/api/version", timeout=30).json()["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert tuple(int(p) for p in version.split(".")) >= (0, 14, 0)  # the Ollama release whose API is served
