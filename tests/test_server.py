"""``localllm serve`` with SmolLM2 (fp32) through real HTTP on 127.0.0.1: the ``openai`` and ``ollama``
client packages, raw HTTP for errors, disconnects, the queue limit and ``/metrics``.

One server for the module (uvicorn in a thread of this process, so that the tests can read the
engine's KV pool), SmolLM2 loaded once. Every load and fault test sends a bounded number of requests
and stops by itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localllm.server.config import ServerConfig
from tests.answers import WIDE_MARGIN
from tests.server_fixtures import ServerThread, rss_bytes, running_server, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
MODEL = "smollm2"
FRANCE = "What is the capital of France?"
PARALLEL = 2
#: A raw prompt SmolLM2 continues for hundreds of tokens (it keeps counting): streams that last.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
QUEUE = 3


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("serve-home")))
        config = ServerConfig(parallel=PARALLEL, queue=QUEUE, kv_memory=64 << 20, quant="fp32", device="cpu")
        with running_server(config) as srv:
            r = httpx.post(f"{srv.url}/api/generate", json={"model": MODEL}, timeout=120)  # loads it
            assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text
            yield srv


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def engine_usage(server: ServerThread) -> dict[str, int]:
    return server.manager.slots[MODEL].engine.usage()


def idle(server: ServerThread) -> bool:
    u = engine_usage(server)
    return u["running"] == 0 and u["waiting"] == 0 and u["blocks_used"] == 0


# --------------------------------------------------------------------------- OpenAI
def test_openai_chat_greedy_equals_localllm_run(server: ServerThread, france_fp32) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": FRANCE}],
                                           temperature=0, max_tokens=12)
    text = reply.choices[0].message.content
    env = {**os.environ, "LOCALLLM_DEBUG": ""}
    run = subprocess.run([sys.executable, "-m", "localllm", "run", MODEL, FRANCE, "--quant", "fp32", "--temperature",
                          "0", "--max-tokens", "12"], capture_output=True, text=True, env=env, cwd=ROOT,
                         stdin=subprocess.DEVNULL, timeout=300)
    assert run.returncode == 0, run.stderr
    # Compared where every step up to the answer's end was decided by a wide fp32 margin.
    if min(france_fp32.margins) >= WIDE_MARGIN:
        assert text == run.stdout.strip() == france_fp32.text
    else:
        assert "Paris" in text and "Paris" in run.stdout
    assert reply.choices[0].finish_reason == ("stop" if len(france_fp32.pieces) < 12 else "length")
    assert reply.usage.prompt_tokens > 20 and reply.usage.completion_tokens == len(france_fp32.pieces)


def test_openai_streaming_chat_usage_and_prefix_cache(server: ServerThread) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in one short sentence."},
                {"role": "user", "content": FRANCE}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    # The second identical prompt found its full blocks in the prefix cache.
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 16 * (usage.prompt_tokens // 16) - 16 > 0


def test_openai_completions_stream_and_not(server: ServerThread) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 5
    stream = list(client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                            max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    assert stream[-1].choices[0].finish_reason == "length"
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20, stop=[" 7"])
    assert cut.choices[0].finish_reason == "stop" and " 7" not in cut.choices[0].text
    seeded = [client.completions.create(model=MODEL, prompt="Once upon a time", temperature=1.0, seed=7,
                                        max_tokens=6).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    models = [m.id for m in client.models.list().data]
    assert MODEL in models


def test_structured_outputs_through_both_clients(server: ServerThread) -> None:
    """openai's ``parse`` with a Pydantic model (its strict json_schema), a streamed json_object reply, and
    ollama's ``format`` with a schema: each reply parses and validates, and ends by the grammar ("stop")."""
    openai = pytest.importorskip("openai")
    ollama = pytest.importorskip("ollama")
    jsonschema = pytest.importorskip("jsonschema")
    from pydantic import BaseModel, ConfigDict, Field

    class Capital(BaseModel):
        model_config = ConfigDict(extra="forbid")
        city: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population_millions: int = Field(ge=0, le=1000)

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    ask = [{"role": "user", "content": f"{FRANCE} Answer in JSON."}]
    parsed = client.chat.completions.parse(model=MODEL, messages=ask, temperature=0, max_tokens=60,
                                           response_format=Capital)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Capital)
    assert choice.message.parsed.city == "Paris"  # the grammar leaves the model its answer
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, temperature=0.7, seed=3, max_tokens=80,
                                                 stream=True, response_format={"type": "json_object"}))
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"
    schema = Capital.model_json_schema()
    reply = ollama.Client(host=server.url).chat(model=MODEL, messages=ask, format=schema,
                                                options={"temperature": 0.9, "seed": 5, "num_predict": 60})
    jsonschema.validate(json.loads(reply.message.content), schema)
    assert reply.done_reason == "stop"
    wait_for(lambda: idle(server), what="every block back")


