"""Tool calling (runtime.tools): the call syntax read from a chat template, replies parsed back into
calls in each syntax, streamed replies told apart from calls, and on the tiny random-weight llama
every reply forced by tool_choice is a well-formed call whose arguments validate (the grammar holds
it, so this is asserted over many seeds)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from localllm.errors import LocalLLMError
from localllm.runtime.batch import BatchEngine
from localllm.runtime.constrain import Constraints
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.tools import (HERMES, LLAMA3, MISTRAL, CallSyntax, ReplySplitter, Tool, call_grammar,
                                    call_syntax, encode_tool_chat, parse_calls)
from tests.test_batch import BIG

WEATHER = Tool("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"]})
CLOCK = Tool("get_time", "The time in a zone", {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                                 "required": ["utc"]})
#: A Qwen3-style template: tools in the system turn, calls as <tool_call> blocks, results as tool turns.
QWEN_STYLE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Call with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_syntax_comes_from_the_template():
    ids = {"[TOOL_CALLS]": 5}.get
    assert call_syntax(QWEN_STYLE, ids) == CallSyntax(HERMES)
    assert call_syntax("{{ '<|python_tag|>' }}{{ tools }}", ids) == CallSyntax(LLAMA3)
    assert call_syntax("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", ids) == CallSyntax(MISTRAL, marker_id=5)
    assert call_syntax("{{ messages }}", ids) == CallSyntax(HERMES, generic=True)  # no tools: the generic form
    assert call_syntax(None, ids).generic


def test_replies_parse_into_calls_in_each_syntax():
    hermes = CallSyntax(HERMES)
    content, calls = parse_calls(hermes, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                         '{"city": "Oslo", "unit": "celsius"}}\n</tool_call><tool_call>'
                                         '{"name": "get_time", "arguments": "{\\"utc\\": true}"}</tool_call>')
    assert content == "Let me look." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"utc": True})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert parse_calls(hermes, "<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    _, (call,) = parse_calls(CallSyntax(LLAMA3), '<|python_tag|>{"name": "get_time", "parameters": {"utc": false}}')
    assert (call.name, call.arguments) == ("get_time", {"utc": False})
    assert parse_calls(CallSyntax(LLAMA3), "{braces} in prose")[1] == []
    _, calls = parse_calls(CallSyntax(MISTRAL, marker_id=5), '[{"name": "get_time", "arguments": {"utc": true}}]')
    assert [c.name for c in calls] == ["get_time"]


def test_a_streamed_reply_is_text_or_calls_as_soon_as_it_can_tell():
    text = ReplySplitter(CallSyntax(HERMES), forced=False)
    assert text.feed(" <to") == "" and text.feed("day it rains") == " <today it rains" and text.feed("!") == "!"
    assert text.finish() == ("", [])
    call = ReplySplitter(CallSyntax(HERMES), forced=False)
    assert call.feed("<tool_") == "" and call.feed('call>{"name": "get_time", "arguments": {}}</tool_call>') == ""
    rest, calls = call.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]


@pytest.mark.parametrize("choice,parallel", [("required", False), ("get_weather", False), ("required", True)])
def test_forced_replies_are_calls_whose_arguments_validate(tiny_fp32, choice, parallel):
    """Sixteen sampled replies of a random model held to the generic form's call grammar (the tiny
    model's template takes no tools): each one parses into calls of the allowed tools with valid arguments."""
    tk = tiny_fp32.tokenizer
    syntax = call_syntax(tk.chat_template, tk.token_to_id)
    tools = [WEATHER, CLOCK]
    grammar = call_grammar(syntax, tools, choice, parallel)
    constraints = Constraints(tk, tk.eos_ids)
    ids = tk.encode("weather?")  # (the generic form's prompt is past this model's 256 positions: bytes)
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=16)
    handles = [eng.submit(ids, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=s), 240, tk.eos_ids,
                          constraint=constraints.start(grammar)) for s in range(16)]
    eng.run_until_done()
    schemas = {t.name: t.parameters for t in tools}
    stopped = 0
    for h in handles:
        text = tk.decode(h.result())
        content, calls = parse_calls(syntax, text)
        if parallel and h.stats.finish_reason == "length":  # a random model chains calls past max_tokens:
            assert calls and content is None  # the last one cut and left out, the ones before it whole
        else:
            assert h.stats.finish_reason == "stop" and content is None and calls, text
            assert parallel or len(calls) == 1
            stopped += 1
        for c in calls:
            assert c.name in ([choice] if choice != "required" else schemas)
            jsonschema.validate(c.arguments, {**schemas[c.name], "additionalProperties": False})
    assert parallel or stopped == len(handles)


def test_tool_schemas_and_choices_that_cannot_work_are_refused():
    syntax = CallSyntax(HERMES, generic=True)
    with pytest.raises(LocalLLMError, match="tool_choice names 'get_news', which is not among the tools"):
        call_grammar(syntax, [WEATHER], "get_news")
    bad = Tool("f", "", {"type": "object", "properties": {"x": {"not": {"type": "null"}}}})
    with pytest.raises(LocalLLMError, match=r"tools\[0\]\.function\.parameters\.properties\.x uses 'not'"):
        call_grammar(syntax, [bad], "auto")


def test_the_template_receives_the_tools_and_the_history_of_calls(tiny_fp32):
    tk = tiny_fp32.tokenizer
    history = [{"role": "user", "content": "weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "content": '{"temp": 3}'}]
    own = tk.decode(encode_tool_chat(tk, history, [WEATHER], CallSyntax(HERMES), template=QWEN_STYLE))
    assert '"name": "get_weather", "description": "The weather in a city"' in own  # the template's tools
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in own
    generic = tk.decode(encode_tool_chat(tk, history, [WEATHER], CallSyntax(HERMES, generic=True)))
    assert generic.index("You can call these tools") < generic.index("weather in Oslo?")  # a system turn first
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in generic
    assert '<tool_response>\n{"temp": 3}\n</tool_response>' in generic
    assert json.loads(generic.split("You can call these tools (each one's arguments follow its JSON Schema):\n")[1]
                      .split("\n")[0])["name"] == "get_weather"
