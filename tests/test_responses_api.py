"""OpenAI's Responses API (``/v1/responses``) served with SmolLM2 (fp32) on 127.0.0.1, through the real
``openai`` client and the OpenAI Agents SDK's default Responses model: text with instructions, a
json_schema format and forced tool calls (grammar-enforced, so they always parse), a tool round trip
through ``previous_response_id`` and through whole input items, the typed stream events in their
order, stored responses, an incomplete response, and bad input in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from localllm.server.config import ServerConfig
from tests.server_fixtures import ServerThread, running_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
WEATHER_ASK = "What is the weather like in Paris today?"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
                "parameters": CITY, "strict": True}
YES_NO = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("responses-home")))
        with running_server(ServerConfig(parallel=2, kv_memory=64 << 20, quant="fp32", device="cpu")) as srv:
            yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread):  # noqa: ANN201 - openai.OpenAI, imported lazily
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_text_instructions_stored_and_deleted(client, server: ServerThread) -> None:
    """A text reply with instructions, its usage, and the stored response retrieved, then deleted
    (a 404 after)."""
    r = client.responses.create(model=MODEL, instructions="Answer in one short sentence.",
                                input="What is the capital of France?", max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and r.output_text
    assert message.content[0].type == "output_text" and message.content[0].text == r.output_text
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 24 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Answer in one short sentence." and r.max_output_tokens == 24
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    gone = httpx.get(f"{server.url}/v1/responses/{r.id}")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{unstored.id}").status_code == 404


def test_incomplete_at_max_output_tokens(client) -> None:
    r = client.responses.create(model=MODEL, input="Count from 1 to 100: 1, 2, 3,", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_json_schema_format(client) -> None:
    r = client.responses.create(model=MODEL, input="Is Paris in France? Answer in JSON.", max_output_tokens=30,
                                text={"format": {"type": "json_schema", "name": "yes_no", "schema": YES_NO,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), YES_NO)
    assert r.text.format.type == "json_schema"


def test_tool_round_trip(client) -> None:
    """A forced call (the grammar's), its output sent back through ``previous_response_id`` and,
    as an agent without stored state does, through the whole conversation as input items; each time
    the model answers in text."""
    r = client.responses.create(model=MODEL, input=WEATHER_ASK, tools=[WEATHER_TOOL], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    assert r.status == "completed" and r.tool_choice == "required" and r.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 degrees"}
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, input=[result], tools=[WEATHER_TOOL],
                                     tool_choice="none", max_output_tokens=20, temperature=0)
    assert follow.previous_response_id == r.id and follow.output[0].type == "message" and follow.output_text
    items = [{"role": "user", "content": [{"type": "input_text", "text": WEATHER_ASK}]},
             call.model_dump(exclude_none=True), result]
    whole = client.responses.create(model=MODEL, input=items, tools=[WEATHER_TOOL], tool_choice="none",
                                    max_output_tokens=20, temperature=0)
    assert whole.output[0].type == "message" and whole.output_text
    assert whole.usage.input_tokens == follow.usage.input_tokens  # the stored conversation came first
    listed = client.responses.input_items.list(whole.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "function_call", "function_call_output"]
    asked, called, answered = listed.data
    assert asked.role == "user" and asked.content[0].type == "input_text" and asked.content[0].text == WEATHER_ASK
    assert asked.id.startswith("msg_") and called.id == call.id and called.arguments == call.arguments
    assert answered.call_id == call.call_id and answered.output == "sunny, 21 degrees"
    newest = client.responses.input_items.list(whole.id, limit=1)  # desc by default
    assert [i.id for i in newest.data] == [answered.id] and newest.has_more
    older = client.responses.input_items.list(whole.id, limit=5, after=answered.id)
    assert [i.id for i in older.data] == [called.id, asked.id] and not older.has_more
    (text,) = client.responses.input_items.list(follow.id).data  # its own input only, not the earlier turns'
    assert text.type == "function_call_output" and text.call_id == call.call_id
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
        bad = httpx.get(f"{client.base_url}responses/{whole.id}/input_items", params=query)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_stream_events_in_order(client) -> None:
    """A streamed format reply: the typed events in the API's order, numbered, and the final response
    equal to what the deltas made; a streamed forced call: its item and arguments events."""
    fmt = {"format": {"type": "json_schema", "name": "yes_no", "schema": YES_NO}}
    with client.responses.stream(model=MODEL, input="Is Paris in France?", text=fmt, max_output_tokens=30) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "".join(deltas) == events[-2].item.content[0].text
    jsonschema.validate(json.loads(final.output_text), YES_NO)
    with client.responses.stream(model=MODEL, input=WEATHER_ASK, tools=[WEATHER_TOOL], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=60) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)


def test_agents_sdk_default_model_with_a_function_tool(server: ServerThread) -> None:
    """The OpenAI Agents SDK's Responses model runs an agent with one function tool to completion,
    plain and streamed: the tool is called (required) with the grammar's arguments and its result ends
    the run."""
    agents = pytest.importorskip("agents")
    openai = pytest.importorskip("openai")
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIResponsesModel(MODEL, openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused"))
    agent = agents.Agent(name="weather", instructions="Use the tool.", model=model, tools=[get_weather],
                         tool_use_behavior="stop_on_first_tool",
                         # greedy: a sampled city may run past any token budget (the grammar bounds no string)
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60, temperature=0,
                                                             parallel_tool_calls=False))

    async def run() -> tuple[str, str]:
        plain = await agents.Runner.run(agent, WEATHER_ASK, max_turns=2)
        streamed = agents.Runner.run_streamed(agent, WEATHER_ASK, max_turns=2)
        async for _ in streamed.stream_events():
            pass
        return plain.final_output, streamed.final_output

    plain, streamed = asyncio.run(run())
    assert len(seen) == 2 and plain == f"sunny in {seen[0]}" and streamed == f"sunny in {seen[1]}"


def test_bad_input_in_openai_shape(server: ServerThread) -> None:
    cases = [
        ({"input": 3}, 400, "input"),
        ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, 400, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
         "input[0].content[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "nope"}]}, 400,
         "input[0].arguments"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, 400, "tools[0].name"),
        ({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "other"}}, 400,
         "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": YES_NO}}}, 400, "text.format.name"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
        ({"input": "x", "tools": [WEATHER_TOOL], "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
        ({"input": "x", "temperature": "hot"}, 400, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": "x", "conversation": "conv_1"}, 400, "conversation"),
        ({"input": "x", "truncation": "auto"}, 400, "truncation"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include[0]"),
        ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({}, 400, "input"),
    ]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for extra, status, param in cases:
            r = http.post("/v1/responses", json={"model": MODEL, **extra})
            assert r.status_code == status, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] and error["message"], (extra, error)
        assert http.post("/v1/responses", json={"input": "x"}).json()["error"]["param"] == "model"
        assert http.delete("/v1/responses/resp_unknown").status_code == 404


def test_a_call_cut_by_max_output_tokens_leaks_no_text(client) -> None:
    """A call cut short by ``max_output_tokens`` is neither a call nor text, whole or streamed: the
    response is incomplete with an empty message."""
    ask = {"model": MODEL, "input": WEATHER_ASK, "tools": [WEATHER_TOOL], "tool_choice": "required",
           "max_output_tokens": 5, "temperature": 0}
    r = client.responses.create(**ask)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in r.output] == ["message"] and r.output_text == ""
    events = list(client.responses.create(**ask, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == ""
    assert not [e for e in events if e.type in ("response.output_text.delta", "response.function_call_arguments.delta")]
