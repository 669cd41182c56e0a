"""Tool calls that never leak: text the model wrote toward a call that did not complete never reaches
the reply's text, in every call syntax localllm reads (hermes' ``<tool_call>`` blocks, llama3's JSON,
mistral's array), whole or streamed at any cut; and through real HTTP on the embedded SmolLM2, a
reply cut by ``max_tokens`` inside a call ends with finish reason "length" and the calls before it
whole (openai, whole and streamed; ollama)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from localllm.runtime.tools import HERMES, LLAMA3, MISTRAL, CallSyntax, ReplySplitter, parse_calls
from localllm.server.replies import ReplyShape, end_reason

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
#: Each syntax: a reply of two complete calls, as decoded (special tokens left out).
REPLIES = {
    HERMES: f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    LLAMA3: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    MISTRAL: f'[{WEATHER}, {{"name": "get_weather", "arguments": {{"city": "Rome"}}}}]',
}
SYNTAXES = {HERMES: CallSyntax(HERMES), LLAMA3: CallSyntax(LLAMA3), MISTRAL: CallSyntax(MISTRAL, marker_id=5)}


def split(syntax: CallSyntax, text: str, at: int, cut: bool, forced: bool = False) -> tuple[str, list[str]]:
    """``text`` streamed in two pieces cut at ``at``: everything shown, and the calls' cities."""
    splitter = ReplySplitter(syntax, forced)
    shown = splitter.feed(text[:at]) + splitter.feed(text[at:])
    rest, calls = splitter.finish(cut)
    return shown + rest, [c.arguments["city"] for c in calls]


def complete_calls(kind: str, upto: int) -> list[str]:
    """The cities of the calls that are complete in ``REPLIES[kind][:upto]`` (each call ends in ``}}``,
    a hermes one in its closing tag)."""
    text = REPLIES[kind][:upto]
    return ["Paris", "Rome"][: text.count("</tool_call>" if kind == HERMES else "}}")]


@pytest.mark.parametrize("kind", [HERMES, LLAMA3, MISTRAL])
def test_a_reply_cut_anywhere_in_its_calls_shows_no_text_and_its_complete_calls(kind: str) -> None:
    """Cut inside the opener, inside a body, between calls, after them; whole and streamed in two
    pieces split anywhere: never any text, and exactly the calls that were complete."""
    reply = REPLIES[kind]
    for end in range(1, len(reply) + 1):
        cut = reply[:end]
        want = complete_calls(kind, end)
        content, calls = parse_calls(SYNTAXES[kind], cut, cut=True)
        assert content is None and [c.arguments["city"] for c in calls] == want, (kind, cut)
        for at in range(0, end + 1, 5):
            for forced in (False, True):
                assert split(SYNTAXES[kind], cut, at, cut=True, forced=forced) == ("", want), (kind, cut, at)


def test_an_unclosed_call_is_dropped_even_when_the_reply_ended_by_itself() -> None:
    """A stop string can end a reply inside a call: the call is dropped, the calls before it kept."""
    hermes = SYNTAXES[HERMES]
    text = f'<tool_call>{WEATHER}</tool_call>\n<tool_call>\n\n{{"name'
    assert [c.name for c in parse_calls(hermes, text)[1]] == ["get_weather"]
    assert parse_calls(hermes, text)[0] is None
    assert parse_calls(SYNTAXES[LLAMA3], '{"name": "get_weather", "parameters": {"city": "Pa') == (None, [])
    content, calls = parse_calls(SYNTAXES[MISTRAL], f'[{WEATHER}, {{"name": "get_')
    assert content is None and [c.arguments for c in calls] == [{"city": "Paris"}]


def test_text_before_a_call_is_shown_and_the_call_parsed() -> None:
    """hermes' opener may follow text: the text is shown as it comes, the opener held back until it is
    decided, the call parsed, and an unfinished second call dropped."""
    reply = f"Let me look that up. <tool_call>{WEATHER}</tool_call> <tool_call>{{\"name\": \"get_wea"
    for at in range(len(reply) + 1):
        shown, cities = split(SYNTAXES[HERMES], reply, at, cut=True)
        assert shown.strip() == "Let me look that up." and cities == ["Paris"], at
    splitter = ReplySplitter(SYNTAXES[HERMES], forced=False)
    assert splitter.feed("Let me look. <tool") == "Let me look. "  # the possible opener held back


