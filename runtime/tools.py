"""Tool calling: how a model writes a call, the grammar that holds it to ``tool_choice``, and the
reply parsed back into calls.

The call syntax comes from the model's chat template (what the model was trained to write):

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Qwen2.5,
  Qwen3, Hermes); also the generic form below;
* ``llama3``: the reply is ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3);
* ``mistral``: the ``[TOOL_CALLS]`` token, then ``[{"name": ..., "arguments": {...}}, ...]``;
* ``harmony`` (gpt-oss): a message of its own on the commentary channel addressed to the function,
  ``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``;
  ``<|call|>`` ends the reply, so a reply holds one call (the template renders one per message).
  Its channels (analysis: thinking; final and commentary: the answer) are told apart by
  :class:`runtime.textstream.ThinkingSplitter`, which passes a message with a recipient on whole.

A template that takes no ``tools`` (SmolLM2's, Gemma 3's) gets the **generic** form: the tools are
described in a system message (:func:`tools_system_prompt`) and calls are written in the hermes form.

``tool_choice`` is enforced by a grammar (:func:`call_grammar`): "required" and a named function allow
nothing but calls (of that function); "auto" allows text, or calls once the reply opens one, each call
held to its function's parameter schema; "none" sends no tools at all.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from localllm.errors import LocalLLMError
from localllm.runtime.constrain import JSON_WHITESPACE, Grammar, json_schema
from localllm.runtime.textstream import template_channels

HERMES, LLAMA3, MISTRAL, HARMONY = "hermes", "llama3", "mistral", "harmony"
#: Harmony's message tokens (special tokens: a reply in it is decoded with them, see
#: :func:`runtime.textstream.template_channels`).
START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN = (
    "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON Schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def spec(self) -> dict[str, Any]:
        """As chat templates and the APIs take it: ``{"type": "function", "function": {...}}``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclass(frozen=True)
class CallSyntax:
    """How one model writes calls. ``generic``: its template takes no tools (they go in a system
    message); ``marker_id``: the token that opens calls, where the syntax has one (mistral)."""

    kind: str
    generic: bool = False
    marker_id: int | None = None

    @property
    def opener(self) -> str:
        """Text a call starts with (as decoded: special tokens left out, but for harmony's)."""
        return {HERMES: "<tool_call>", LLAMA3: "{", MISTRAL: "[", HARMONY: START + "assistant"}[self.kind]

    @property
    def inline(self) -> bool:
        """Whether a call may follow text (its opener is a token of its own), not only open the reply."""
        return self.kind in (HERMES, HARMONY)


def call_syntax(template: str | None, token_to_id: Any) -> CallSyntax:
    """The syntax ``template`` (the model's chat template source) trains its model to call in."""
    text = template or ""
    if template_channels(text) and token_to_id(CHANNEL) is not None:
        return CallSyntax(HARMONY)
    if "[TOOL_CALLS]" in text and token_to_id("[TOOL_CALLS]") is not None:
        return CallSyntax(MISTRAL, marker_id=token_to_id("[TOOL_CALLS]"))
    if "<tool_call>" in text:
        return CallSyntax(HERMES)
    if "<|python_tag|>" in text or ("ipython" in text and "parameters" in text):
        return CallSyntax(LLAMA3)
    return CallSyntax(HERMES, generic=True)


def reply_stop_ids(syntax: CallSyntax, token_to_id: Any) -> list[int]:
    """Tokens that end a reply in ``syntax`` beside the model's end tokens: harmony's ``<|return|>``
    (after the final answer) and ``<|call|>`` (after a call), not ``<|end|>`` (which ends one of the
    reply's messages: its thinking, a preamble)."""
    if syntax.kind != HARMONY:
        return []
    return [i for i in (token_to_id(RETURN), token_to_id(CALL)) if i is not None]


