"""What a request's model name may name, and what it then loads.

A client's name is untrusted text. It is checked first, without touching the disk: its length, its
characters (no control characters, no leading ``~``, no ``..`` part), and its kind. It then resolves
only to a store entry (``NAME[:SCHEME]``), the embedded default model, or a Hub repo id
(``OWNER/NAME[@REV]``); to a path on the server's disk only where the operator allowed it: any path
with ``allow_local_paths``, or a path relative to ``models_dir`` that stays inside it once its links
are followed. A refused name gets the same answer whether or not a file of that name exists, so the
API tells nothing about the server's disk.

The operator's own names (``serve --preload``) are not requests: they resolve as ``run`` resolves
them (:func:`operator_target`).
"""

from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from localllm.errors import LocalLLMError
from localllm.loaders.store import Store, StoredModel, default_entry, looks_like_path, parse_model_ref
from localllm.paths import DEFAULT_MODEL, default_model_gguf
from localllm.server.config import ServerConfig
from localllm.server.errors import ApiError, ModelNotFound

if TYPE_CHECKING:
    from localllm.loaders.pull import PullSource

#: The longest model name a request may give (a Hub repo id with a revision fits many times over).
MAX_NAME_CHARS = 200
#: A Hub repo id as ``pull`` takes one: ``owner/name`` or ``owner/name@revision``.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(?:@[\w./-]+)?", re.ASCII)

#: What a :class:`Target` loads: a store entry's folder, a file or folder on disk (the default
#: model's GGUF file included), a Hub repo (pulled first unless stored), or a name as ``run`` takes it.
STORE, PATH, REPO, AS_RUN = "store", "path", "repo", "as-run"


@dataclass(frozen=True)
class Target:
    """What a model name resolved to: ``kind`` (one of the constants above) and ``ref``, the folder or
    file to load (store, path), the repo id (repo) or the name itself (as-run); ``entry`` for store
    entries."""

    kind: str
    ref: str
    entry: StoredModel | None = None


