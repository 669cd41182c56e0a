"""A model's chat template is untrusted code: every render ends soon and small, and a template that
fails says so in one line (what it tried, and that the template is at fault), through the runtime,
the CLI and the server; real templates render as plain jinja renders them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localllm.errors import LocalLLMError
from localllm.runtime import chat
from localllm.runtime.chat import render_chat
from localllm.server.config import ServerConfig
from tests.server_fixtures import ServerThread, running_server
from tests.test_cli import assert_one_line_error, run_cli

HI = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}"
AT_FAULT = "the template in the model's files is at fault"

HOSTILE = [  # (template, what the one-line error says)
    (NESTED_LOOPS, "ran past its limit of 1,100,000 steps"),
    ("{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}z{% endfor %}{% endfor %}{% endset %}",
     "ran past its limit of 1,100,000 steps"),
    ("{% set s = 'ab' * 1000000 %}{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}", "steps"),
    ("{{ ('a' * 1000000000)|length }}", "tried to make a value of about 954 MB with '*', over the 4 MB"),
    ("{{ (['a' * 1000000] * 1000)|join }}", "with '*'"),
    ("{{ 10 ** (10 ** 10) }}", "a number of about 40,000,000,000 bits with '**'"),
    ("{{ '%999999999d' % 1 }}", "about 954 MB with '%'"),
    ("{{ 'x'|center(10 ** 9) }}", "with the filter 'center'"),
    ("{{ 'x'|center(1000000000) }}", "with the filter 'center'"),  # folded while compiling: checked there too
    ("{{ 'x'.ljust(10 ** 9) }}", "with ljust()"),
    ("{{ '{:>999999999}'.format(1) }}", "with format()"),
    ("{{ ('\n' * 1000000)|indent(1000) }}", "with the filter 'indent'"),
    ("{{ range(100000)|join('x' * 4000000) }}", "with the filter 'join'"),
    ("{{ ('a' * 1000).replace('a', 'b' * 1000).replace('b', 'c' * 1000) }}", "with replace()"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "with '~'"),
    ("{% macro m() %}{% for i in range(100000) %}" + "y" * 10000 + "{% endfor %}{% endmacro %}{{ m()|length }}",
     "made more than 32 MB of text and values"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
    ("{% for m in [[1]] recursive %}{{ loop([m]) }}{% endfor %}", "recursed too deeply"),
    ("{{ 1 // 0 }}", "failed: ZeroDivisionError"),
    ("{{ 2.0 ** 10000 }}", "failed: OverflowError"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}",
     "tried something the sandbox forbids: access to attribute '__class__' of 'str' object is unsafe"),
]


@pytest.mark.parametrize("template, says", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_template_ends_soon_with_what_it_tried(template: str, says: str) -> None:
    with pytest.raises(LocalLLMError) as caught:
        render_chat(template, HI)
    line = str(caught.value)
    assert line.startswith("the model's chat template ") and says in line and "\n" not in line, line
    assert AT_FAULT in line and "--raw" in line and "check the roles" not in line, line


def test_a_template_that_fails_on_the_conversation_says_so() -> None:
    """raise_exception refuses the conversation (the roles hint stays); an undefined name may be a field
    the conversation lacks or the template's own slip: the hint names both."""
    with pytest.raises(LocalLLMError, match="rejected the conversation: one user only; check the roles"):
        render_chat("{{ raise_exception('one user only') }}", HI)
    with pytest.raises(LocalLLMError, match="failed on this conversation: 'foo' is undefined; check that every "
                                            "message has the fields the template reads; if they do, " + AT_FAULT):
        render_chat("{{ foo() }}", HI)


def test_a_long_conversation_gets_room_in_proportion() -> None:
    """The prompt of a conversation past the fixed limits renders: the limits grow with what it holds."""
    long = [{"role": "user", "content": "w" * (5 << 20)}, {"role": "assistant", "content": "ok"}] * 3
    text = render_chat(chat.DEFAULT_TEMPLATE, long)
    assert len(text) > 3 * (5 << 20)


