"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) on the embedded
SmolLM2, through the real ``anthropic`` client (the key sent as ``x-api-key``, as it sends it) and
raw HTTP for the event stream's order and the error shapes; and the thinking budget's grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from localllm.runtime.constrain import FREE_TEXT, Constraints, Grammar, after_thinking
from localllm.server.config import ServerConfig
from tests.server_fixtures import ServerThread, running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
KEY = "test-key"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city"]}}
TIME = {"name": "get_time", "description": "Get the current time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                         "required": ["zone"]}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon and a lighthouse."}]
GREEDY = {"temperature": 0}  # the SDK's signature no longer takes sampling fields; the API still does


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("messages-home")))
        config = ServerConfig(parallel=2, kv_memory=64 << 20, quant="fp32", device="cpu", api_key=KEY)
        with running_server(config) as srv:
            r = httpx.post(f"{srv.url}/api/generate", json={"model": MODEL}, headers={"x-api-key": KEY}, timeout=300)
            assert r.status_code == 200, r.text  # loaded
            yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _closed(schema: dict) -> dict:
    return {**schema, "additionalProperties": False}


def test_create_text_system_and_stop_reasons(client: anthropic.Anthropic) -> None:
    """A text reply as Anthropic's message, its usage counted apart from the prefix cache's share; the
    system prompt as a string or as text blocks is the same prompt; max_tokens and stop sequences
    end the reply with their stop reasons."""
    system = "You are a terse geography tutor."
    first = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=FRANCE, extra_body=GREEDY)
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.id.startswith("msg_") and [b.type for b in first.content] == ["text"]
    assert first.stop_reason == "max_tokens" and first.stop_sequence is None and first.usage.output_tokens == 4
    again = client.messages.create(model=MODEL, max_tokens=4, messages=FRANCE, extra_body=GREEDY,
                                   system=[{"type": "text", "text": system}])
    assert again.content[0].text == first.content[0].text  # the same prompt, greedy
    assert again.usage.cache_read_input_tokens > 0  # its prefix came from the cache
    assert (again.usage.input_tokens + again.usage.cache_read_input_tokens
            == first.usage.input_tokens + first.usage.cache_read_input_tokens)
    cut = client.messages.create(model=MODEL, max_tokens=60, messages=FRANCE, stop_sequences=[" ", "\n"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence in (" ", "\n")
    assert " " not in cut.content[0].text if cut.content else True


def test_count_tokens(client: anthropic.Anthropic) -> None:
    """The prompt as the template renders it: the system prompt, as a string or blocks, and the tools
    count (max_tokens not needed)."""
    bare = client.messages.count_tokens(model=MODEL, messages=FRANCE).input_tokens
    text = client.messages.count_tokens(model=MODEL, messages=FRANCE, system="Be brief.").input_tokens
    blocks = client.messages.count_tokens(model=MODEL, messages=FRANCE,
                                          system=[{"type": "text", "text": "Be brief."}]).input_tokens
    tools = client.messages.count_tokens(model=MODEL, messages=FRANCE, tools=[WEATHER]).input_tokens
    assert 0 < text == blocks < tools and bare != text  # SmolLM2's template has a default system prompt


def test_stream_events_in_order(server: ServerThread, client: anthropic.Anthropic) -> None:
    """The SDK's stream assembles the same text it streamed; on the wire the events come in
    Anthropic's order, with a ping after the first block's start."""
    with client.messages.stream(model=MODEL, max_tokens=8, messages=STORY, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed and streamed == final.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8 and final.usage.input_tokens + final.usage.cache_read_input_tokens > 0
    body = {"model": MODEL, "max_tokens": 5, "messages": STORY, "stream": True}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                   timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e.strip()]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    datas = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    assert all(d["type"] == n for n, d in zip(names, datas))
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens" and datas[-2]["usage"]["output_tokens"] == 5


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    """tool_choice any and tool are enforced by the call grammar (the input validates against the
    tool's input_schema); a call and its result go back in the history; a streamed call arrives as
    input_json_delta that the SDK assembles; a reply cut inside a call has neither the call nor its
    text; none answers in text."""
    tools = [WEATHER, TIME]
    schemas = {t["name"]: _closed(t["input_schema"]) for t in tools}
    r = client.messages.create(model=MODEL, max_tokens=60, messages=WEATHER_ASK, tools=tools, extra_body=GREEDY,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert r.stop_reason == "tool_use"
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name in schemas
    jsonschema.validate(call.input, schemas[call.name])
    history = [*WEATHER_ASK, {"role": "assistant", "content": [b.model_dump() for b in r.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "21 C, sunny"}]},
                                            {"type": "text", "text": "And the time there?"}]}]
    with client.messages.stream(model=MODEL, max_tokens=60, messages=history, tools=tools, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_time"}) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "get_time" and final.stop_reason == "tool_use"
    jsonschema.validate(streamed.input, schemas["get_time"])
    cut = client.messages.create(model=MODEL, max_tokens=5, messages=WEATHER_ASK, tools=tools,
                                 tool_choice={"type": "any"})  # cut inside its call: no call, no call text
    assert cut.stop_reason == "max_tokens" and cut.content == []
    with client.messages.stream(model=MODEL, max_tokens=5, messages=WEATHER_ASK, tools=tools,
                                tool_choice={"type": "any"}) as stream:
        assert "".join(stream.text_stream) == "" and stream.get_final_message().content == []
    answer = client.messages.create(model=MODEL, max_tokens=12, messages=history, tools=tools,
                                    tool_choice={"type": "none"})
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")


def _error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_errors_in_anthropic_shape(server: ServerThread, client: anthropic.Anthropic) -> None:
    """The key as x-api-key or a bearer token; a wrong one is a 401, bad input a 400 naming the field,
    an unknown model or route a 404, a foreign origin a 403: all in Anthropic's shape, also through
    the SDK's exceptions."""
    url = f"{server.url}/v1/messages"
    ok = {"model": MODEL, "max_tokens": 1, "messages": FRANCE}
    assert httpx.post(url, json=ok, headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200
    _error(httpx.post(url, json=ok, headers={"x-api-key": "wrong"}, timeout=60), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=1, messages=FRANCE)
    key = {"x-api-key": KEY}
    bad = {"max_tokens": {**ok, "max_tokens": None},
           "messages[0].content[0]": {**ok, "messages": [{"role": "user", "content": [
               {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
           "tool_choice.name": {**ok, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
           "tools[0].input_schema": {**ok, "tools": [{"name": "f"}]},
           "thinking.budget_tokens": {**ok, "max_tokens": 10, "thinking": {"type": "enabled", "budget_tokens": 20}},
           "messages[0].role": {**ok, "messages": [{"role": "system", "content": "hi"}]}}
    for field, body in bad.items():
        assert field in _error(httpx.post(url, json=body, headers=key, timeout=60), 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=0, messages=FRANCE)
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model:latest", max_tokens=1, messages=FRANCE)
    assert "no route" in _error(httpx.post(f"{url}/nowhere", json=ok, headers=key, timeout=60), 404, "not_found_error")
    _error(httpx.post(url, json=ok, headers={**key, "Origin": "http://evil.example"}, timeout=60), 403, "permission_error")
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL}, headers=key, timeout=60)
    assert r.status_code == 400 and "param" in r.json()["error"]  # OpenAI's routes keep OpenAI's shape


def test_a_thinking_budget_closes_the_block(smollm2_path: Path) -> None:
    """With a budget, the thinking block must close once it has taken that many tokens (``</think>``
    is then the only way on), and may close before."""
    from localllm.loaders.load import load_tokenizer, open_checkpoint

    tk = load_tokenizer(open_checkpoint(str(smollm2_path)))
    vocab = Constraints(tk, tk.eos_ids)

    def taken(grammar_text: str, text: str) -> tuple[int, int]:
        m = vocab.start(Grammar(grammar_text, "test"))._m  # noqa: SLF001
        ids = tk.encode(text, add_special=False)
        n = 0
        while n < len(ids) and m.consume_token(ids[n]):  # one at a time: the token limit is checked so
            n += 1
        return n, len(ids)

    bounded = after_thinking(FREE_TEXT, opened=False, budget=4).text
    n, total = taken(bounded, "<think> a b</think> the answer")
    assert n == total  # closed within the budget
    n, total = taken(bounded, "<think> a b c d e f g</think> the answer")
    assert n < total  # thinking past the budget is refused
    n, total = taken(bounded, "<think> a b c d</think> the answer")
    assert n == total  # closed at the budget
    ids = tk.encode("<think> a", add_special=False)
    assert vocab.start(after_thinking(FREE_TEXT, opened=False, budget=4)).valid_prefix(ids) == 0  # no rollback
    assert vocab.start(after_thinking(FREE_TEXT, opened=False)).valid_prefix(ids) == len(ids)
    opened = after_thinking(FREE_TEXT, opened=True, budget=4).text
    assert taken(opened, " a b</think> the answer")[0] == taken(opened, " a b</think> the answer")[1]
