"""A request's JSON body, read with a size limit, and typed access to its fields: every mistake is a
400 naming the field and what it should be."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from localllm.runtime.tools import Tool
from localllm.server.errors import ApiError

_MISSING = object()


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past ``limit`` bytes (read no further), 400 if not a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared)} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 text") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {_kind(body)}")
    return body


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "infinite"  # JSON has neither; Python's json reads both
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


class Fields:
    """Typed getters over a JSON object; ``prefix`` names nested fields (``options.top_k``)."""

    def __init__(self, data: Mapping[str, Any], prefix: str = "") -> None:
        self.data = data
        self.prefix = prefix

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def _bad(self, key: str, want: str, value: Any) -> ApiError:
        return ApiError(400, f"'{self._name(key)}' must be {want}, not {_kind(value)}", param=self._name(key))

    def _get(self, key: str) -> Any:
        value = self.data.get(key, _MISSING)
        return _MISSING if value is None else value  # null = not given, as both APIs treat it

    def has(self, key: str) -> bool:
        return self._get(key) is not _MISSING

    def string(self, key: str, required: bool = False, default: str | None = None) -> str | None:
        value = self._get(key)
        if value is _MISSING:
            if required:
                raise ApiError(400, f"'{self._name(key)}' is required", param=self._name(key))
            return default
        if not isinstance(value, str):
            raise self._bad(key, "a string", value)
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is _MISSING:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value

    def integer(self, key: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
        value = self._get(key)
        if value is _MISSING:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, "an integer", value)
        self._range(key, value, minimum, maximum)
        return value

    def number(self, key: str, minimum: float | None = None, maximum: float | None = None) -> float | None:
        value = self._get(key)
        if value is _MISSING:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(key, "a number", value)
        self._range(key, value, minimum, maximum)
        return float(value)

    def _range(self, key: str, value: float, minimum: float | None, maximum: float | None) -> None:
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            lo = "" if minimum is None else f"at least {minimum:g}"
            hi = "" if maximum is None else f"at most {maximum:g}"
            want = " and ".join(p for p in (lo, hi) if p)
            raise ApiError(400, f"'{self._name(key)}' is {value:g}; it must be {want}", param=self._name(key))

    def obj(self, key: str) -> Fields | None:
        value = self._get(key)
        if value is _MISSING:
            return None
        if not isinstance(value, dict):
            raise self._bad(key, "an object", value)
        return Fields(value, f"{self._name(key)}.")

    def array(self, key: str) -> list[Any] | None:
        value = self._get(key)
        if value is _MISSING:
            return None
        if not isinstance(value, list):
            raise self._bad(key, "an array", value)
        return value

    def stop(self, key: str = "stop", most: int | None = None) -> list[str]:
        """A stop string or a list of them."""
        value = self._get(key)
        if value is _MISSING:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise self._bad(key, "a string or an array of strings", value)
        if most is not None and len(items) > most:
            raise ApiError(400, f"'{self._name(key)}' has {len(items)} strings; at most {most} are allowed",
                           param=self._name(key))
        return items

    def raw(self, key: str) -> Any:
        value = self._get(key)
        return None if value is _MISSING else value


def messages(value: Any, param: str = "messages") -> list[dict[str, Any]]:
    """Chat messages as ``{"role", "content"}`` with text content. OpenAI's content parts
    (``[{"type": "text", "text": ...}]``) are joined; any other part (images, audio) is refused."""
    if not isinstance(value, list):
        raise ApiError(400, f"'{param}' must be an array of messages, not {_kind(value)}", param=param)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"'{where}' must be an object with 'role' and 'content'", param=where)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"'{where}.role' must be a string", param=f"{where}.role")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"'{where}.content' may only hold text parts here "
                                   "({\"type\": \"text\", \"text\": ...}); this server runs text models",
                                   param=f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"'{where}.content' must be a string, not {_kind(content)}", param=f"{where}.content")
        if m.get("images"):
            raise ApiError(400, f"'{where}.images': this server runs text models only", param=f"{where}.images")
        message: dict[str, Any] = {"role": role, "content": content}
        if m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        for key in ("tool_call_id", "name", "tool_name"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, as chat templates take them: ``{"type": "function",
    "function": {"name", "arguments": object}}`` (OpenAI sends the arguments as a JSON string, Ollama
    as an object), with the call's id where there is one."""
    if not isinstance(value, list):
        raise ApiError(400, f"'{where}' must be an array of calls", param=where)
    calls = []
    for i, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"'{where}[{i}].function.name' is required", param=f"{where}[{i}]")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ApiError(400, f"'{where}[{i}].function.arguments' is not JSON", param=f"{where}[{i}]") from None
        if not isinstance(args, dict):
            raise ApiError(400, f"'{where}[{i}].function.arguments' must be a JSON object", param=f"{where}[{i}]")
        call: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        calls.append(call)
    return calls


def tools(value: Any, param: str = "tools") -> list[Tool]:
    """OpenAI/Ollama ``tools``: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, f"'{param}' must be an array of tools", param=param)
    out: list[Tool] = []
    for i, t in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ApiError(400, f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", param=where)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ApiError(400, f"'{where}.function.name' is required: letters, digits, '_', '.' or '-' (at most 64)",
                           param=f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ApiError(400, f"'{where}.function.parameters' must be a JSON Schema object",
                           param=f"{where}.function.parameters")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ApiError(400, f"'{where}.function.description' must be a string", param=f"{where}.function.description")
        if any(o.name == name for o in out):
            raise ApiError(400, f"'{where}.function.name': {name!r} is given twice", param=f"{where}.function.name")
        out.append(Tool(name, description, params))
    return out
