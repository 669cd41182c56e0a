"""The local model store: ``home()/models/<name>/<scheme>/`` holds one converted model.

Each entry holds ``manifest.json`` plus the files the caller wrote (``model.safetensors``, tokenizer
files, chat template...).  The manifest records, besides the caller's fields (source, config, quant
parameters...), the format version, name, scheme, creation time (UTC), localllm version and the size
and sha256 of every file.

Writes are atomic: the caller fills a temporary folder ``models/.tmp-<token>`` inside the store (same
file system, so a rename can publish it); the store hashes it, writes the manifest last, fsyncs, and
renames it into place.  An entry therefore either is complete or does not exist; a folder without
a readable manifest is never listed.  A ``filelock`` per ``<name>/<scheme>`` (in ``models/.locks/``)
serializes the swap of concurrent writers of the same model, and each temporary folder has its own
lock so that a cleaner can tell a live writer's folder from one left by a killed process.

Names are like Ollama's: ``smollm2-135m-instruct:int4``.  A bare name resolves to its only scheme; if
several are stored, to the one whose manifest says ``"default": true``, else ``int4``, else the most
recently created.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

import localllm
from localllm.errors import LocalLLMError
from localllm.format import human_size
from localllm.paths import home

__all__ = ["FORMAT_VERSION", "Store", "StoredModel", "check_length", "check_local_path", "default_entry",
           "human_size", "looks_like_path", "missing_path_error", "name_from_repo", "parse_model_ref", "read_entry",
           "verify"]

#: The artifact format. 2: a tied model whose head is int8 stores no 16-bit embedding (the head's
#: table serves as it); 1 entries still load. An entry newer than this is refused with a hint.
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
PREFERRED_SCHEME = "int4"
_TMP_PREFIX = ".tmp-"
_LOCKS = ".locks"
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_STORE_KEYS = ("format_version", "name", "scheme", "created", "localllm_version", "files")
_HASH_CHUNK = 8 * 1024 * 1024
#: Linux's limits on a file name's bytes and a path's.
_NAME_MAX, _PATH_MAX = 255, 4096


# --------------------------------------------------------------------------- names
def validate_name(name: str, what: str = "model name") -> str:
    """The name in lower case, or a LocalLLMError naming the allowed characters."""
    normalized = name.strip().lower()
    if not _NAME_RE.fullmatch(normalized):
        raise LocalLLMError(
            f"'{name}' is not a valid {what}",
            "use lower-case letters, digits, '.', '_' and '-', starting with a letter or digit (at most 128)",
        )
    return normalized


def name_from_repo(repo_id: str) -> str:
    """The store name of a Hub repo: its basename in lower case (``HuggingFaceTB/SmolLM2-135M-Instruct``
    -> ``smollm2-135m-instruct``); characters a name cannot hold become ``-``."""
    base = repo_id.rstrip("/").rsplit("/", 1)[-1].split("@", 1)[0].lower()
    cleaned = re.sub(r"[^a-z0-9._-]+", "-", base).strip("-._")
    return validate_name(cleaned or repo_id)


def parse_model_ref(ref: str) -> tuple[str, str | None]:
    """``"name:scheme"`` -> ``("name", "scheme")``; ``"name"`` -> ``("name", None)``; both validated."""
    name, sep, scheme = ref.strip().partition(":")
    if sep and not scheme:
        raise LocalLLMError(
            f"'{ref}' has an empty scheme", "write NAME or NAME:SCHEME, e.g. smollm2-135m-instruct:int4"
        )
    return validate_name(name), (validate_name(scheme, "scheme") if sep else None)


def looks_like_path(ref: str) -> bool:
    """Whether ``ref`` is written as a file or folder path rather than a model name or Hub repo id:
    ``./x``, ``../x``, ``/x``, ``~/x``, or a name ending in ``.gguf`` (no model name starts with '.')."""
    return ref.startswith((".", "/", "~")) or ref.endswith(".gguf")


def missing_path_error(ref: str) -> LocalLLMError:
    shown = f"'{ref}'" if ref.endswith((".", " ")) else ref  # a one-line message drops a trailing '.'
    return LocalLLMError(f"no such file or folder: {shown}",
                         "check the path; a stored model is named NAME[:SCHEME] (see `localllm list`)")


def check_length(ref: str) -> None:
    """Refuse a reference no file system holds (a part of more than NAME_MAX bytes, or more than
    PATH_MAX bytes in all) before it reaches one, which would fail with ENAMETOOLONG."""
    encoded = os.fsencode(ref)
    if len(encoded) > _PATH_MAX or any(len(part) > _NAME_MAX for part in encoded.split(b"/")):
        shown = ref if len(ref) <= 40 else ref[:40] + "..."
        raise LocalLLMError(f"'{shown}' is too long for a model name or path ({len(ref)} characters)",
                            f"a stored model is named NAME[:SCHEME] (see `localllm list`); a path's parts have at "
                            f"most {_NAME_MAX} bytes")


def check_local_path(ref: str) -> None:
    """Refuse a reference too long for a file system, and a path (see :func:`looks_like_path`) that does
    not exist, before it is taken for anything else."""
    check_length(ref)
    if not looks_like_path(ref):
        return
    try:
        exists = Path(ref).expanduser().exists()
    except RuntimeError:  # ~user of no such user
        exists = False
    if not exists:
        raise missing_path_error(ref)


# --------------------------------------------------------------------------- entries
@dataclass(frozen=True)
class StoredModel:
    """One entry of the store."""

    name: str
    scheme: str
    path: Path
    manifest: dict[str, Any]
    size_bytes: int
    modified: datetime

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.scheme}"

    @property
    def size(self) -> str:
        return human_size(self.size_bytes)


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of ``folder`` if it is readable and complete enough to describe an entry."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    if not all(key in manifest for key in ("name", "scheme", "format_version")):
        return None
    return manifest


def _created(manifest: dict[str, Any], folder: Path) -> datetime:
    try:
        return datetime.fromisoformat(str(manifest["created"]))
    except (KeyError, ValueError):
        return datetime.fromtimestamp((folder / MANIFEST).stat().st_mtime, tz=timezone.utc)


def read_entry(folder: Path) -> StoredModel | None:
    """The entry in ``folder`` (``<store>/models/<name>/<scheme>``): None without a valid manifest, or
    with one written for another name."""
    manifest = _read_manifest(folder)
    if manifest is None or (manifest["name"], manifest["scheme"]) != (folder.parent.name, folder.name):
        return None
    return _entry(folder, manifest)


def _entry(folder: Path, manifest: dict[str, Any]) -> StoredModel:
    size = sum(int(info.get("size", 0)) for info in manifest["files"].values())
    return StoredModel(
        name=str(manifest["name"]),
        scheme=str(manifest["scheme"]),
        path=folder,
        manifest=manifest,
        size_bytes=size,
        modified=_created(manifest, folder),
    )


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in chunks (weights can be bigger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify(stored: StoredModel) -> None:
    """Re-hash every file against the manifest; a LocalLLMError names the first bad one and the fix."""
    for rel, info in sorted(stored.manifest["files"].items()):
        path = stored.path / rel
        problem = None
        if not path.is_file():
            problem = "is missing"
        elif path.stat().st_size != info.get("size"):
            problem = f"has {path.stat().st_size} bytes instead of {info.get('size')}"
        elif file_sha256(path) != info.get("sha256"):
            problem = "does not match its sha256"
        if problem:
            raise LocalLLMError(
                f"model '{stored.ref}' is corrupted: {rel} {problem}",
                f"run `localllm rm {stored.ref} && localllm pull {_pull_source(stored.manifest)}`",
            )


def _pull_source(manifest: dict[str, Any]) -> str:
    """What to pull again to rebuild an entry, from the manifest's ``source``."""
    source = manifest.get("source")
    if isinstance(source, dict):
        for key in ("repo", "repo_id", "path", "gguf"):
            if source.get(key):
                return str(source[key])
    if isinstance(source, str) and source:
        return source
    return "<repo>"