#: Exercises what real templates use: macros and recursion, loop variables, namespaces, tools as JSON,
#: filters (trim, join, map, selectattr, indent, center, replace, format), '~', '+', '%', '*',
#: str.format, set blocks, call and filter blocks.
EVERYTHING = """{%- macro kind(spec) -%}
{%- if spec.type == 'array' %}list[{{ kind(spec['items']) }}]{% elif spec.type %}{{ spec.type }}{% else %}any{% endif -%}
{%- endmacro -%}
{%- macro box(title) %}[{{ title|center(12) }}]{{ caller() }}{% endmacro -%}
{{ bos_token }}{% set ns = namespace(system='', count=0) %}
{%- for m in messages if m.role == 'system' %}{% set ns.system = ns.system ~ m.content|trim ~ '\\n' %}{% endfor %}
{%- if tools %}{% call box('tools') %}{% for t in tools %}
{{ '%-10s|%3d' % (t.function.name, loop.index) }} {{ t.function.parameters.properties|items|map('first')|join(', ') }}
{%- for name, spec in t.function.parameters.properties|dictsort %} {{ name }}: {{ kind(spec) }}{% endfor %}
{{ t|tojson(indent=2)|indent(4) }}{% endfor %}{% endcall %}{% endif %}
{%- set header %}{{ ns.system|replace('You', 'Thou') }}{% endset %}{{ header|upper }}
{%- for m in messages|rejectattr('role', 'equalto', 'system') %}{% set ns.count = ns.count + 1 %}
{{ '<|{}|>'.format(m.role) + (m.content or '')|trim + ('!' * loop.length) }}{% if loop.last %}{{ '=' * 3 }}{% endif %}
{%- for c in m.tool_calls or [] %}{% filter lower %}CALL {{ c.function.name }}{% endfilter %}{% endfor %}
{%- endfor %}{% for row in [[1, [2, [3]]]] recursive %}<{{ row[0] }}{{ loop(row[1:]) if row[1:] }}>{% endfor %}
{{ ns.count }}{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_real_templates_render_as_plain_jinja_does() -> None:
    """The bounded environment changes nothing a template writes (here and in the SmolLM2, tool and
    thinking tests): the same text as jinja's own immutable sandbox with the same helpers."""
    tools = [{"type": "function", "function": {"name": f"tool{i}", "description": "d", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {
            "type": "integer"}}}}}} for i in range(3)]
    messages = [{"role": "system", "content": " You are terse. "}, *[
        {"role": "user" if i % 2 == 0 else "assistant", "content": f" turn {i} "} for i in range(20)],
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "tool1", "arguments": {}}}]}]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = chat._tojson
    variables = {"messages": messages, "tools": tools, "bos_token": "<s>", "eos_token": "</s>",
                 "add_generation_prompt": True}
    for template in (EVERYTHING, chat.DEFAULT_TEMPLATE, chat.GEMMA_TEMPLATE):
        expected = plain.from_string(template).render(**variables)
        assert render_chat(template, messages, tools=tools, bos_token="<s>", eos_token="</s>") == expected


# ------------------------------------------------------------------------------ through the CLI and the server
@pytest.fixture(scope="module")
def hostile(tiny_folder, tmp_path_factory) -> Path:
    """The tiny llama's folder with a chat template that loops without end when the last message is
    'loop', recurses without end on 'recurse', and is ChatML otherwise."""
    _, folder = tiny_folder("llama")
    own = tmp_path_factory.mktemp("hostile") / "hostile"
    shutil.copytree(folder, own)
    template = ("{% macro deeper() %}{{ deeper() }}{% endmacro %}"
                "{% if messages[-1].content == 'loop' %}" + NESTED_LOOPS + "{% endif %}"
                "{% if messages[-1].content == 'recurse' %}{{ deeper() }}{% endif %}" + chat.DEFAULT_TEMPLATE)
    config = json.loads((own / "tokenizer_config.json").read_text())
    (own / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return own


def test_run_says_the_template_is_at_fault_and_raw_runs(hostile: Path) -> None:
    assert_one_line_error(run_cli("run", str(hostile), "loop", "-n", "1"), "chat template ran past its limit",
                          AT_FAULT, "--raw")
    proc = run_cli("run", str(hostile), "loop", "--raw", "-n", "1", "--temperature", "0")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("hostile-home")))
        with running_server(ServerConfig(kv_memory=16 << 20, quant="fp32", device="cpu",
                                         allow_local_paths=True)) as srv:
            yield srv


@pytest.mark.parametrize("content, says", [("loop", "ran past its limit of"), ("recurse", "recursed too deeply")])
def test_the_server_answers_a_failing_template_in_each_apis_shape_and_serves_on(
        server: ServerThread, hostile: Path, content: str, says: str) -> None:
    ask = {"model": str(hostile), "messages": [{"role": "user", "content": content}]}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        r = client.post("/v1/chat/completions", json={**ask, "max_tokens": 1})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and says in error["message"] and AT_FAULT in error["message"]
        r = client.post("/api/chat", json={**ask, "stream": False, "options": {"num_predict": 1}})
        assert r.status_code == 400, r.text
        assert says in r.json()["error"] and AT_FAULT in r.json()["error"]
        r = client.post("/api/chat", json={**ask, "messages": [{"role": "user", "content": "hi"}], "stream": False,
                                           "options": {"num_predict": 1}})
        assert r.status_code == 200 and r.json()["done"], r.text