def check_name(name: object, config: ServerConfig) -> str:
    """``name`` if a request may give it to this server; otherwise a 400 that names the problem and the
    fix. Reads nothing from the disk: whether a path of that name exists changes nothing here."""
    if not isinstance(name, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if not name.strip():
        raise ApiError(400, "'model' is empty; give a model's name", param="model")
    if len(name) > MAX_NAME_CHARS:
        raise ApiError(400, f"'model' is {len(name)} characters long; a model name has at most {MAX_NAME_CHARS}",
                       param="model")
    bad = next((c for c in name if unicodedata.category(c) in ("Cc", "Cs")), None)
    if bad is not None:
        raise ApiError(400, f"'model' holds the control character U+{ord(bad):04X}; a model name is printable text",
                       param="model")
    if name.startswith("~"):
        raise _not_served(name, config, "'~' is not expanded")
    if ".." in re.split(r"[/\\@]", name):
        raise _not_served(name, config, "a name has no '..' part")
    if is_store_name(name) or is_repo_id(name) or config.allow_local_paths:
        return name
    if config.models_dir is not None and _relative(name):
        return name
    raise _not_served(name, config)


def is_store_name(name: str) -> bool:
    """``NAME[:SCHEME]`` as the store names its entries (the default model's name included)."""
    if looks_like_path(name):
        return False
    try:
        parse_model_ref(name)
    except LocalLLMError:
        return False
    return True


def is_repo_id(name: str) -> bool:
    """``OWNER/NAME[@REV]``, as ``pull`` takes a Hub repo."""
    return bool(_REPO_ID.fullmatch(name))


def resolve(name: str, config: ServerConfig) -> Target:
    """What the request's ``name`` loads (see the module's doc); on a worker thread, as it reads the
    store and, for names the operator allowed, the disk. A name of the store that is not stored is a
    404; a name the server does not serve, a 400."""
    check_name(name, config)
    local = _local(name, config)
    if local is not None:
        return Target(PATH, local)
    if name == DEFAULT_MODEL:
        return _default(Store())
    if is_repo_id(name):
        return Target(REPO, name)
    if is_store_name(name):
        entry = stored(Store(), name)
        return Target(STORE, str(entry.path), entry)
    if config.allow_local_paths:
        return Target(PATH, name)
    raise _not_served(name, config)


def pull_source(name: str, config: ServerConfig) -> PullSource:
    """What ``/api/pull`` of ``name`` fetches: a Hub repo, or a local file or folder the operator
    allowed (as :func:`resolve`); nothing else is copied into the store. On a worker thread."""
    from localllm.loaders.pull import parse_source

    check_name(name, config)
    local = _local(name, config)
    if local is not None:
        return parse_source(local)
    if is_repo_id(name):
        return repo_source(name)
    local_too = ", or a model file or folder the server may read" if (
        config.allow_local_paths or config.models_dir is not None) else ""
    raise ApiError(400, f"'{name}' is not a Hub repo id; /api/pull fetches Hub repos, named OWNER/NAME[@REVISION]"
                        f"{local_too}", param="model")


def operator_target(name: str) -> Target:
    """A name the operator gave on the command line: resolved later as ``run`` resolves it."""
    return Target(AS_RUN, name)


def stored(store: Store, name: str) -> StoredModel:
    """The store entry ``NAME[:SCHEME]``, or a 404 that says so."""
    try:
        return store.resolve(name)
    except LocalLLMError as e:
        raise ModelNotFound(e.message, e.hint) from None


def stored_from_repo(store: Store, repo: str) -> StoredModel | None:
    """The entry a Hub repo id means in the store (its default scheme), None if none was pulled from it."""
    from localllm.loaders.hub import parse_ref
    from localllm.loaders.pull import entries_from_repo

    entries = entries_from_repo(store, parse_ref(repo)[0])
    return default_entry(entries) if entries else None


def repo_source(repo: str) -> PullSource:
    """A Hub repo id as a pull's source: always the Hub, whatever the disk holds under that name."""
    from localllm.loaders.hub import parse_ref
    from localllm.loaders.pull import PullSource

    repo_id, revision = parse_ref(repo)
    return PullSource("hub", repo_id, revision)


def pull_repo(repo: str, quant: str | None) -> StoredModel:
    """The store entry of Hub repo id ``repo`` in ``quant`` (when it is a pull scheme, else what a pull
    asking nothing stores: a quantized repo's own format, a float one's int4), pulled first unless it
    is stored; a repo the Hub does not have is a 404."""
    from localllm.loaders.pull import PULL_SCHEMES, PullOptions, entries_from_repo, kept_for, pull_model, same_source

    scheme = quant if quant in PULL_SCHEMES else None
    source = repo_source(repo)
    store = Store()
    for entry in entries_from_repo(store, source.ref):
        if kept_for(entry, scheme) and same_source(entry.manifest["source"], source):
            return entry
    try:
        return pull_model(source, PullOptions(scheme), store).entry
    except LocalLLMError as e:
        if "not found" in e.message:
            raise ModelNotFound(e.message, e.hint) from None
        raise


def _default(store: Store) -> Target:
    """The default model: its store entry when one is stored under its name, else the embedded file."""
    if any(e.name == DEFAULT_MODEL for e in store.list()):
        entry = stored(store, DEFAULT_MODEL)
        return Target(STORE, str(entry.path), entry)
    gguf = default_model_gguf()
    # not installed: the loader's own error says how to install it
    return Target(PATH, str(gguf)) if gguf is not None else Target(AS_RUN, DEFAULT_MODEL)


def _local(name: str, config: ServerConfig) -> str | None:
    """The file or folder ``name`` means where the operator allowed local paths, else None."""
    if config.models_dir is not None and _relative(name):
        found = _inside(config.models_dir, name)
        if found is not None:
            return str(found)
    if config.allow_local_paths and (looks_like_path(name) or _exists(Path(name))):
        return name
    return None


def _relative(name: str) -> bool:
    return not os.path.isabs(name) and not name.startswith(("~", "\\"))


def _inside(folder: Path, name: str) -> Path | None:
    """``folder/name`` with its links followed, if it exists and is still inside ``folder``."""
    try:
        base = folder.expanduser().resolve()
        path = (base / name).resolve()
    except (OSError, RuntimeError):  # a link loop, or a part too long for the file system
        return None
    if path != base and base in path.parents and _exists(path):
        return path
    return None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a part too long for the file system
        return False


def _not_served(name: str, config: ServerConfig, why: str | None = None) -> ApiError:
    """The one refusal of a name the server does not serve: the same whatever is on its disk."""
    message = f"'{name}' is not a model this server serves" + (f" ({why})" if why else "")
    names = (f"name a stored model (NAME[:SCHEME], as /api/tags lists them), the default model '{DEFAULT_MODEL}' "
             "or a Hub repo (OWNER/NAME)")
    if config.allow_local_paths:
        hint = f"{names}, or a file or folder by its full path"
    elif config.models_dir is not None:
        hint = f"{names}, or a model inside the --models-dir folder by its path relative to that folder"
    else:
        hint = (f"{names}; files on the server's disk are served only when `localllm serve` runs with "
                "--allow-local-paths, or with --models-dir for one folder's models")
    return ApiError(400, f"{message}; {hint}", param="model", code="model_not_served")