def test_logprobs_in_every_shape(server: ServerThread) -> None:
    """OpenAI chat (whole and streamed: the same entries), legacy completions and Ollama: one entry per
    generated token whose bytes make the text, greedy tokens first among their alternatives."""
    openai = pytest.importorskip("openai")
    ollama = pytest.importorskip("ollama")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": FRANCE}], "temperature": 0, "max_tokens": 6,
           "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    assert b"".join(bytes(e.bytes) for e in content).decode() == whole.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token and e.logprob <= 0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    streamed = [e for c in client.chat.completions.create(**ask, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    legacy = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4,
                                       logprobs=2).choices[0]
    assert "".join(legacy.logprobs.tokens) == legacy.text and len(legacy.logprobs.top_logprobs[0]) == 2
    assert legacy.logprobs.text_offset == sorted(legacy.logprobs.text_offset) and legacy.logprobs.text_offset[0] == 0
    reply = ollama.Client(host=server.url).generate(model=MODEL, prompt=FRANCE, logprobs=True, top_logprobs=2,
                                                    options={"temperature": 0, "num_predict": 5})
    assert "".join(e.token for e in reply.logprobs) == reply.response and len(reply.logprobs[0].top_logprobs) == 2
    assert reply.logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-4)  # the same first token


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"]}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_tool_calls_through_both_clients(server: ServerThread) -> None:
    """tool_choice enforced (required: a call of one of the tools; a named function: a call of it,
    streamed as fragments the openai client assembles), then a round trip (the call and its result in
    the history, the answer as text); Ollama's tools from a Python function, each call whole in one
    streamed chunk with its arguments as an object."""
    openai = pytest.importorskip("openai")
    ollama = pytest.importorskip("ollama")
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    tools = [WEATHER_TOOL, TIME_TOOL]
    schemas = {t["function"]["name"]: {**t["function"]["parameters"], "additionalProperties": False} for t in tools}
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    with client.chat.completions.stream(model=MODEL, messages=WEATHER_ASK, tools=tools, tool_choice=named,
                                        parallel_tool_calls=False, temperature=0, max_tokens=80) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert streamed.function.name == "get_time" and final.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(streamed.function.arguments), schemas["get_time"])
    history = WEATHER_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_celsius": 21, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=tools, tool_choice="none",
                                            temperature=0, max_tokens=40).choices[0]
    assert answer.message.content and not answer.message.tool_calls and answer.finish_reason in ("stop", "length")

    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
          city: The city's name
        """
        return "sunny"

    said_before = [WEATHER_ASK[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"}, {"role": "user", "content": "And in Rome?"}]
    chunks = list(ollama.Client(host=server.url).chat(model=MODEL, messages=said_before, tools=[get_weather],
                                                      stream=True, options={"temperature": 0, "num_predict": 80}))
    with_calls = [c for c in chunks if c.message.tool_calls]
    assert len(with_calls) == 1 and chunks[-1].done, [c.message for c in chunks]
    (ocall,) = with_calls[0].message.tool_calls
    assert ocall.function.name == "get_weather" and isinstance(ocall.function.arguments, dict)
    assert set(ocall.function.arguments) <= {"city"}
    wait_for(lambda: idle(server), what="every block back")


def test_bad_tools_get_400s(http: httpx.Client) -> None:
    base = {"model": MODEL, "messages": WEATHER_ASK}
    cases = [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "'tools[0].function.name' is required"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "'tools[0].function.parameters' must be a JSON Schema object"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
         "'tool_choice' names 'get_news', which is not among the tools"),
        ({"tool_choice": "required"}, "no 'tools' are given"),
        ({"tools": [WEATHER_TOOL], "n": 2}, "n = 1 only"),
        ({"tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}}, "cannot be combined"),
    ]
    for extra, needle in cases:
        r = http.post("/v1/chat/completions", json={**base, **extra})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (extra, r.text)
    r = http.post("/api/chat", json={**base, "tools": [{"type": "function", "function": {"name": "bad name!"}}]})
    assert r.status_code == 400 and "'tools[0].function.name' is required" in r.json()["error"]


# --------------------------------------------------------------------------- Ollama
def test_ollama_client_generate_chat_list_show_ps(server: ServerThread) -> None:
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.url)
    options = {"temperature": 0, "num_predict": 6, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.0,
               "seed": 1, "num_ctx": 512}
    done = client.generate(model=MODEL, prompt=FRANCE, options=options)
    assert done.done and done.done_reason in ("stop", "length") and done.response
    assert done.eval_count == len(done.response) or done.eval_count >= 1
    assert done.total_duration >= done.prompt_eval_duration + done.eval_duration > 0
    assert done.prompt_eval_count >= 1
    pieces = list(client.generate(model=MODEL, prompt=FRANCE, options=options, stream=True))
    assert "".join(p.response for p in pieces) == done.response
    assert pieces[-1].done and not any(p.done for p in pieces[:-1])
    chat = client.chat(model=MODEL, messages=[{"role": "user", "content": FRANCE}], options=options)
    assert chat.message.role == "assistant" and chat.message.content == done.response
    streamed = list(client.chat(model=MODEL, messages=[{"role": "user", "content": FRANCE}], options=options,
                                stream=True))
    assert "".join(c.message.content for c in streamed) == chat.message.content
    loaded = client.ps().models
    assert [m.model for m in loaded] == [MODEL] and loaded[0].size > 100e6 and loaded[0].expires_at is not None
    shown = client.show(MODEL)
    assert shown.details.family == "llama" and shown.modelinfo["llama.context_length"] == 8192
    assert [m.model for m in client.list().models] == [MODEL]  # the embedded model; nothing is stored
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model")
    assert e.value.status_code == 404


def test_ollama_num_ctx_caps_the_reply(server: ServerThread, http: httpx.Client) -> None:
    r = http.post("/api/generate", json={"model": MODEL, "prompt": "Count: 1, 2, 3,", "raw": True, "stream": False,
                                         "options": {"temperature": 0, "num_ctx": 12}})
    body = r.json()
    assert r.status_code == 200 and body["done_reason"] == "length"
    assert body["prompt_eval_count"] + body["eval_count"] <= 12


# --------------------------------------------------------------------------- bad requests
BAD = [
    ("POST", "/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "'messages' must be an array"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "temperature": "hot"}, 400, "'temperature' must be a number"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2},
     400, "n = 1 only"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 0}, 400, "'max_tokens' is 0"),
    ("POST", "/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
     404, "not found"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "word " * 6000}, 400, "the context holds"),
    ("POST", "/v1/completions", {"model": MODEL}, 400, "'prompt' is required"),
    ("GET", "/v1/chat/completions", None, 405, "not allowed"),
    ("GET", "/v1/nothing", None, 404, "no route"),
    ("POST", "/api/generate", b"\xff\xfe", 400, "not UTF-8"),
    ("POST", "/api/generate", {"model": MODEL, "prompt": "hi", "options": {"top_k": 1.5}}, 400,
     "'options.top_k' must be an integer"),
    ("POST", "/api/generate", {"model": MODEL, "prompt": "hi", "options": {"top_p": 0}}, 400, "top-p"),
    ("POST", "/api/generate", {"model": MODEL, "prompt": "hi", "keep_alive": "soon"}, 400, "keep_alive"),
    ("POST", "/api/chat", {"model": MODEL, "messages": [{"role": "user"}], "stream": "yes"}, 400,
     "'stream' must be true or false"),
    ("POST", "/api/chat", {"model": "no-such-model:int4", "messages": [{"role": "user", "content": "x"}]}, 404,
     "not found"),
    ("POST", "/api/generate", {"model": MODEL, "prompt": "word " * 6000, "stream": False}, 400, "the context holds"),
    ("DELETE", "/api/delete", {"model": "no-such-model"}, 404, "not found"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_schema", "json_schema": {
                                          "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {}}}}}}},
     400, "response_format.json_schema.schema.properties.a uses 'not', which localllm cannot enforce"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "response_format": {"type": "xml"}}, 400,
     "'response_format.type' is 'xml'"),
    ("POST", "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "format": {"type": "strng"}},
     400, "format.type is 'strng', not a JSON Schema type"),
    ("POST", "/api/generate", {"model": MODEL, "prompt": "x", "format": "yaml"}, 400, "'format' must be \"json\""),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                      "top_logprobs": 21}, 400, "'top_logprobs' is 21; it must be at least 0 and at most 20"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "top_logprobs": 2}, 400, "'top_logprobs' needs 'logprobs': true"),
    ("POST", "/api/generate", {"model": MODEL, "prompt": "x", "logprobs": True, "top_logprobs": -1}, 400,
     "'top_logprobs' is -1"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "reasoning_effort": "max"}, 400, "'reasoning_effort' is 'max'"),
    ("POST", "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "think": "yes"}, 400,
     "'think' must be true, false"),
    ("POST", "/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                                     b'"temperature": NaN}' % MODEL.encode(), 400, "'temperature' must be a number, not NaN"),
    ("POST", "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "format": {"$ref": "#"}},
     400, "a JSON schema admits no reply"),
]


@pytest.mark.parametrize("method,path,body,status,needle", BAD, ids=[f"{b[1]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_the_api_error_shape(http: httpx.Client, method: str, path: str, body: object, status: int,
                                              needle: str) -> None:
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    r = http.request(method, path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    if path.startswith("/v1/"):
        assert set(error) == {"message", "type", "param", "code"} and needle in error["message"], error
    else:
        assert isinstance(error, str) and needle in error, error
    assert "Traceback" not in r.text


def test_body_size_limit(server: ServerThread, http: httpx.Client) -> None:
    big = b'{"model": "x", "prompt": "' + b"a" * (server.config.max_body_bytes + 10) + b'"}'
    r = http.post("/api/generate", content=big)
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "x", "prompt": "'
        for _ in range(server.config.max_body_bytes // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = http.post("/v1/completions", content=chunks())
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("the request body is over")


# --------------------------------------------------------------------------- load and faults
def _open_stream(url: str, max_tokens: int = 400, client: httpx.Client | None = None
                 ) -> tuple[httpx.Client, httpx.Response]:
    client = client or httpx.Client(timeout=60)
    request = client.build_request("POST", f"{url}/v1/completions", json={
        "model": MODEL, "prompt": COUNTING, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    return client, client.send(request, stream=True)


def test_disconnect_cancels_and_frees_blocks(server: ServerThread) -> None:
    wait_for(lambda: idle(server), what="an idle engine")
    client, response = _open_stream(server.url)
    assert response.status_code == 200
    next(response.iter_lines())  # generating
    assert engine_usage(server)["blocks_used"] > 0
    response.close()
    client.close()
    wait_for(lambda: idle(server), timeout=5, what="the cancelled sequence's blocks to be freed")


def test_queue_limit_answers_503_with_retry_after(server: ServerThread) -> None:
    wait_for(lambda: idle(server), what="an idle engine")
    streams = [_open_stream(server.url) for _ in range(PARALLEL + QUEUE)]
    try:
        assert all(r.status_code == 200 for _, r in streams)
        wait_for(lambda: engine_usage(server)["running"] == PARALLEL and engine_usage(server)["waiting"] == QUEUE,
                 what="a full batch and a full queue")
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert "busy" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/api/generate", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        assert r.status_code == 503 and "busy" in r.json()["error"]
    finally:
        for client, response in streams:
            response.close()
            client.close()
    wait_for(lambda: idle(server), timeout=10, what="every cancelled stream to be retired")


def test_many_cancelled_streams_leave_no_memory_behind(server: ServerThread) -> None:
    shared = httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))

    def one() -> None:
        _, response = _open_stream(server.url, max_tokens=50, client=shared)
        try:
            next(response.iter_lines())
        finally:
            response.close()  # the connection goes with it: the server sees a disconnect

    def burst(n: int) -> None:
        for _ in range(n // 4):
            threads = [threading.Thread(target=one) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
        wait_for(lambda: idle(server), timeout=10, what="the cancelled streams to be retired")

    try:
        burst(12)  # warm-up: allocator pools, thread stacks, the prefix cache's blocks
        baseline = rss_bytes()
        burst(40)
    finally:
        shared.close()
    growth = rss_bytes() - baseline
    assert growth < 40e6, f"RSS grew by {growth / 1e6:.1f} MB over 40 cancelled streams"
    assert not server.manager.slots[MODEL].generations  # nothing kept per request


def test_metrics(server: ServerThread, http: httpx.Client) -> None:
    text = http.get("/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["localllm_generated_tokens_total"] > 0
    assert values["localllm_prompt_tokens_total"] > 0
    assert values["localllm_prompt_cached_tokens_total"] > 0
    assert values["localllm_queue_rejections_total"] >= 2
    assert values[f'localllm_requests_running{{model="{MODEL}"}}'] == 0
    assert values[f'localllm_kv_blocks_total{{model="{MODEL}"}}'] > 0
    assert f'localllm_kv_blocks{{model="{MODEL}",state="used"}}' in values
    assert values['localllm_generations_total{reason="cancelled"}'] > 0
    assert "# TYPE localllm_requests_waiting gauge" in text
