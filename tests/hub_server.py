"""A Hugging Face Hub look-alike for tests: the real ``huggingface_hub`` client talks to it over HTTP.

It answers exactly what ``huggingface_hub`` 2.x asks during ``snapshot_download`` / ``hf_hub_download`` /
``HfApi.model_info`` (read from the client's source, not from memory):

* ``GET /api/models/{repo}[/revision/{rev}]`` (``?blobs=True`` adds size, blobId and lfs to siblings)
  -> ``{"id", "sha", "siblings": [{"rfilename", ...}], ...}``. The revision is URL-quoted with ``safe=''``.
* ``GET /api/models/{repo}/tree/{rev}?recursive=True&expand=False`` -> ``[{type, path, size, oid,
  lfs: {oid, size, pointerSize}}]``, paginated with a GitHub-style ``Link: <...>; rel="next"`` header
  when ``HubServer.tree_page_size`` is set.
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: ``ETag`` (git blob sha1 for small files, sha256 for
  LFS files), ``X-Repo-Commit``, ``X-Linked-Etag`` / ``X-Linked-Size`` for LFS files, ``Content-Length``,
  ``Accept-Ranges``; ``Range: bytes=N-`` -> 206 with ``Content-Range``.
* Errors carry the Hub's ``X-Error-Code`` header, which is what the client maps to exceptions:
  ``RepoNotFound`` -> ``RepositoryNotFoundError`` (so does a 401 on a repo URL unless ``X-Error-Message``
  is "Invalid credentials in Authorization header"), ``GatedRepo`` -> ``GatedRepoError``,
  ``RevisionNotFound`` -> ``RevisionNotFoundError``, ``EntryNotFound`` -> ``RemoteEntryNotFoundError``.

No Xet headers are ever sent (``X-Xet-Hash`` is what switches the client to Xet), so the client
always downloads with plain HTTP, which is what lets the fault injection below work.

Faults are set per file with :meth:`HubServer.fault` (cut the connection at a byte offset, once or
every time; serve wrong bytes of the right length) and per repo (private with a token, gated, or a
fixed error status). Every request is recorded in :attr:`HubServer.requests`.

Environment: ``huggingface_hub.constants`` reads ``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``, ``HF_HUB_DISABLE_XET`` and the token path **once, at import time**, so setting
the variables in a test is not enough for code that relies on the client's defaults.  The
:func:`hub_env` helper sets the variables *and* patches those constants (with ``monkeypatch``, so
everything is undone after the test).  ``loaders.hub`` itself reads the variables at call time.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
LFS_MIN_SIZE = 10 * 1024 * 1024  # like a .gitattributes size threshold: bigger files are LFS too

_INVALID_TOKEN = "Invalid credentials in Authorization header"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: what the Hub reports as ``oid`` / ``ETag`` for non-LFS files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The git-lfs pointer file committed in place of a large file."""
    return (
        "version https://git-lfs.github.com/spec/v1\n"
        f"oid sha256:{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n"
    ).encode()


def is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_SIZE


@dataclass
class RepoFileData:
    path: str
    data: bytes

    @property
    def lfs(self) -> bool:
        return is_lfs(self.path, self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else git_blob_sha1(self.data)

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "path": self.path, "size": len(self.data)}
        if self.lfs:
            pointer = lfs_pointer(self.data)
            entry["oid"] = git_blob_sha1(pointer)
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": len(pointer)}
        else:
            entry["oid"] = git_blob_sha1(self.data)
        return entry

    def sibling(self, blobs: bool) -> dict[str, Any]:
        if not blobs:
            return {"rfilename": self.path}
        entry = self.tree_entry()
        sibling: dict[str, Any] = {"rfilename": self.path, "size": entry["size"], "blobId": entry["oid"]}
        if "lfs" in entry:
            lfs = entry["lfs"]
            sibling["lfs"] = {"size": lfs["size"], "sha256": lfs["oid"], "pointerSize": lfs["pointerSize"]}
        return sibling