def test_an_opener_prefix_that_turns_out_to_be_text_is_released() -> None:
    hermes = SYNTAXES[HERMES]
    splitter = ReplySplitter(hermes, forced=False)
    assert splitter.feed("Use a <") == "Use a " and splitter.feed("b> tag") == "<b> tag"
    assert splitter.feed(" or <tool") == " or " and splitter.feed("box>.") == "<toolbox>."
    assert splitter.feed(" x <tool_") == " x "
    assert splitter.finish() == ("<tool_", [])  # the reply ended by itself: it was text
    cut = ReplySplitter(hermes, forced=False)
    assert cut.feed("a <tool_") == "a " and cut.finish(cut=True) == ("", [])  # max_tokens cut it: maybe a call
    for kind in (LLAMA3, MISTRAL):  # their openers open a call only at the reply's start
        text = ReplySplitter(SYNTAXES[kind], forced=False)
        assert text.feed("Sets {1} and [2]") == "Sets {1} and [2]" and text.finish(cut=True) == ("", [])
    assert parse_calls(hermes, "<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert parse_calls(SYNTAXES[LLAMA3], "{braces} in prose") == ("{braces} in prose", [])


def test_thinking_then_a_cut_call_and_the_end_reasons() -> None:
    reply = f"<think>\nweigh it\n</think>\n\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{{\"na"
    thinking, answer, calls = ReplyShape(thinks=True, calls=ReplySplitter(SYNTAXES[HERMES], False)).whole(reply, True)
    assert (thinking, answer, [c.name for c in calls]) == ("\nweigh it\n", "", ["get_weather"])
    assert end_reason("length", calls) == "length" and end_reason("constraint", calls) == "constraint"
    assert end_reason("stop", calls) == "tool_calls" and end_reason("stop", []) == "stop"


# --------------------------------------------------------------------------- through HTTP
MODEL = "smollm2"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}
TWO_CITIES = [{"role": "user", "content": "What is the weather like in Paris and in Rome today?"}]
#: Past the first call (about 40 tokens with SmolLM2) and short of the second's end.
CUT = 56


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from localllm.server.config import ServerConfig
    from tests.server_fixtures import running_server

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("leaks-home")))
        with running_server(ServerConfig(parallel=2, kv_memory=64 << 20, quant="fp32", device="cpu")) as srv:
            yield srv


@pytest.mark.slow
def test_openai_a_reply_cut_inside_its_second_call(server) -> None:
    """Calls forced, in parallel: the reply's first call is whole, its second cut by max_tokens (the
    raw tokens show it opened); no text, finish reason "length", streamed the same."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    ask = {"model": MODEL, "messages": TWO_CITIES, "tools": [WEATHER_TOOL], "tool_choice": "required",
           "temperature": 0, "max_tokens": CUT}
    whole = client.chat.completions.create(**ask, logprobs=True)
    raw = "".join(e.token for e in whole.choices[0].logprobs.content)
    assert raw.count("<tool_call>") == 2 and raw.count("</tool_call>") == 1, raw  # cut inside the second
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content, choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert not any("<tool" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in streamed if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in streamed) == call.function.arguments


@pytest.mark.slow
def test_ollama_a_reply_cut_inside_its_call(server) -> None:
    """Ollama has no tool_choice: the history asks for the call it then makes; cut inside it by
    num_predict, the reply has no text and done_reason "length", whole and streamed."""
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.url)
    history = [{"role": "user", "content": "What is the weather like in Paris today?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
               {"role": "user", "content": "And in Rome?"}]
    options = {"temperature": 0, "num_predict": 12}
    whole = client.chat(model=MODEL, messages=history, tools=[WEATHER_TOOL], options=options, logprobs=True)
    raw = "".join(e.token for e in whole.logprobs)
    assert raw.startswith("<tool_call>") and "</tool_call>" not in raw, raw  # cut inside the call
    assert whole.done_reason == "length" and whole.message.content == "" and not whole.message.tool_calls
    chunks = list(client.chat(model=MODEL, messages=history, tools=[WEATHER_TOOL], options=options, stream=True))
    assert "".join(c.message.content for c in chunks) == "" and chunks[-1].done_reason == "length"
    assert not any(c.message.tool_calls for c in chunks)
