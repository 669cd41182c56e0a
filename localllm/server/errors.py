"""Errors as each API writes them: OpenAI's ``{"error": {"message", "type", "param", "code"}}``,
Ollama's ``{"error": "..."}`` and Anthropic's ``{"type": "error", "error": {"type", "message"}}``, with a 4xx status for anything a client caused and no traceback ever.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from starlette.responses import JSONResponse

from localllm.errors import LocalLLMError, StorageError
from localllm.runtime.scheduler import EngineBusy

log = logging.getLogger("localllm.server")

OPENAI = "openai"
OLLAMA = "ollama"
ANTHROPIC = "anthropic"

#: The paths that answer in Anthropic's shape: its Messages API.
ANTHROPIC_PREFIX = "/v1/messages"

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 413: "invalid_request_error", 503: "server_busy", 507: "server_error", 500: "server_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


@dataclass
class ApiError(Exception):
    """A request the server refuses: the HTTP status, a one-line message, the field at fault."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


class ModelNotFound(LocalLLMError):
    """A model name that names nothing: 404 in both APIs."""


def from_exception(e: BaseException) -> ApiError:
    """Any exception as the :class:`ApiError` a client sees. Ours become 4xx with their one line; an
    unexpected one is logged with its traceback and becomes a 500 that says only that."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, EngineBusy):
        retry = max(1, math.ceil(e.retry_after_s))
        return ApiError(503, e.one_line(), code="server_busy", headers={"Retry-After": str(retry)})
    if isinstance(e, ModelNotFound):
        return ApiError(404, e.one_line(), param="model", code="model_not_found")
    if isinstance(e, StorageError):  # the server's disk, not the request: 507 Insufficient Storage
        return ApiError(507, e.one_line(), code="insufficient_storage")
    if isinstance(e, LocalLLMError):
        return ApiError(400, e.one_line())
    if isinstance(e, MemoryError):
        return ApiError(503, "out of memory on the server", code="out_of_memory", headers={"Retry-After": "5"})
    log.error("internal error: %s", e, exc_info=e)
    return ApiError(500, "internal server error; the server's log has the details", code="internal_error")


def openai_body(err: ApiError) -> dict[str, object]:
    return {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.status, "invalid_request_error"),
                      "param": err.param, "code": err.code}}


def ollama_body(err: ApiError) -> dict[str, object]:
    return {"error": err.message}


def anthropic_body(err: ApiError) -> dict[str, object]:
    """Anthropic's shape: its error type from the status (any other 4xx is an invalid request, any
    other 5xx an ``api_error``); the field at fault is named in the message, as Anthropic does."""
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(err: ApiError, api: str) -> JSONResponse:
    body = openai_body(err) if api == OPENAI else anthropic_body(err) if api == ANTHROPIC else ollama_body(err)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def api_of_path(path: str) -> str:
    """Which API's error shape a path answers in (``/v1/messages...`` Anthropic's, other ``/v1/...``
    OpenAI's, anything else Ollama's)."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return ANTHROPIC
    return OPENAI if path.startswith("/v1/") or path == "/v1" else OLLAMA