def tools_system_prompt(tools: Sequence[Tool]) -> str:
    """The generic form's instructions: each tool as JSON, and how to call."""
    listed = "\n".join(json.dumps(t.spec()["function"], ensure_ascii=False) for t in tools)
    return ("You can call these tools (each one's arguments follow its JSON Schema):\n"
            f"{listed}\n"
            "To call a tool, reply with only <tool_call>{\"name\": TOOL NAME, \"arguments\": {ARGUMENTS}}</tool_call>, "
            "one block per call. Otherwise, answer normally.")


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others where it does not say
    (``additionalProperties: false``), as llama.cpp's grammars do: a call's arguments are the
    function's parameters, and a small model otherwise pads them with keys of its own."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    # allOf's parts each list some properties of one object: closing each would refuse the others'
    out = {k: (v if k == "allOf" else closed(v)) for k, v in schema.items()}
    if isinstance(schema.get("properties"), Mapping):
        out["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def _body_schema(syntax: CallSyntax, tools: Sequence[Tool]) -> dict[str, Any]:
    key = "parameters" if syntax.kind == LLAMA3 else "arguments"
    variants = [{"type": "object", "properties": {"name": {"const": t.name}, key: closed({"type": "object", **t.parameters})},
                 "required": ["name", key], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def call_grammar(syntax: CallSyntax, tools: Sequence[Tool], choice: str | None, parallel: bool = True) -> Grammar:
    """What a reply may be, for ``choice`` "auto" (text, or calls), "required" (calls) or a tool's name
    (calls of it). Raises LocalLLMError when a tool's parameters are a schema that cannot be enforced."""
    if choice not in ("auto", "required") and not any(t.name == choice for t in tools):
        raise LocalLLMError(f"tool_choice names {choice!r}, which is not among the tools", "name one of the tools")
    allowed = [t for t in tools if t.name == choice] if choice not in ("auto", "required") else list(tools)
    for t in allowed:  # a schema llguidance cannot enforce is refused by name, not left loose
        json_schema(t.parameters, where=f"tools[{tools.index(t)}].function.parameters")
    if syntax.kind == HARMONY:
        return _compiled(_harmony_lark(allowed, choice))
    body = json.dumps(_body_schema(syntax, allowed))
    if syntax.kind == HERMES:
        calls = 'call (WS? call)*' if parallel else 'call'
        rules = f'calls: {calls}\ncall: "<tool_call>" WS? body WS? "</tool_call>"\n'
        text = r"/[^<](.|\n)*/"
    elif syntax.kind == LLAMA3:
        rules = "calls: body\n"
        text = r"/[^{](.|\n)*/"
    else:
        array = {"type": "array", "items": json.loads(body), "minItems": 1, **({} if parallel else {"maxItems": 1}),
                 "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
        rules = f"calls: marker WS? %json {json.dumps(array)}\nmarker: <[{syntax.marker_id}]>\n"
        text = r"/[^\[](.|\n)*/"
    start = "start: calls\n" if choice != "auto" else "start: TEXT | calls\n"
    return _compiled(f"{start}{rules}body: %json {body}\nTEXT: {text}\nWS: /[ \\t\\n]+/\n")


def _harmony_lark(tools: Sequence[Tool], choice: str | None) -> str:
    """Harmony's reply after its thinking (:func:`runtime.constrain.after_thinking` puts that first):
    one call, a message to the function on the commentary channel with its arguments held to the
    schema (``<|call|>`` then ends the reply), or for "auto" also a final message of free text."""
    space = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    names = [f'call{i}: {CHANNEL} {json.dumps(f"commentary to=functions.{t.name} ")} {CONSTRAIN} "json" {MESSAGE} '
             f'%json {json.dumps({**closed({"type": "object", **t.parameters}), **space})}'
             for i, t in enumerate(tools)]
    calls = "calls: " + " | ".join(f"call{i}" for i in range(len(tools)))
    start = "start: calls\n" if choice != "auto" else f'start: final | calls\nfinal: {CHANNEL} "final" {MESSAGE} TEXT\n'
    return start + calls + "\n" + "\n".join(names) + "\nTEXT: /(.|\\n)*/\n"


def _compiled(lark: str) -> Grammar:
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_lark(lark)
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise LocalLLMError(f"the tools do not make a grammar: {messages[0] if messages else 'invalid'}",
                            "check each tool's parameters schema")
    return Grammar(grammar, "the tools' call grammar")


def parse_calls(syntax: CallSyntax, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """A reply as (its text outside calls, or None when there is none; its complete calls).

    Text the model wrote toward a call that it did not complete is left out, never shown as text: a
    ``<tool_call>`` block that is never closed, and a JSON call (llama3) or call array (mistral) that
    ends before its value does (the array's complete calls are kept). ``cut``: the reply was cut short
    (``max_tokens``), so a tail that could still have become a call's opener is left out too. A block
    that is closed but does not hold a call, and text that never opened one, stay text."""
    if syntax.kind == HERMES:
        return _parse_hermes(text, cut, syntax.opener)
    if syntax.kind == HARMONY:
        return _parse_harmony(text, cut, syntax.opener)
    body = text.strip()
    if syntax.kind == LLAMA3:
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        if _unfinished_json(body):
            return None, []
        call = _call(body, "parameters")
        return (None, [call]) if call is not None else (text, [])
    body = body.removeprefix("[TOOL_CALLS]").strip()
    if not body.startswith("["):
        return text, []
    items, complete = _json_items(body)
    parsed = [_call(json.dumps(i), "arguments") for i in items]
    if not complete:  # cut inside the array: its complete calls, and no text
        return None, [c for c in parsed if c is not None]
    if parsed and all(c is not None for c in parsed):
        return None, parsed  # type: ignore[return-value]
    return text, []


def _parse_hermes(text: str, cut: bool, opener: str) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    rest = []
    last = 0
    for m in re.finditer(r"<tool_call>\s*((?:(?!<tool_call>).)*?)\s*</tool_call>", text, re.S):
        call = _call(m.group(1), "arguments")
        if call is not None:
            rest.append(text[last : m.start()])
            calls.append(call)
        else:  # closed, but no call: it stays text
            rest.append(text[last : m.end()])
        last = m.end()
    tail = text[last:]
    unclosed = tail.find(opener)
    if unclosed >= 0:  # a block opened and never closed: toward a call, not text
        tail = tail[:unclosed]
    elif cut:
        tail = tail[: len(tail) - _opener_prefix(tail, opener)]
    rest.append(tail)
    content = "".join(rest).strip()
    return (content or None), calls


def _parse_harmony(text: str, cut: bool, opener: str) -> tuple[str | None, list[ToolCall]]:
    """Each message from ``opener`` on is a call: ``HEADER<|message|>ARGUMENTS`` up to ``<|call|>`` or
    ``<|end|>`` (or the reply's end: ``<|call|>`` is a stop token, never decoded). Its recipient
    ``to=functions.NAME`` names the function; a header never finished, arguments that are not one
    whole JSON object, and a recipient that is not a function (a built-in tool's) are left out, never
    text. Text after a message's end is text (a final answer after a call)."""
    pieces = text.split(opener)
    rest, calls = [pieces[0]], []
    for piece in pieces[1:]:
        header, marked, body = piece.partition(MESSAGE)
        ends = [at for at in (body.find(END), body.find(CALL)) if at >= 0]
        end = min(ends) if ends else len(body)
        after = body[end + len(CALL if body.startswith(CALL, end) else END):] if ends else ""
        name = re.search(r"\bto=functions\.([^\s<]+)", header)
        if marked and name:
            try:
                args = json.loads(body[:end])
            except json.JSONDecodeError:
                args = None
            if isinstance(args, dict):
                calls.append(ToolCall(name.group(1), args))
        rest.append(after)
    if cut:
        rest[-1] = rest[-1][: len(rest[-1]) - _opener_prefix(rest[-1], opener)]
    content = "".join(rest).strip()
    return (content or None), calls


def _opener_prefix(text: str, opener: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``opener`` (0: none)."""
    return next((n for n in range(min(len(text), len(opener) - 1), 0, -1) if opener.startswith(text[-n:])), 0)


def _json_items(body: str) -> tuple[list[Any], bool]:
    """A JSON array's items as far as they are complete, and whether the array itself is (a reply cut
    inside its third call still has its first two)."""
    try:
        value = json.loads(body)
        return (value, True) if isinstance(value, list) else ([], True)
    except json.JSONDecodeError:
        pass
    if not _unfinished_json(body):
        return [], True  # malformed, not cut: text
    decoder, items, i = json.JSONDecoder(), [], 1
    while True:
        while i < len(body) and body[i] in " \t\r\n,":
            i += 1
        try:
            item, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return items, False
        items.append(item)


def _unfinished_json(body: str) -> bool:
    """Whether ``body`` ends inside a JSON value it opened: in a string, or with a bracket open."""
    depth, in_string, escaped = 0, False, False
    for ch in body:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return False  # the value closed (what follows it, if anything, is not a call)
    return in_string or depth > 0


def _call(body: str, key: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def generic_history(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """A conversation for a template that takes no tools: the tools' system prompt first (joined to
    the conversation's own system message), earlier calls written as the assistant wrote them, and
    tool results as user turns in ``<tool_response>`` blocks."""
    out: list[dict[str, Any]] = []
    prompt = tools_system_prompt(tools) if tools else ""
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            written = "".join("<tool_call>" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": c["function"]["arguments"]}) + "</tool_call>"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + written) if content else written})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if prompt:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def one_call_each(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """A conversation as harmony's template takes it: an assistant message with several calls as one
    message per call, each followed by its result (the template renders a message's first call only,
    and names a tool result after the call before it). Results are matched to calls by
    ``tool_call_id`` where they carry one, else in order."""
    out: list[Mapping[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") or []
        if m["role"] != "assistant" or len(calls) < 2:
            out.append(m)
            i += 1
            continue
        j = i + 1
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        results = list(messages[i + 1 : j])
        for k, call in enumerate(calls):
            out.append({**m, "content": m.get("content") if k == 0 else "", "tool_calls": [call]})
            match = next((r for r in results if call.get("id") is not None and r.get("tool_call_id") == call.get("id")),
                         results[0] if results else None)
            if match is not None:
                results.remove(match)
                out.append(match)
        out += results
        i = j
    return out


def encode_tool_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool],
                     syntax: CallSyntax, **extra: Any) -> list[int]:
    """A conversation's token ids with ``tools`` offered: through the template's own ``tools`` where it
    takes them, else in the generic form (:func:`generic_history`, also for a history of calls when
    no tools are offered now)."""
    from localllm.runtime.chat import encode_chat

    if syntax.generic:
        return encode_chat(tokenizer, generic_history(messages, tools), **extra)
    if syntax.kind == HARMONY:
        messages = one_call_each(messages)
    return encode_chat(tokenizer, messages, tools=[t.spec() for t in tools] or None, **extra)


class ReplySplitter:
    """A streamed reply told apart as it comes: text is passed on as soon as it cannot be the start of
    a call; from a call's opener on, the reply is held to its end and parsed (:meth:`finish`). A tail
    of text that could be the start of an opener is held back until the next piece decides it. With a
    forced choice ("required", a name) every reply is calls.

    Where the opener is a token of its own (hermes' ``<tool_call>``), a call may follow text; where it
    is JSON's first character (llama3's ``{``, mistral's ``[`` after its marker token), only a reply
    that starts with it is a call."""

    def __init__(self, syntax: CallSyntax, forced: bool) -> None:
        self.syntax = syntax
        self.mode: str | None = "calls" if forced else None  # None (undecided) -> "text" or "calls"
        self.held = ""

    def feed(self, text: str) -> str:
        """The part of ``text`` to show now."""
        opener = self.syntax.opener
        if self.mode == "text" and not self.syntax.inline:
            return text
        self.held += text
        if self.mode == "calls":
            return ""
        if self.mode is None:
            start = self.held.lstrip()
            if len(start) < len(opener) and opener.startswith(start):
                return ""  # could still open a call
            if start.startswith(opener):
                self.mode = "calls"
                return ""
            self.mode = "text"
            if not self.syntax.inline:
                out, self.held = self.held, ""
                return out
        found = self.held.find(opener)  # text, where a call may still follow
        if found >= 0:
            out, self.held, self.mode = self.held[:found], self.held[found:], "calls"
            return out
        keep = _opener_prefix(self.held, opener)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """What was held: its text and its complete calls. What was written toward a call that did not
        complete is left out; ``cut`` (the reply was cut short, as by ``max_tokens``): so is a held tail
        that could have begun an opener, which a reply that ended by itself shows as the text it is."""
        held, self.held = self.held, ""
        if not held:
            return "", []
        if self.mode == "text":  # a tail that may begin an opener
            return ("" if cut else held), []
        if self.mode is None and not cut and not held.strip():
            return held, []
        content, calls = parse_calls(self.syntax, held, cut=True)  # undecided or calls: the reply opened one
        return content or "", calls
