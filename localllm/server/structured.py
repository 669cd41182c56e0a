"""Structured outputs: the request fields that ask for JSON, as the grammar the reply is held to
(:mod:`runtime.constrain`). A schema that cannot be enforced is a 400 naming the keyword and where it
is, never a reply left unconstrained."""

from __future__ import annotations

from typing import Any

from localllm.errors import LocalLLMError
from localllm.runtime.constrain import Grammar, any_json_object, json_schema
from localllm.server.errors import ApiError


def _schema(schema: Any, where: str) -> Grammar:
    try:
        return json_schema(schema, where=where)
    except LocalLLMError as e:
        raise ApiError(400, e.one_line(), param=where) from None


def openai_response_format(value: Any) -> Grammar | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (free), ``{"type": "json_object"}`` (any
    object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``. ``strict``
    false is enforced too: a schema given is a schema kept."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "'response_format' must be an object such as {\"type\": \"json_object\"}",
                       param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return any_json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError(400, "'response_format.json_schema' must be an object with 'name' and 'schema'",
                           param="response_format.json_schema")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'response_format.json_schema.name' is required (a string)",
                           param="response_format.json_schema.name")
        if "schema" not in spec:  # OpenAI's default: any object
            return any_json_object()
        return _schema(spec["schema"], "response_format.json_schema.schema")
    raise ApiError(400, f"'response_format.type' is {kind!r}; use 'text', 'json_object' or 'json_schema'",
                   param="response_format.type")


def ollama_format(value: Any) -> Grammar | None:
    """Ollama's ``format``: ``"json"`` (any object) or a JSON Schema object; "" or absent: free text."""
    if value is None or value == "":
        return None
    if value == "json":
        return any_json_object()
    if isinstance(value, dict):
        return _schema(value, "format")
    raise ApiError(400, "'format' must be \"json\" or a JSON Schema object", param="format")
