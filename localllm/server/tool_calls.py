"""Tool calling on the API: the request's tools and ``tool_choice``, the prompt that offers them
(the model's template, or the generic form), the grammar that enforces the choice, and calls in each
API's shape (:mod:`runtime.tools` does the model's side)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from localllm.runtime.tools import Tool, ToolCall
from localllm.server.errors import ApiError
from localllm.server.validate import tools as parse_tools


@dataclass(frozen=True)
class ToolAsk:
    """What a request offers: its tools and ``choice`` ("auto", "required", or a tool's name;
    ``tool_choice: "none"`` and no tools both make no ToolAsk)."""

    tools: list[Tool]
    choice: str
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def openai_tools(tools: Any, choice: Any, parallel: Any) -> ToolAsk | None:
    """OpenAI's ``tools``, ``tool_choice`` ("none", "auto", "required", or ``{"type": "function",
    "function": {"name"}}``) and ``parallel_tool_calls``."""
    offered = parse_tools(tools)
    if choice is None:
        choice = "auto" if offered else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
        choice = fn["name"]
        if not any(t.name == choice for t in offered):
            raise ApiError(400, f"'tool_choice' names {choice!r}, which is not among the tools", param="tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or a function", param="tool_choice")
    if choice != "none" and not offered:
        raise ApiError(400, f"'tool_choice' is {choice!r} but no 'tools' are given", param="tool_choice")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    if choice == "none":
        return None
    return ToolAsk(offered, choice, parallel is not False)


def ollama_tools(tools: Any) -> ToolAsk | None:
    """Ollama's ``tools`` (it has no ``tool_choice``: "auto")."""
    offered = parse_tools(tools)
    return ToolAsk(offered, "auto", True) if offered else None


def openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls]


def openai_call_deltas(calls: list[ToolCall]) -> list[list[dict[str, Any]]]:
    """Streamed calls as ``delta.tool_calls`` fragments, one chunk each: a call's id, type and name
    first, then its arguments."""
    out = []
    for i, c in enumerate(calls):
        out.append([{"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}])
        out.append([{"index": i, "function": {"arguments": json.dumps(c.arguments)}}])
    return out


def ollama_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]
