"""gpt-oss's "harmony" format through the thinking and tool-call machinery: the syntax read from the
chat template, replies split into thinking (analysis), answer (final, commentary) and calls
(commentary to=functions.NAME) whole and streamed at every cut without leaking a call's text, the
stop tokens, the tool_choice grammars, and prompts rendered by gpt-oss's own template (its message
logic verbatim, the tool namespace shortened: openai/gpt-oss-20b's chat_template.jinja, Apache-2.0)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from localllm.runtime.constrain import Constraints, after_thinking
from localllm.runtime.tokenizer import Tokenizer
from localllm.runtime.tools import (HARMONY, CallSyntax, ReplySplitter, Tool, call_grammar, call_syntax,
                                    encode_tool_chat, parse_calls, reply_stop_ids)
from localllm.server.replies import ReplyShape, prepare_chat
from localllm.server.tool_calls import ToolAsk

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

#: gpt-oss's template: the system message (reasoning effort), the developer message (tools, their
#: namespace shortened to one line each), and the messages' rendering as the original writes it.
TEMPLATE = """{%- macro render_tool_namespace(namespace_name, tools) -%}
{{- "## " + namespace_name + "\\n\\nnamespace " + namespace_name + " {\\n\\n" }}
{%- for tool in tools %}{%- set tool = tool.function %}
{{- "// " + tool.description + "\\ntype " + tool.name + " = (_: " + tool.parameters|tojson + ") => any;\\n\\n" }}
{%- endfor %}
{{- "} // namespace " + namespace_name }}
{%- endmacro -%}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n" }}
{%- if reasoning_effort is not defined %}{%- set reasoning_effort = "medium" %}{%- endif %}
{{- "Reasoning: " + reasoning_effort + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- if tools -%}{{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif -%}
{{- "<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer_message %}{{- "# Instructions\\n\\n" }}{{- developer_message }}{%- endif %}
    {%- if tools -%}{{- "\\n\\n# Tools\\n\\n" }}{{- render_tool_namespace("functions", tools) }}{%- endif -%}
    {{- "<|end|>" }}
{%- endif %}
{%- set last_tool_call = namespace(name=none) %}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if "content" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.content or "<|channel|>final<|message|>" in message.content %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the content field.") }}
            {%- endif %}
        {%- endif %}
        {%- if "tool_calls" in message %}
            {%- set future_final_message = namespace(found=false) %}
            {%- for future_message in loop_messages[loop.index:] %}
                {%- if future_message.role == 'assistant' and "tool_calls" not in future_message %}
                    {%- set future_final_message.found = true %}
                {%- endif %}
            {%- endfor %}
            {%- set tool_call = message.tool_calls[0] %}
            {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
            {%- if message.content and message.thinking %}
                {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls!") }}
            {%- elif message.content and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" }}
            {%- elif message.thinking and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=" }}
            {{- "functions." + tool_call.name + "<|channel|>commentary " }}
            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
            {{- tool_call.arguments|tojson }}
            {{- "<|call|>" }}
            {%- set last_tool_call.name = tool_call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
            {%- set last_tool_call.name = none %}
        {%- endif %}
    {%- elif message.role == 'tool' -%}
        {%- if last_tool_call.name is none %}
            {{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
        {%- endif %}
        {{- "<|start|>functions." + last_tool_call.name }}
        {{- " to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>" }}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}"""

WEATHER = Tool("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]})
CLOCK = Tool("get_time", "The time in a zone", {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                                 "required": ["utc"]})
SYNTAX = CallSyntax(HARMONY)
THINKING = "The user wants two cities. Call twice."
#: A reply as decoded (special tokens kept): thinking, a preamble on the commentary channel, then two
#: calls (the recipient in the channel's header, then in the role's, as harmony allows both); the
#: first ends in <|call|>, the second where the stop token cut the text.
REPLY = (f"<|channel|>analysis<|message|>{THINKING}<|end|>"
         "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
         '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
         '{"city": "Paris", "unit": "celsius"}<|call|>'
         '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
         '{"city": "Rome", "unit": "celsius"}')
FINAL = f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>final<|message|>It is 21 C."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE vocabulary with no merges and harmony's special tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {"<unk>": 0, "<|endoftext|>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return Tokenizer(tok, bos_id=None, eos_ids=[tok.token_to_id("<|return|>")], add_bos=False,
                     chat_template=TEMPLATE)


def test_the_syntax_and_its_stops_come_from_the_template(tokenizer):
    syntax = call_syntax(TEMPLATE, tokenizer.token_to_id)
    assert syntax == SYNTAX and syntax.inline
    stops = reply_stop_ids(syntax, tokenizer.token_to_id)
    assert stops == [tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>")]
    assert tokenizer.token_to_id("<|end|>") not in stops  # ends a message, not the reply
    assert call_syntax(TEMPLATE, {}.get).kind != HARMONY  # a vocabulary without its tokens: not harmony


def whole(text: str, cut: bool, forced: bool = False, tools: bool = True) -> tuple[str, str, list[tuple]]:
    shape = ReplyShape(True, False, ReplySplitter(SYNTAX, forced) if tools else None, harmony=True)
    thinking, answer, calls = shape.whole(text, cut)
    return thinking, answer, [(c.name, c.arguments["city"]) for c in calls]


def streamed(text: str, cuts: list[int], cut: bool, tools: bool = True) -> tuple[str, str, list[tuple]]:
    shape = ReplyShape(True, False, ReplySplitter(SYNTAX, False) if tools else None, harmony=True)
    bounds = [0, *cuts, len(text)]
    parts = [p for a, b in zip(bounds, bounds[1:]) for p in shape.feed(text[a:b])]
    rest, calls = shape.finish(cut)
    parts += rest
    return ("".join(t for k, t in parts if k == "thinking"), "".join(t for k, t in parts if k == "answer"),
            [(c.name, c.arguments["city"]) for c in calls])


def test_a_reply_splits_into_thinking_text_and_calls():
    assert whole(REPLY, cut=False) == (THINKING, "Checking.", [("get_weather", "Paris"), ("get_weather", "Rome")])
    assert whole(FINAL, cut=False) == (THINKING, "It is 21 C.", [])
    assert whole(FINAL, cut=False, tools=False) == (THINKING, "It is 21 C.", [])
    assert whole("Plain words.", cut=False) == ("", "Plain words.", [])  # no header: the answer's text
    # a message whose end token the model left out ends where the next one starts
    assert whole(FINAL.replace("<|end|>", ""), cut=False) == (THINKING, "It is 21 C.", [])
    assert whole(REPLY.replace("<|call|>", "") + "<|start|>assistant<|channel|>final<|message|>Done.", cut=False) \
        == (THINKING, "Checking.Done.", [("get_weather", "Paris"), ("get_weather", "Rome")])
    content, calls = parse_calls(SYNTAX, '<|start|>assistant to=functions.get_time<|channel|>commentary json'
                                         '<|message|>{"utc": true}<|call|>After.')
    assert content == "After." and [(c.name, c.arguments) for c in calls] == [("get_time", {"utc": True})]
    # a built-in tool's recipient is no function call, and never text
    assert parse_calls(SYNTAX, '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"q": 1}') \
        == (None, [])


def test_every_cut_of_a_reply_with_calls_leaks_nothing_and_keeps_its_complete_calls(tokenizer):
    """Cut (finish reason "length") after each token: the thinking so far, the preamble as far as it
    went, never a byte of a call's header or arguments, and exactly the calls whose arguments are
    complete; streamed in two pieces split at any token, the same."""
    ids = tokenizer.encode(REPLY, add_special=False)
    paris = REPLY.index("<|call|>")
    for end in range(len(ids) + 1):
        text = tokenizer.decode(ids[:end])
        thinking, answer, calls = whole(text, cut=True)
        assert THINKING.startswith(thinking), text
        assert "Checking.".startswith(answer), text
        if text.startswith(REPLY[: REPLY.index("<|start|>assistant<|channel|>commentary to=")]):
            assert (thinking, answer) == (THINKING, "Checking."), text
        want = [("get_weather", "Paris")] if len(text) >= paris else []  # its arguments whole
        if end == len(ids):
            want.append(("get_weather", "Rome"))
        assert calls == want, text
        for at in range(0, end + 1, 3):
            pieces = (tokenizer.decode(ids[:at]), tokenizer.decode(ids[at:end]))
            assert streamed("".join(pieces), [len(pieces[0])], cut=True) == (thinking, answer, calls), (text, at)


def test_streamed_pieces_equal_the_whole_reply_at_every_two_cuts():
    for text in (FINAL, REPLY):
        want = whole(text, cut=False)
        for i in range(0, len(text) + 1, 3):
            for j in range(i, len(text) + 1, 5):
                assert streamed(text, [i, j], cut=False) == want, (text, i, j)
    want = whole(FINAL, cut=False, tools=False)
    for i in range(len(FINAL) + 1):
        assert streamed(FINAL, [i], cut=False, tools=False) == want, i


def walk(tokenizer: Tokenizer, grammar, seed: int, limit: int = 400) -> str:
    """A reply made by picking allowed tokens at random (as a random-weight model would), until the
    grammar is complete: text as the server decodes it (special tokens kept)."""
    constraint = Constraints(tokenizer, reply_stop_ids(SYNTAX, tokenizer.token_to_id)).start(grammar)
    import torch

    rng = random.Random(seed)
    mask = torch.zeros(1, constraint.words, dtype=torch.int32)
    ids: list[int] = []
    special = {tokenizer.token_to_id(s) for s in SPECIALS}
    while not constraint.done and len(ids) < limit:
        constraint.fill(mask, [])
        bits = mask[0].numpy().view("uint32")
        allowed = [i for i in range(tokenizer.vocab_size) if bits[i // 32] >> (i % 32) & 1]
        stops = [i for i in allowed if i in reply_stop_ids(SYNTAX, tokenizer.token_to_id)]
        if stops and rng.random() < 0.3 or not allowed:
            break
        # prefer the grammar's special tokens and closing bytes, as a model would (else random text is long)
        preferred = [i for i in allowed if i in special or tokenizer.decode([i]) in '"}']
        token = rng.choice(preferred if preferred and rng.random() < 0.5 else allowed)
        if token in stops:
            break
        assert constraint.take(token), constraint.error
        ids.append(token)
    return tokenizer.decode(ids)


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_forced_choice_makes_a_call_whose_arguments_validate(tokenizer, choice):
    grammar = after_thinking(call_grammar(SYNTAX, [WEATHER, CLOCK], choice), opened=False, harmony=True)
    for seed in range(6):
        text = walk(tokenizer, grammar, seed)
        thinking, answer, calls = ReplyShape(True, False, ReplySplitter(SYNTAX, True), harmony=True).whole(text)
        assert answer == "" and len(calls) == 1, text
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[calls[0].name]
        assert choice == "required" or calls[0].name == choice
        jsonschema.validate(calls[0].arguments, tool.parameters)


def test_auto_allows_a_final_answer_or_a_call_and_refuses_text_outside_them(tokenizer):
    grammar = after_thinking(call_grammar(SYNTAX, [WEATHER], "auto"), opened=False, harmony=True)
    constraints = Constraints(tokenizer, reply_stop_ids(SYNTAX, tokenizer.token_to_id))
    for text, ok in [(FINAL, True),
                     ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                      '{"city": "Oslo", "unit": "celsius"}', True),
                     ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                      '{"city": "Oslo", "unit": "kelvin"}', False),
                     ("Plain words.", False)]:
        c = constraints.start(grammar)
        took = all(c.take(i) for i in tokenizer.encode(text, add_special=False))
        assert took == ok, text


def test_prompts_render_calls_results_and_reasoning_effort(tokenizer):
    """Two calls in one assistant message render as two harmony calls, each followed by its own
    result (the template renders one call per message, and names a result after the call before it)."""
    messages = [{"role": "user", "content": "Weather in Paris and the time?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": {"city": "Paris", "unit": "celsius"}}},
                    {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"utc": True}}}]},
                {"role": "tool", "tool_call_id": "b", "content": "12:00"},
                {"role": "tool", "tool_call_id": "a", "content": "21 C"}]
    text = tokenizer.decode(encode_tool_chat(tokenizer, messages, [WEATHER, CLOCK], SYNTAX))
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris", "unit": "celsius"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"21 C"<|end|>'
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"utc": true}<|call|>'
            '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"12:00"<|end|>') in text
    assert text.endswith("<|start|>assistant") and "type get_weather" in text
    for think, effort, level in [(None, None, "medium"), (False, None, "low"), (True, "high", "high")]:
        ids, grammar, shape = prepare_chat(tokenizer, messages[:1], None, None, think, effort=effort)
        assert f"Reasoning: {level}\n" in tokenizer.decode(ids) and grammar is None
        assert shape.whole(FINAL)[:2] == (THINKING, "It is 21 C.")
    ids, grammar, _ = prepare_chat(tokenizer, messages[:1], ToolAsk([WEATHER], "required", True), None, None)
    assert grammar is not None and json.loads(grammar.text)["grammars"][0]["lark_grammar"].startswith(
        'start: (<|channel|> "analysis"')



def test_a_format_holds_the_final_message_and_a_budget_closes_the_thinking(tokenizer):
    """response_format on harmony: the final message's text is the JSON (after free thinking); a
    thinking budget ends the analysis message after that many tokens."""
    from localllm.runtime.constrain import json_schema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    ask = [{"role": "user", "content": "ok?"}]
    for seed in range(4):
        _, grammar, shape = prepare_chat(tokenizer, ask, None, json_schema(schema), None)  # a shape per reply
        text = walk(tokenizer, grammar, seed)
        thinking, answer, calls = shape.whole(text)
        assert calls == [] and "<|" not in thinking, text
        jsonschema.validate(json.loads(answer), schema)
    _, grammar, _ = prepare_chat(tokenizer, ask, None, None, None, budget=5)
    constraint = Constraints(tokenizer, reply_stop_ids(SYNTAX, tokenizer.token_to_id)).start(grammar)
    head = tokenizer.encode("<|channel|>analysis<|message|>abcde", add_special=False)
    assert all(constraint.take(i) for i in head)
    assert not constraint.take(tokenizer.encode("f", add_special=False)[0])  # the sixth thinking token
    constraint = Constraints(tokenizer, reply_stop_ids(SYNTAX, tokenizer.token_to_id)).start(grammar)
    assert all(constraint.take(i) for i in tokenizer.encode(FINAL.replace(THINKING, "abc"), add_special=False))

@pytest.fixture(scope="module")
def gpt_oss_style(tiny_folder, tmp_path_factory):
    """The tiny llama's folder with harmony's special tokens in its vocabulary and the template above
    (its context widened: random weights care for no trained length)."""
    import shutil

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    _, folder = tiny_folder("llama")
    own = tmp_path_factory.mktemp("harmony") / "harmony"
    shutil.copytree(folder, own)
    tok = HFTokenizer.from_file(str(own / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(own / "tokenizer.json"))
    config = json.loads((own / "tokenizer_config.json").read_text())
    (own / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE, "eos_token": "<|return|>"}))
    model = json.loads((own / "config.json").read_text())
    (own / "config.json").write_text(json.dumps({**model, "max_position_embeddings": 2048}))
    return own


def test_openai_forced_calls_through_the_server(gpt_oss_style, tmp_path_factory):
    """Through HTTP and the openai client on a random-weight model with harmony's tokens: a forced
    call, whole and streamed, is a call of the tool with valid arguments (finish reason "tool_calls"),
    or a reply cut by max_tokens in its thinking or call; never any text, never a header."""
    openai = pytest.importorskip("openai")
    from localllm.server.config import ServerConfig
    from tests.server_fixtures import running_server

    tool = {"type": "function", "function": {"name": WEATHER.name, "description": WEATHER.description,
                                             "parameters": dict(WEATHER.parameters)}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("harmony-home")))
        with running_server(ServerConfig(parallel=2, kv_memory=16 << 20, quant="fp32", device="cpu",
                                         allow_local_paths=True)) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
            made = 0
            for seed in range(2):
                ask = {"model": str(gpt_oss_style), "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                       "tools": [tool], "tool_choice": "required", "temperature": 1.0, "seed": seed,
                       "max_tokens": 300}
                whole = client.chat.completions.create(**ask).choices[0]
                with client.chat.completions.stream(**ask) as stream:
                    streamed = stream.get_final_completion().choices[0]
                for choice in (whole, streamed):
                    assert not choice.message.content, choice
                    assert "<|" not in (getattr(choice.message, "reasoning_content", None) or ""), choice
                    if choice.finish_reason == "tool_calls":
                        (call,) = choice.message.tool_calls
                        assert call.function.name == "get_weather"
                        jsonschema.validate(json.loads(call.function.arguments), WEATHER.parameters)
                        made += 1
                    else:
                        assert choice.finish_reason == "length" and not choice.message.tool_calls, choice
                assert whole.finish_reason == streamed.finish_reason
            assert made >= 2  # a call needs the thinking to end (measured: 70-180 characters, at seeds 0-3)


def test_requests_effort_levels_reach_the_template(gpt_oss_style, tmp_path_factory):
    """Chat completions' reasoning_effort, Ollama's think level and Responses' reasoning.effort reach
    harmony's template as its ``Reasoning:`` line: each reply's prompt is as long as the prompt the
    template renders with that level (never the default's, medium, which true/false would give)."""
    openai = pytest.importorskip("openai")
    import httpx

    from localllm.server.config import ServerConfig
    from tests.server_fixtures import running_server

    tok = Tokenizer.from_folder(gpt_oss_style)
    chat = [{"role": "user", "content": "Weather in Oslo?"}]
    rendered = {level: prepare_chat(tok, chat, None, None, None, effort=level)[0]
                for level in ("low", "medium", "high")}
    assert "Reasoning: low" in tok.decode(rendered["low"])
    sizes = {level: len(ids) for level, ids in rendered.items()}
    assert sizes["low"] != sizes["medium"] != sizes["high"], sizes  # else the counts below tell nothing
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("harmony-home")))
        with running_server(ServerConfig(parallel=1, kv_memory=16 << 20, quant="fp32", device="cpu",
                                         allow_local_paths=True)) as server:
            model = str(gpt_oss_style)
            # Ollama's first: its prompt_eval_count leaves out the prefix cached by earlier requests
            ollama = httpx.post(f"{server.url}/api/chat", timeout=120, json={
                "model": model, "messages": chat, "think": "high", "stream": False, "options": {"num_predict": 1}})
            assert ollama.status_code == 200, ollama.text
            assert ollama.json()["prompt_eval_count"] == sizes["high"]
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
            reply = client.chat.completions.create(model=model, messages=chat, reasoning_effort="low", max_tokens=1)
            assert reply.usage.prompt_tokens == sizes["low"]
            responses = httpx.post(f"{server.url}/v1/responses", timeout=120, json={
                "model": model, "input": chat, "reasoning": {"effort": "high"}, "max_output_tokens": 1})
            assert responses.status_code == 200, responses.text
            assert responses.json()["usage"]["input_tokens"] == sizes["high"]
            off = client.chat.completions.create(model=model, messages=chat, reasoning_effort="none", max_tokens=1)
            assert off.usage.prompt_tokens == sizes["low"]  # gpt-oss always thinks: the least is low


def test_run_shows_harmony_thinking_on_stderr_and_the_final_message_alone(capsys):
    """``localllm run``'s answer_only with a harmony template: the analysis message between
    "Thinking..." lines on stderr, the final message's text alone on stdout, at every cut."""
    from localllm.commands.run import answer_only

    reply = FINAL + "<|return|>"
    for cut in range(len(reply) + 1):
        answer = "".join(answer_only(iter([reply[:cut], reply[cut:]]), True, harmony=True))
        err = capsys.readouterr().err
        assert answer == "It is 21 C.", (cut, answer)
        assert err == f"Thinking...\n{THINKING}\n...done thinking.\n\n", (cut, err)


def test_the_engine_decodes_harmony_headers_and_holds_a_format_to_the_final_message(gpt_oss_style):
    """Engine.chat (``localllm run``) with a harmony template: the reply keeps its headers (special
    tokens), <|return|> and <|call|> end it, and a format holds the final message (after an optional
    analysis one); the answer read from it has no header."""
    from localllm.commands.run import answer_only
    from localllm.loaders.load import load_model
    from localllm.runtime.constrain import json_schema
    from localllm.runtime.engine import Engine
    from localllm.runtime.sampling import SamplingParams

    lm = load_model(str(gpt_oss_style), quant="fp32")
    engine = Engine(lm.model, lm.tokenizer, ctx=1024)
    tok = lm.tokenizer
    assert engine.harmony and {tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")} <= set(engine.stop_ids)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    chat = [{"role": "user", "content": "A number?"}]
    finals = 0
    for seed in range(6):  # a seed may think past max_tokens (measured: 2 of seeds 0-2 reach the final)
        pieces = list(engine.chat(chat, SamplingParams(temperature=1.0, seed=seed), 120, grammar=json_schema(schema)))
        raw = "".join(pieces)
        assert raw.startswith("<|channel|>"), raw  # decoded with its special tokens, held to a message
        answer = "".join(answer_only(iter(pieces), False, engine.harmony))
        assert "<|" not in answer and "final" not in answer, raw
        head = "<|channel|>final<|message|>"
        if head in raw:
            finals += 1
            assert answer == raw.split(head, 1)[1], raw
    assert finals, "no seed reached the final message"


def test_run_no_think_asks_a_harmony_template_for_its_lowest_effort(gpt_oss_style, monkeypatch):
    """``run --no-think`` on gpt-oss: its template takes no ``enable_thinking``; thinking off is
    ``reasoning_effort: low``, as the server sends it (one mapping, runtime.chat.thinking_variables)."""
    from localllm.loaders.load import load_model
    from localllm.runtime.chat import encode_chat
    from localllm.runtime.engine import Engine
    from localllm.runtime.sampling import SamplingParams

    lm = load_model(str(gpt_oss_style), quant="fp32")
    engine = Engine(lm.model, lm.tokenizer, ctx=1024)
    seen: list[list[int]] = []
    monkeypatch.setattr(engine, "stream_ids", lambda ids, *a, **k: seen.append(list(ids)) or iter(()))
    chat = [{"role": "user", "content": "Hi"}]
    for think in (False, None, True):
        list(engine.chat(chat, SamplingParams(temperature=0), 4, think=think))
    low, default, on = seen
    assert low == encode_chat(lm.tokenizer, chat, reasoning_effort="low") and low != default
    assert on == default == encode_chat(lm.tokenizer, chat)  # thinking on: the template's default (medium)
