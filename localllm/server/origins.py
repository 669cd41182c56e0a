"""Which requests a web page may make: the server answers only requests addressed to it by a name it
knows (against DNS rebinding), from browser origins it allows (against cross-site requests), and takes
only JSON on the routes that change the store (a cross-site form or ``text/plain`` POST needs no
preflight, so a page could otherwise send one).

* ``Host``: an IP address (a rebinding page reaches the server through a name, never an address),
  ``localhost`` and ``*.localhost``, the name the server was bound to, this machine's own name (and it
  with ``.local``), and each of ``allowed_hosts`` (``*``: any).
* ``Origin`` (sent by browsers): loopback origins over http or https on any port, and each of
  ``allowed_origins`` (exact origins such as ``https://app.example``; ``*``: any); requests without an
  ``Origin`` (command-line clients, SDKs) pass. Allowed origins get CORS answers (Starlette's
  ``CORSMiddleware``), preflights included.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from localllm.server.errors import ApiError, api_of_path, error_response

#: Browser origins allowed by default: this machine's, over http or https, on any port.
LOOPBACK_ORIGIN = r"https?://(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?"
#: Routes that change the store: a JSON body only.
STORE_ROUTES = frozenset({"/api/pull", "/api/delete"})


def host_name(host: str) -> str:
    """The name or address of a ``Host`` header, without its port or an IPv6 address's brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host: str, bound: str, allowed: Sequence[str]) -> bool:
    """Whether a request whose ``Host`` is ``host`` is addressed to this server (see the module's
    docstring); ``bound``: the address or name it listens on, or this machine's own name."""
    name = host_name(host)
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    wanted = {h.lower() for h in allowed}
    return ("*" in wanted or name == "localhost" or name.endswith(".localhost") or name == bound.lower()
            or name in wanted)


def origin_allowed(origin: str, allowed: Sequence[str]) -> bool:
    """Whether a browser page of ``origin`` may use the server."""
    wanted = {o.lower().rstrip("/") for o in allowed}
    origin = origin.lower().rstrip("/")
    return "*" in wanted or origin in wanted or re.fullmatch(LOOPBACK_ORIGIN, origin) is not None


def is_json(content_type: str) -> bool:
    """``application/json``, with or without parameters (``; charset=utf-8``)."""
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


class OriginGuard:
    """Refuses, in the path's API error shape, a request addressed by a name that is not this server's
    (403), one from a browser origin that is not allowed (403), and a store route's body that is not
    JSON (415)."""

    def __init__(self, app: ASGIApp, bound: str, allowed_hosts: Sequence[str] = (),
                 allowed_origins: Sequence[str] = ()) -> None:
        self.app = app
        machine = socket.gethostname().lower()
        self.names = (bound, machine, f"{machine}.local")
        self.hosts = tuple(allowed_hosts)
        self.origins = tuple(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            err = self.refusal(scope)
            if err is not None:
                await error_response(err, api_of_path(scope["path"]))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> ApiError | None:
        headers = {k: v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get(b"host")
        if host is not None and not any(host_allowed(host, name, self.hosts) for name in self.names):
            shown = host_name(host)[:100]
            return ApiError(403, f"requests addressed to '{shown}' are refused (the Host header is not this "
                                 f"server's name): start the server with --allowed-hosts {shown} if that "
                                 "name is yours", code="host_not_allowed")
        origin = headers.get(b"origin")
        if origin is not None and not origin_allowed(origin, self.origins):
            shown = origin[:100]
            return ApiError(403, f"requests from the web origin '{shown}' are refused: start the server with "
                                 f"--allowed-origins {shown} (or LOCALLLM_ORIGINS) to let that page use it",
                            code="origin_not_allowed")
        if scope["path"] in STORE_ROUTES and scope["method"] not in ("GET", "HEAD", "OPTIONS") \
                and not is_json(headers.get(b"content-type", "")):
            return ApiError(415, f"{scope['path']} takes a JSON body only; send 'Content-Type: application/json'",
                            code="unsupported_media_type")
        return None


def add_origin_checks(app: Starlette, bound: str, allowed_hosts: Sequence[str], allowed_origins: Sequence[str]) -> None:
    """Wrap ``app`` (after its other middleware): CORS answers for the allowed origins (Starlette's
    ``CORSMiddleware``: preflights never reach the API key's check), and :class:`OriginGuard` before
    everything."""
    origins = [o.rstrip("/") for o in allowed_origins]
    app.add_middleware(CORSMiddleware, allow_origins=["*"] if "*" in origins else origins,
                       allow_origin_regex=LOOPBACK_ORIGIN, allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(OriginGuard, bound=bound, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins)