@dataclass
class Fault:
    """What goes wrong when a file is served.

    ``drop_at``: send the file only up to this absolute byte offset, then cut the connection (a request
    that starts at or after it is cut before any byte). ``drop_times``: how many responses to cut
    (None: all of them). ``corrupt_times``: how many responses carry wrong bytes of the right length
    (None: all of them; 0: none). ``rate``: send at most this many bytes a second (a slow link, so
    that a test can kill a client mid-download).
    """

    drop_at: int | None = None
    drop_times: int | None = 1
    corrupt_times: int | None = 0
    rate: float | None = None

    def take_drop(self) -> bool:
        if self.drop_at is None or self.drop_times == 0:
            return False
        if self.drop_times is not None:
            self.drop_times -= 1
        return True

    def take_corrupt(self) -> bool:
        if self.corrupt_times == 0:
            return False
        if self.corrupt_times is not None:
            self.corrupt_times -= 1
        return True


@dataclass
class HubRepo:
    """A model repo: commits (sha -> files) and refs (branch or tag -> sha)."""

    repo_id: str
    commits: dict[str, dict[str, RepoFileData]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None  # private: only this bearer token may read it
    gated: bool = False  # gated: only ``allowed_tokens`` may read it
    allowed_tokens: set[str] = field(default_factory=set)
    status: int | None = None  # answer this status to every request (401, 403, 500...)
    faults: dict[str, Fault] = field(default_factory=dict)

    def add_revision(
        self, files: Path | dict[str, bytes], *, branch: str | None = "main", tags: tuple[str, ...] = ()
    ) -> str:
        """Add a commit holding ``files`` (a folder, or path -> bytes); point ``branch`` and ``tags`` at it."""
        contents = _read_files(files) if isinstance(files, Path) else dict(files)
        digest = hashlib.sha1(f"{self.repo_id}:{len(self.commits)}".encode())
        for path in sorted(contents):
            digest.update(path.encode() + b"\0" + hashlib.sha256(contents[path]).digest())
        sha = digest.hexdigest()
        self.commits[sha] = {path: RepoFileData(path, data) for path, data in sorted(contents.items())}
        for ref in ((branch,) if branch else ()) + tuple(tags):
            self.refs[ref] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


def _read_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str  # unquoted, without the query string
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names

    @property
    def range_start(self) -> int | None:
        match = re.fullmatch(r"bytes=(\d+)-\d*", self.headers.get("range", ""))
        return int(match.group(1)) if match else None


_API_RE = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)??)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+))?$")
_RESOLVE_RE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class HubServer:
    """A threaded Hub-protocol server on 127.0.0.1 (a free port). Use as a context manager."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[RecordedRequest] = []
        self.tree_page_size: int | None = None
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- setup
    def add_repo(
        self,
        repo_id: str,
        files: Path | dict[str, bytes],
        *,
        tags: tuple[str, ...] = (),
        token: str | None = None,
        gated: bool = False,
        allowed_tokens: tuple[str, ...] = (),
        status: int | None = None,
    ) -> HubRepo:
        repo = HubRepo(repo_id, token=token, gated=gated, allowed_tokens=set(allowed_tokens), status=status)
        repo.add_revision(files, tags=tags)
        self.repos[repo_id] = repo
        return repo

    def fault(self, repo_id: str, path: str, **kwargs: Any) -> Fault:
        """Set (replace) the fault of one file; see :class:`Fault` for the arguments."""
        fault = Fault(**kwargs)
        self.repos[repo_id].faults[path] = fault
        return fault

    def clear_faults(self) -> None:
        for repo in self.repos.values():
            repo.faults.clear()

    # ------------------------------------------------------------- inspection
    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("server not started")
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def requests_for(self, path_part: str, method: str | None = None) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if path_part in r.path and (method is None or r.method == method)]

    def file_gets(self, filename: str) -> list[RecordedRequest]:
        """The GET requests that downloaded ``filename`` (any repo, any revision)."""
        return [r for r in self.requests_for("/resolve/", "GET") if r.path.endswith("/" + filename)]

    # -------------------------------------------------------------- lifecycle
    def start(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False  # keep-alive handler threads must not block close
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        _close_client_session()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _close_client_session() -> None:
    """Drop the client's pooled keep-alive connections (they point at a server that is gone)."""
    try:
        from huggingface_hub import close_session
    except ImportError:  # older clients have no shared session
        return
    close_session()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"  # keep-alive, like the Hub; every answer carries Content-Length
    timeout = 10  # idle keep-alive connections end by themselves

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the default stderr log
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._dispatch(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch(head=True)

    # -------------------------------------------------------------- routing
    def _dispatch(self, head: bool) -> None:
        split = urlsplit(self.path)
        path = unquote(split.path)
        query = parse_qs(split.query)
        self.hub.record(RecordedRequest(self.command, path, query, {k.lower(): v for k, v in self.headers.items()}))
        raw_path = split.path  # revision and file names are still quoted here
        if match := _API_RE.match(raw_path):
            self._api(unquote(match["repo"]), match["kind"], unquote(match["rev"] or "main"), query)
        elif match := _RESOLVE_RE.match(raw_path):
            self._resolve(unquote(match["repo"]), unquote(match["rev"]), unquote(match["file"]), head)
        else:
            self._error(404, "not a Hub endpoint")

    def _access(self, repo_id: str) -> HubRepo | None:
        """The repo if this request may read it; otherwise answer the error the Hub gives and return None."""
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "Repository not found", code="RepoNotFound")
            return None
        if repo.status is not None:
            message = _INVALID_TOKEN if repo.status == 401 else f"status {repo.status}"
            self._error(repo.status, message)
            return None
        token = self._token()
        if repo.token is not None and token != repo.token:
            # The Hub hides private repos: 401 + RepoNotFound, as for a repo that does not exist.
            self._error(401, "Repository not found", code="RepoNotFound")
            return None
        if repo.gated and token not in repo.allowed_tokens:
            self._error(403, f"Access to model {repo_id} is restricted.", code="GatedRepo")
            return None
        return repo

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[7:] if auth.lower().startswith("bearer ") else None

    def _commit(self, repo_id: str, revision: str) -> tuple[HubRepo, str] | None:
        """The repo and the commit a revision names; else answer the Hub's error and return None."""
        repo = self._access(repo_id)
        if repo is None:
            return None
        sha = repo.resolve(revision)
        if sha is None:
            self._error(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
            return None
        return repo, sha

    # ------------------------------------------------------------------ API
    def _api(self, repo_id: str, kind: str | None, revision: str, query: dict[str, list[str]]) -> None:
        found = self._commit(repo_id, revision)
        if found is None:
            return
        repo, sha = found
        files = repo.commits[sha]
        if kind == "tree":
            self._tree(files, query)
            return
        blobs = _truthy(query.get("blobs"))
        body = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": sha,
            "private": repo.token is not None,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "siblings": [f.sibling(blobs) for f in files.values()],
        }
        self._json(body)

    def _tree(self, files: dict[str, RepoFileData], query: dict[str, list[str]]) -> None:
        entries: list[dict[str, Any]] = []
        folders: set[str] = set()
        for f in files.values():
            parts = f.path.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                folder = "/".join(parts[:depth])
                if folder not in folders:
                    folders.add(folder)
                    oid = git_blob_sha1(folder.encode())  # any stable id will do for a folder
                    entries.append({"type": "directory", "path": folder, "oid": oid, "size": 0})
            entries.append(f.tree_entry())
        if not _truthy(query.get("recursive")):
            entries = [e for e in entries if "/" not in e["path"]]
        start = int(query.get("cursor", ["0"])[0])
        size = self.hub.tree_page_size or len(entries) or 1
        page = entries[start : start + size]
        headers = {}
        if start + size < len(entries):
            split = urlsplit(self.path)
            recursive = "True" if _truthy(query.get("recursive")) else "False"
            next_url = f"{self.hub.url}{split.path}?recursive={recursive}&expand=False&cursor={start + size}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        self._json(page, headers)

    # -------------------------------------------------------------- resolve
    def _resolve(self, repo_id: str, revision: str, filename: str, head: bool) -> None:
        found = self._commit(repo_id, revision)
        if found is None:
            return
        repo, sha = found
        entry = repo.commits[sha].get(filename)
        if entry is None:
            self._error(404, "Entry not found", code="EntryNotFound", extra={"X-Repo-Commit": sha})
            return
        total = len(entry.data)
        start, end = 0, total - 1
        status = 200
        range_header = self.headers.get("Range")
        if range_header and not head:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header.strip())
            if match is None or int(match.group(1)) >= total:
                self._error(416, "Range Not Satisfiable", extra={"Content-Range": f"bytes */{total}"})
                return
            start = int(match.group(1))
            end = min(int(match.group(2)), total - 1) if match.group(2) else total - 1
            status = 206
        headers = {
            "ETag": f'"{entry.etag}"',
            "X-Repo-Commit": sha,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Content-Length": str(end - start + 1),
        }
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(total)
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{total}"
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if head:
            return
        self._send_body(repo.faults.get(filename), entry.data, start, end + 1)

    def _send_body(self, fault: Fault | None, data: bytes, start: int, stop: int) -> None:
        payload = data[start:stop]
        if fault is None:
            self.wfile.write(payload)
            return
        if fault.take_corrupt():
            payload = _flip_bytes(payload)
        cut = fault.drop_at is not None and fault.drop_at < stop and fault.take_drop()
        if cut:
            payload = payload[: max(0, fault.drop_at - start)]  # type: ignore[operator]
        step = 16 * 1024
        try:
            for i in range(0, len(payload), step):
                self.wfile.write(payload[i : i + step])
                if fault.rate:
                    self.wfile.flush()
                    time.sleep(step / fault.rate)
        except (BrokenPipeError, ConnectionResetError):  # the client went away (killed)
            self.close_connection = True
            return
        if cut:
            self.wfile.flush()
            self._cut()

    def _cut(self) -> None:
        """Drop the connection mid-body, the way a network failure does."""
        self.close_connection = True
        time.sleep(0.05)  # let the client read what was sent before the reset
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -------------------------------------------------------------- helpers
    def _json(self, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(
        self, status: int, message: str, *, code: str | None = None, extra: dict[str, str] | None = None
    ) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Error-Message", message)
        if code is not None:
            self.send_header("X-Error-Code", code)
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _truthy(values: list[str] | None) -> bool:
    return values is not None and bool(values) and values[0].lower() in {"1", "true", "yes"}


def _flip_bytes(payload: bytes) -> bytes:
    """Same length, different content: every 4096th byte inverted."""
    corrupted = bytearray(payload)
    for i in range(0, len(corrupted), 4096):
        corrupted[i] ^= 0xFF
    return bytes(corrupted)


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------ environment
def hub_env(monkeypatch: Any, endpoint: str, hf_home: Path) -> None:
    """Point ``huggingface_hub`` at ``endpoint`` with an empty cache and no token, xet and telemetry off.

    Sets the environment variables (read at call time by ``loaders.hub`` and by subprocesses) and
    patches ``huggingface_hub.constants`` (read once at import time by the client).
    """
    from huggingface_hub import constants

    hub_cache = hf_home / "hub"
    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hub_cache),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    }
    for name, setting in env.items():
        monkeypatch.setenv(name, setting)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                 "HF_HUB_ENABLE_HF_TRANSFER", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    patched: dict[str, object] = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hub_cache),
        "HUGGINGFACE_HUB_CACHE": str(hub_cache),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
        "HF_XET_CACHE": str(hf_home / "xet"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_TELEMETRY": True,
    }
    for name, value in patched.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)