# --------------------------------------------------------------------------- the store
class Store:
    """The model store under ``root`` (default: :func:`localllm.paths.home`)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else home()
        self.models = self.root / "models"

    # ----------------------------------------------------------- paths, locks
    def path_for(self, name: str, scheme: str) -> Path:
        return self.models / validate_name(name) / validate_name(scheme, "scheme")

    def lock(self, name: str, scheme: str) -> FileLock:
        """The lock of one entry; hold it to check-then-write (``exists`` then ``write``) without a race.

        Re-entrant in the same thread (``write`` takes it again to publish), exclusive across threads
        and processes.
        """
        return self._file_lock(f"{validate_name(name)}@{validate_name(scheme, 'scheme')}")

    def _file_lock(self, key: str) -> FileLock:
        locks = self.models / _LOCKS
        locks.mkdir(parents=True, exist_ok=True)
        return FileLock(str(locks / f"{key}.lock"), is_singleton=True)

    # ---------------------------------------------------------------- reading
    def get(self, name: str, scheme: str) -> StoredModel | None:
        return read_entry(self.path_for(name, scheme))

    def exists(self, name: str, scheme: str) -> bool:
        return self.get(name, scheme) is not None

    def list(self) -> list[StoredModel]:
        """Every complete entry, sorted by name then scheme; temporary and broken folders are skipped."""
        entries: list[StoredModel] = []
        if not self.models.is_dir():
            return entries
        for name_dir in sorted(self.models.iterdir()):
            if name_dir.name.startswith(".") or not name_dir.is_dir():
                continue
            for scheme_dir in sorted(name_dir.iterdir()):
                entry = read_entry(scheme_dir) if scheme_dir.is_dir() else None
                if entry is not None:
                    entries.append(entry)
        return sorted(entries, key=lambda e: (e.name, e.scheme))

    def resolve(self, ref: str) -> StoredModel:
        """``name:scheme`` exactly; a bare ``name`` -> its default scheme (see the module docstring)."""
        if looks_like_path(ref):
            raise missing_path_error(ref)
        if "/" in ref:
            raise LocalLLMError(
                f"model '{ref}' not found (that looks like a Hub repo)", f"run `localllm pull {ref}` first"
            )
        name, scheme = parse_model_ref(ref)
        entries = [e for e in self.list() if e.name == name]
        if scheme is not None:
            for entry in entries:
                if entry.scheme == scheme:
                    return entry
            if entries:
                have = ", ".join(e.ref for e in entries)
                raise LocalLLMError(
                    f"model '{name}:{scheme}' not found",
                    f"stored: {have}; or run `localllm pull <repo> --quant {scheme}`",
                )
            raise self._not_found(ref, name)
        if not entries:
            raise self._not_found(ref, name)
        return default_entry(entries)

    def _not_found(self, ref: str, name: str) -> LocalLLMError:
        names = sorted({e.name for e in self.list()})
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else "run `localllm pull <repo>` or `localllm list`"
        return LocalLLMError(f"model '{ref}' not found", hint)

    # ---------------------------------------------------------------- writing
    @contextmanager
    def write(self, name: str, scheme: str, manifest: dict[str, Any]) -> Iterator[Path]:
        """Yield an empty temporary folder to fill; on a clean exit publish it as ``<name>/<scheme>``.

        The store adds ``format_version, name, scheme, created, localllm_version, files`` to the
        caller's ``manifest`` (its own values win).  An existing entry is replaced.  On any exception
        (KeyboardInterrupt included) the folder is deleted and the store is left as it was.
        """
        name, scheme = validate_name(name), validate_name(scheme, "scheme")
        self.models.mkdir(parents=True, exist_ok=True)
        self.clean_stale()
        token = secrets.token_hex(8)
        tmp_lock = self._file_lock(f"tmp-{token}")
        with tmp_lock:
            tmp = self.models / f"{_TMP_PREFIX}{token}"
            tmp.mkdir()
            try:
                yield tmp
                _write_manifest(tmp, _full_manifest(tmp, name, scheme, manifest))
                with self.lock(name, scheme):
                    self._publish(tmp, self.path_for(name, scheme), token)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        Path(tmp_lock.lock_file).unlink(missing_ok=True)

    def _publish(self, tmp: Path, final: Path, token: str) -> None:
        """Rename ``tmp`` to ``final``; an existing ``final`` is moved aside first, then deleted.

        The aside folder keeps this writer's token, so its lock protects it from cleaners; were the
        process killed between the two renames, :meth:`clean_stale` restores the newest complete copy.
        """
        final.parent.mkdir(parents=True, exist_ok=True)
        aside = self.models / f"{_TMP_PREFIX}{token}.old"
        had_old = final.exists()
        if had_old:
            os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            if had_old:
                os.rename(aside, final)
            raise
        _fsync_dir(final.parent)
        if had_old:
            shutil.rmtree(aside, ignore_errors=True)

    def remove(self, ref: str) -> StoredModel:
        """Delete an entry (resolved like :meth:`resolve`) and return what it was."""
        stored = self.resolve(ref)
        token = secrets.token_hex(8)
        tmp_lock = self._file_lock(f"tmp-{token}")
        with tmp_lock, self.lock(stored.name, stored.scheme):
            if stored.path.exists():
                doomed = self.models / f"{_TMP_PREFIX}{token}.old"
                os.rename(stored.path, doomed)  # vanishes at once; deleting a big folder takes time
                shutil.rmtree(doomed, ignore_errors=True)
            try:
                stored.path.parent.rmdir()  # only if no other scheme is left
            except OSError:
                pass
        Path(tmp_lock.lock_file).unlink(missing_ok=True)
        return stored

    def verify(self, stored: StoredModel) -> None:
        verify(stored)

    # ---------------------------------------------------------------- cleanup
    def clean_stale(self) -> int:
        """Delete temporary folders left by killed writers (not those of live ones); return how many.

        A stale folder holding a complete entry whose target is missing (a writer killed between
        its two renames) is put back in place instead.
        """
        if not self.models.is_dir():
            return 0
        cleaned = 0
        for folder in sorted(self.models.glob(_TMP_PREFIX + "*")):
            token = folder.name[len(_TMP_PREFIX) :].split(".", 1)[0]
            lock = self._file_lock(f"tmp-{token}")
            if lock.is_locked:
                continue  # held by this very thread: a write in progress around us
            try:
                lock.acquire(blocking=False)
            except Timeout:
                continue  # a live writer owns it
            try:
                if folder.exists():
                    if not self._restore(folder):
                        shutil.rmtree(folder, ignore_errors=True)
                    cleaned += 1
            finally:
                lock.release()
            Path(lock.lock_file).unlink(missing_ok=True)
        return cleaned

    def _restore(self, folder: Path) -> bool:
        manifest = _read_manifest(folder)
        if manifest is None or not _files_present(folder, manifest):
            return False
        try:
            final = self.path_for(str(manifest["name"]), str(manifest["scheme"]))
        except LocalLLMError:
            return False
        with self.lock(final.parent.name, final.name):
            if final.exists():
                return False
            final.parent.mkdir(parents=True, exist_ok=True)
            os.rename(folder, final)
        return True


def default_entry(entries: list[StoredModel]) -> StoredModel:
    """The entry a bare name means among ``entries`` (the schemes stored under one name, or the entries
    pulled from one repo): the only one; else the one flagged ``"default": true``; else int4; else the newest."""
    if len(entries) == 1:
        return entries[0]
    flagged = [e for e in entries if e.manifest.get("default") is True]
    if len(flagged) == 1:
        return flagged[0]
    for entry in entries:
        if entry.scheme == PREFERRED_SCHEME:
            return entry
    return max(entries, key=lambda e: e.modified)


def _files_present(folder: Path, manifest: dict[str, Any]) -> bool:
    for rel, info in manifest["files"].items():
        path = folder / rel
        if not path.is_file() or path.stat().st_size != info.get("size"):
            return False
    return True


def _full_manifest(folder: Path, name: str, scheme: str, extra: dict[str, Any]) -> dict[str, Any]:
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST:
            continue
        _fsync_file(path)
        files[rel] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    manifest = {k: v for k, v in extra.items() if k not in _STORE_KEYS}
    return {
        "format_version": FORMAT_VERSION,
        "name": name,
        "scheme": scheme,
        "created": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        "localllm_version": localllm.__version__,
        **manifest,
        "files": files,
    }


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` last and durably: it is what makes the folder an entry."""
    partial = folder / (MANIFEST + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, folder / MANIFEST)
    _fsync_dir(folder)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable (not possible on Windows, where it is skipped)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