def set_offline(monkeypatch: Any, offline: bool = True) -> None:
    """Offline mode, both as the variable and as the client's import-time constant."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def no_retry_sleep(monkeypatch: Any) -> None:
    """Make the client's retry pauses (1 s each in ``http_get``, backoff in ``http_backoff``) instant.

    Only the ``time`` name inside those two client modules is replaced, not ``time.sleep`` itself.
    """
    import huggingface_hub.file_download as file_download
    import huggingface_hub.utils._http as client_http

    class _FastTime:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            return None

    for module in (file_download, client_http):
        monkeypatch.setattr(module, "time", _FastTime())


@pytest.fixture(name="hub")
def hub_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """Fixture ``hub``: a running server, the client pointed at it with an empty cache in ``tmp_path/hf``.

    Use it with ``from tests.hub_server import hub_fixture`` in a test module.  Retry pauses are
    instant, and the client's download chunk is 64 KiB: it resumes from whole chunks only (10 MB by
    default), so a smaller chunk makes a resume observable with a file of a few MB.
    """
    from huggingface_hub import constants

    with running_hub() as server:
        hub_env(monkeypatch, server.url, tmp_path / "hf")
        no_retry_sleep(monkeypatch)
        monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
        yield server


@contextmanager
def running_hub() -> Iterator[HubServer]:
    """``with running_hub() as hub:`` -- a started :class:`HubServer`, stopped afterwards."""
    server = HubServer().start()
    try:
        yield server
    finally:
        server.stop()


def resolve_url(endpoint: str, repo_id: str, revision: str, filename: str) -> str:
    return f"{endpoint}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(filename)}"
