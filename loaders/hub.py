"""Pull model repos from the Hugging Face Hub, with the real ``huggingface_hub`` client (2.x).

Only what the runtime needs is fetched (safetensors weights, config, tokenizer, chat template), into
the client's own cache (``$HF_HUB_CACHE``, by default ``$HF_HOME/hub``), so models already pulled by
other tools are reused.  Every downloaded file is then checked against the hash the Hub listed for it.

Facts about the client this module relies on (huggingface_hub 2.4, read from its source):

* ``HF_ENDPOINT``, ``HF_HOME`` / ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` are read once, when
  ``huggingface_hub.constants`` is imported.  This module reads them again at call time and passes
  ``endpoint`` / ``cache_dir`` / ``local_files_only`` explicitly, so a variable set after import still counts.
* Resume: ``http_get`` retries a dropped transfer in the same call (5 tries without progress, 1 s
  apart) with ``Range: bytes=N-``, N being what it has received in whole ``DOWNLOAD_CHUNK_SIZE``
  (10 MB) chunks.  But ``hf_hub_download`` writes to a temporary file named uniquely per call and
  deletes it when the call fails (no option or variable keeps it), so with the client alone the
  *next* pull starts a file from zero.  Hence :func:`_fetch_resumable`, which keeps LFS files'
  partial bytes across pulls (see there) and leaves the rest of the pull to the client.
* The client never checks the content of a blob against its ETag (only the size), hence
  :func:`_verify_files` here.
* HTTP errors become ``RepositoryNotFoundError`` (404, or 401 on a repo URL), ``GatedRepoError``,
  ``RevisionNotFoundError``, ``RemoteEntryNotFoundError`` (from the ``X-Error-Code`` header) or a plain
  ``HfHubHTTPError``; an unreachable Hub is an ``httpx2.ConnectError``, or a ``LocalEntryNotFoundError`` /
  ``RevisionResolutionError`` whose cause is one.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import (
    HfApi,
    constants,
    get_cached_repo_tree,
    get_hf_file_metadata,
    hf_hub_url,
    scan_cache_dir,
    snapshot_download,
)
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)
from huggingface_hub.file_download import http_get, repo_folder_name
from huggingface_hub.utils import WeakFileLock, build_hf_headers, is_tqdm_disabled
from huggingface_hub.utils import logging as hf_logging
from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

from localllm.errors import LocalLLMError
from localllm.loaders.store import file_sha256

#: Files the runtime reads besides the weights.
RUNTIME_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d+-of-\d+\.safetensors")
#: Weight formats that are Python pickles: loading one can run arbitrary code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HASH_CHUNK = 8 * 1024 * 1024
_LOGIN_HINT = "set HF_TOKEN or run `hf auth login`"


@dataclass(frozen=True)
class Snapshot:
    """A downloaded revision of a repo: the files sit in ``path``, a snapshot folder of the HF cache."""

    repo_id: str
    revision: str  # as asked: branch, tag or commit
    commit_sha: str
    path: Path
    files: list[str]


# --------------------------------------------------------------------------- configuration
def hub_endpoint() -> str:
    """The Hub URL: ``$HF_ENDPOINT`` now, else what the client read at import."""
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def hub_cache_dir() -> Path:
    """The HF cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else what the client read at import."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    if hf_home := os.environ.get("HF_HOME"):
        return Path(hf_home).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def offline_from_env() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now, else as the client read it at import."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value:
            return value.upper() in constants.ENV_VARS_TRUE_VALUES
    return constants.is_offline_mode()


def parse_ref(ref: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; ``"org/name"`` -> ``("org/name", None)``."""
    repo_id, sep, revision = ref.strip().partition("@")
    if not repo_id or (sep and not revision):
        raise LocalLLMError(
            f"'{ref}' is not a model reference", "write REPO or REPO@REVISION, e.g. HuggingFaceTB/SmolLM2-135M-Instruct"
        )
    return repo_id, revision or None


# --------------------------------------------------------------------------- file choice
def select_files(repo_id: str, names: Iterable[str]) -> list[str]:
    """The files of a repo the runtime needs; refuses pickle-only repos and repos without config.json.

    Weights, so that no repo is downloaded twice over: the transformers shards
    (``model-00001-of-00002.safetensors``...) when ``model.safetensors.index.json`` lists them, else
    ``model.safetensors`` (then without the index), else the root ``model*.safetensors``, else every
    root ``*.safetensors``.  So another export beside them (Mistral's ``consolidated.safetensors``) is
    skipped.  Sub-folders are never fetched (they hold other formats: onnx/, original/...).
    """
    root = sorted(n for n in names if "/" not in n)
    weights = _weight_files(root)
    if not weights:
        _raise_no_weights(repo_id, root)
    if "config.json" not in root:
        raise LocalLLMError(
            f"'{repo_id}' has no config.json, so its architecture is unknown",
            "use a repo in the transformers layout (config.json beside the *.safetensors weights)",
        )
    others = {n for n in root if n in RUNTIME_FILES}
    if weights == [SAFETENSORS_SINGLE]:
        others.discard(SAFETENSORS_INDEX)
    return sorted(set(weights) | others)


def _weight_files(root: list[str]) -> list[str]:
    weights = [n for n in root if n.endswith(".safetensors")]
    transformers = [n for n in weights if fnmatchcase(n, "model*.safetensors")]
    shards = [n for n in transformers if _SHARD_RE.fullmatch(n)]
    if shards and SAFETENSORS_INDEX in root:
        return shards
    if SAFETENSORS_SINGLE in transformers:
        return [SAFETENSORS_SINGLE]
    return transformers or weights


def _raise_no_weights(repo_id: str, root: list[str]) -> None:
    pickles = [n for n in root if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise LocalLLMError(
            f"'{repo_id}' has only pickle weights ({', '.join(pickles[:3])}), which localllm refuses: "
            "loading a pickle can run arbitrary code",
            "ask the author for a safetensors export, use a repo that has *.safetensors files, "
            "or convert it yourself (load it with transformers in a sandbox, then "
            "save_pretrained(safe_serialization=True))",
        )
    raise LocalLLMError(
        f"'{repo_id}' has no *.safetensors weights",
        "use a repo that has them, or run a GGUF file directly",
    )


# --------------------------------------------------------------------------- download
def download(
    ref: str, *, token: str | None = None, offline: bool | None = None, progress: bool = True
) -> Snapshot:
    """Download what the runtime needs from ``ref`` (``REPO`` or ``REPO@REVISION``) into the HF cache.

    ``token`` overrides ``HF_TOKEN`` / the stored login (which the client reads itself).  ``offline``
    (default: ``HF_HUB_OFFLINE``) uses the cache only.  Progress bars go to stderr; ``progress=False``
    silences them.  Raises :class:`LocalLLMError` with a one-line message for every failure a user
    can meet (unknown repo, gated, bad token, unknown revision, no network, cold cache, pickle weights,
    corrupted download).
    """
    repo_id, revision = parse_ref(ref)
    endpoint = hub_endpoint()
    offline = offline_from_env() if offline is None else offline
    with _mapped_errors(repo_id, revision, endpoint, offline):
        if offline:
            return _from_cache(repo_id, revision)
        return _from_hub(repo_id, revision, endpoint, token, progress)


def _from_hub(repo_id: str, revision: str | None, endpoint: str, token: str | None, progress: bool) -> Snapshot:
    cache_dir = hub_cache_dir().resolve()
    api = HfApi(endpoint=endpoint, token=token)
    # One revision lookup, pinned for everything after: a branch that moves meanwhile cannot mix commits.
    # resolve_revision also records refs/<branch> in the cache, which offline use needs later.
    resolved = api.resolve_revision(repo_id, revision=revision, cache_dir=cache_dir)
    info = api.model_info(repo_id, revision=resolved.resolved, files_metadata=True)
    siblings = {s.rfilename: s for s in info.siblings or []}
    names = select_files(repo_id, siblings)
    storage = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
    # The cache names a blob after the file's ETag: the LFS sha256, or the git blob id of a small file.
    blobs = {n: storage / "blobs" / (siblings[n].lfs.sha256 if siblings[n].lfs else siblings[n].blob_id or "")
             for n in names}
    if "config.json" in names:  # a config localllm cannot run is refused before the weights come
        _check_config(repo_id, resolved.resolved, endpoint, token, cache_dir, siblings)
    missing = [n for n in names if not blobs[n].is_file()]
    large = [n for n in missing if siblings[n].lfs is not None]
    todo = sum(siblings[n].size or 0 for n in missing)
    done = sum(min(_size(_partial(blobs[n])), siblings[n].size or 0) for n in large)
    with _pull_progress(progress, todo, done) as bar_class:
        # One file after another: Ctrl-C stops at once (worker threads would finish their files first).
        checked = {n for n in large if _fetch_resumable(repo_id, n, resolved.resolved, siblings[n], endpoint,
                                                        token, storage, bar_class)}
        # Links the blobs just fetched into the snapshot, fetches the small files, records the tree.
        folder = snapshot_download(
            repo_id,
            revision=resolved,
            cache_dir=cache_dir,
            endpoint=endpoint,
            token=token,
            allow_patterns=[glob.escape(n) for n in names],
            tqdm_class=bar_class,
        )
    path = Path(folder)
    _verify_files(path, [n for n in names if n not in checked], siblings)
    return Snapshot(repo_id, revision or constants.DEFAULT_REVISION, resolved.resolved, path, names)


def _check_config(repo_id: str, commit: str, endpoint: str, token: str | None, cache_dir: Path,
                  siblings: dict[str, Any]) -> None:
    """Fetch the repo's ``config.json`` alone (into the cache, where the snapshot then finds it) and
    check it as loading will: an architecture localllm does not run, or sizes out of range, are one
    line before any weight is downloaded."""
    from huggingface_hub import hf_hub_download

    from localllm.runtime.config import ModelConfig

    path = Path(hf_hub_download(repo_id, "config.json", revision=commit, cache_dir=cache_dir, endpoint=endpoint,
                                token=token))
    _verify_files(path.parent, ["config.json"], siblings)
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LocalLLMError(f"{repo_id}'s config.json cannot be read ({e})", "the repo is damaged or not a model "
                                                                           "folder; pull another") from None
    if not isinstance(hf, dict):
        raise LocalLLMError(f"{repo_id}'s config.json is not a JSON object", "pull another repo")
    ModelConfig.from_hf(hf)


def _fetch_resumable(
    repo_id: str, name: str, commit: str, sibling: Any, endpoint: str, token: str | None, storage: Path,
    bar_class: type[hf_tqdm],
) -> bool:
    """Download one LFS file into the cache's blob folder so that an interrupted pull resumes on the next one.

    The bytes go to ``blobs/<etag>.incomplete``, the name the HF cache has long used for partial blobs,
    and stay there whatever stops the transfer (a dropped connection, Ctrl-C, a killed process); the
    next pull asks for the rest with ``Range: bytes=N-``.  Naming it after the ETag (the sha256 of
    the content) means the kept bytes can only ever be resumed against the same file.  The transfer
    is the client's own ``http_get`` (its retries, headers, progress), under the client's lock for
    that blob, so two pulls of one file take turns instead of appending to one partial file.  Only a
    complete file with the right sha256 becomes the blob; ``snapshot_download`` then links it into
    the snapshot as for any blob already in the cache.  Wrong bytes (also those kept from a previous
    pull) are deleted, so the next pull starts over.

    Every LFS file goes this way, also those the Hub stores with Xet: the client's Xet path writes to
    a temporary file it deletes on failure too.  Plain HTTP from the Hub's CDN is one stream instead
    of Xet's parallel ones, which is what being resumable costs.

    Returns whether it checked the file's hash (False: another pull put the blob there meanwhile).
    """
    url = hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)  # what the client names the blob after
    headers = build_hf_headers(token=token)
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a signed CDN URL: like the client, never send the token there
    size = meta.size if meta.size is not None else sibling.lfs.size
    blob = storage / "blobs" / meta.etag
    partial = _partial(blob)
    lock = storage.parent / ".locks" / storage.name / f"{meta.etag}.lock"  # the client's lock for this blob
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if blob.exists():  # another pull finished it while this one waited
            return False
        if _size(partial) > size:  # longer than the file: not a prefix of it
            partial.unlink()
        with open(partial, "ab") as f:
            http_get(meta.location, f, resume_size=f.tell(), headers=headers, expected_size=size,
                     displayed_filename=name, tqdm_class=bar_class)
        actual = file_sha256(partial)
        if actual != sibling.lfs.sha256:
            partial.unlink()
            raise _corrupted(name, actual, sibling.lfs.sha256)
        os.replace(partial, blob)
    return True


def _partial(blob: Path) -> Path:
    return blob.with_name(blob.name + ".incomplete")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _from_cache(repo_id: str, revision: str | None) -> Snapshot:
    cache_dir = hub_cache_dir()
    tree = get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache_dir)
    names = select_files(repo_id, (f.path for f in tree))
    folder = snapshot_download(
        repo_id,
        revision=revision,
        cache_dir=cache_dir,
        local_files_only=True,
        allow_patterns=[glob.escape(n) for n in names],
    )
    path = Path(folder)
    sizes = {f.path: f.size for f in tree}
    for name in names:  # hashes were checked when downloaded; a size check is cheap
        if (path / name).stat().st_size != sizes[name]:
            raise LocalLLMError(
                f"cached file {name} of '{repo_id}' has the wrong size", "run the pull again without HF_HUB_OFFLINE"
            )
    return Snapshot(repo_id, revision or constants.DEFAULT_REVISION, path.name, path, names)


@dataclass(frozen=True)
class DownloadedFile:
    """One file of a repo in the HF cache: its snapshot path, the commit it came from, and the sha256
    the Hub listed for it (LFS files: the cache names the blob after it; None for small files)."""

    path: Path
    commit: str
    sha256: str | None


def download_file(repo_id: str, filename: str, revision: str | None = None, *, token: str | None = None,
                  offline: bool | None = None) -> DownloadedFile:
    """Download one file of a repo (a GGUF file, say) through the client's ``hf_hub_download``: its
    cache, lock, retries and progress bar, with the same one-line errors as :func:`download`.

    The content is not hashed here: the caller reads the file anyway and compares with ``sha256``.
    """
    from huggingface_hub import hf_hub_download

    endpoint = hub_endpoint()
    offline = offline_from_env() if offline is None else offline
    with _mapped_errors(repo_id, revision, endpoint, offline):
        try:
            local = Path(hf_hub_download(
                repo_id, filename, revision=revision, cache_dir=hub_cache_dir(), endpoint=endpoint, token=token,
                local_files_only=offline, tqdm_class=ProgressBar,
            ))
        except RemoteEntryNotFoundError as e:
            raise LocalLLMError(f"'{filename}' not found in '{repo_id}'",
                                f"see the repo's files at {endpoint}/{repo_id}") from e
    commit = local.parents[len(PurePosixPath(filename).parts) - 1].name  # .../snapshots/<commit>/<file>
    blob = local.resolve().name
    return DownloadedFile(local, commit, blob if re.fullmatch(r"[0-9a-f]{64}", blob) else None)


# --------------------------------------------------------------------------- integrity
def git_blob_sha1(path: Path) -> str:
    """The git object id of a file (what the Hub lists as ``blobId`` / ``oid`` for non-LFS files)."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _verify_files(folder: Path, names: list[str], siblings: dict[str, Any]) -> None:
    """Check each file against the hash the Hub listed (sha256 for LFS files, git sha1 for others).

    A mismatch removes the file from the cache (snapshot link and blob), so the next pull fetches it
    again instead of trusting a blob named after the right hash but holding the wrong bytes.
    """
    for name in names:
        sibling = siblings[name]
        path = folder / name
        if sibling.lfs is not None:
            expected, actual = sibling.lfs.sha256, file_sha256(path)
        elif sibling.blob_id:
            expected, actual = sibling.blob_id, git_blob_sha1(path)
        else:
            continue
        if actual != expected:
            _evict(path)
            raise _corrupted(name, actual, expected)


def _corrupted(name: str, actual: str, expected: str) -> LocalLLMError:
    return LocalLLMError(
        f"downloaded {name} is corrupted (hash {actual[:12]}..., the Hub lists {expected[:12]}...); "
        "the bad copy was deleted from the cache",
        "run the pull again; if it keeps failing, a proxy or disk is altering the data",
    )


def _evict(path: Path) -> None:
    """Delete a snapshot entry and the blob it points to."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path.absolute():
        blob.unlink(missing_ok=True)


# --------------------------------------------------------------------------- cache upkeep
def hub_cache_paths(snapshot: Snapshot, patterns: Iterable[str] = ("*.safetensors",)) -> list[Path]:
    """The cache paths holding the snapshot's files that match ``patterns``: snapshot links and their blobs."""
    paths: list[Path] = []
    for name in snapshot.files:
        if any(fnmatchcase(PurePosixPath(name).name, p) for p in patterns):
            link = snapshot.path / name
            paths.append(link)
            if link.is_symlink():
                paths.append(link.resolve())
    return paths


def prune(snapshot: Snapshot, patterns: Iterable[str] = ("*.safetensors",)) -> int:
    """Delete the snapshot's files matching ``patterns`` (default: the float weights) from the HF cache.

    Goes through the client's cache manager, so a blob another revision still links to is kept.
    Returns the bytes freed.  The next :func:`download` of this revision fetches them again.
    """
    wanted = set(hub_cache_paths(snapshot, patterns))
    cache_info = scan_cache_dir(snapshot.path.parents[2])
    files = [
        f
        for repo in cache_info.repos
        if repo.repo_id == snapshot.repo_id
        for rev in repo.revisions
        if rev.commit_hash == snapshot.commit_sha
        for f in rev.files
        if f.file_path in wanted
    ]
    strategy = cache_info.delete_files(*files)
    strategy.execute()
    return strategy.expected_freed_size


# --------------------------------------------------------------------------- progress
class ProgressBar(hf_tqdm):
    """The client's bars, with sizes *and* rates.

    For plain HTTP downloads ``snapshot_download`` draws its byte bars with a Xet format that has
    no rate, plus a second "transfer" bar that repeats the first; this shows one byte bar, in
    tqdm's usual format (``12.3M/45.6M [00:01<00:02, 10.2MB/s]``).  The client still decides
    whether bars show at all (not on a non-terminal stderr, nor with ``HF_HUB_DISABLE_PROGRESS_BARS``).
    A pull draws its one byte bar with it through :func:`_pull_progress`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("unit") == "B":
            kwargs.pop("bar_format", None)
            kwargs["desc"] = "Downloading"
            if str(kwargs.get("name", "")).endswith(".transfer"):
                kwargs["disable"] = True
        super().__init__(*args, **kwargs)

    def set_description(self, desc: str | None = None, refresh: bool | None = True) -> None:
        if desc and desc.startswith("Reconstruct"):
            desc = "Downloaded"
        super().set_description(desc, refresh)


class _NoProgressBar(hf_tqdm):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


@contextmanager
def _pull_progress(progress: bool, total: int, initial: int) -> Iterator[type[hf_tqdm]]:
    """The bar class for one pull: one byte bar for all it fetches, plus the client's "Fetching N files".

    Large files are fetched here (:func:`_fetch_resumable`) and small ones by ``snapshot_download``;
    so that they add up on one bar, every byte bar either makes (``http_get``'s, the snapshot's) is
    hidden and passes its updates on to one bar drawn here.  ``total`` is what the pull will fetch,
    ``initial`` what partial files already hold (so the rate counts only new bytes).
    """
    if not progress:
        yield _NoProgressBar
        return
    disable = True if total == 0 else is_tqdm_disabled(hf_logging.get_verbosity())
    shared = ProgressBar(total=total, initial=initial, unit="B", unit_scale=True, disable=disable,
                          name="huggingface_hub.snapshot_download")

    class _Feeder(ProgressBar):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            byte_bar = kwargs.get("unit") == "B"
            # The snapshot's "transfer" bar repeats the other one: feeding both would count bytes twice.
            self._into = shared if byte_bar and not str(kwargs.get("name", "")).endswith(".transfer") else None
            if byte_bar:
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if self._into is not None:
                self._into.update(n)
            return super().update(n)

    try:
        yield _Feeder
        shared.set_description("Downloaded")
    finally:
        shared.close()


# --------------------------------------------------------------------------- errors
_NETWORK_ERRORS = (httpx2.TransportError, ConnectionError, TimeoutError)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then its cause (or context), and so on."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _in_chain(error: BaseException, kind: type[BaseException]) -> bool:
    return any(isinstance(e, kind) for e in _chain(error))


def _network_cause(error: BaseException) -> BaseException | None:
    """The network error at the root of ``error`` (itself, a cause or a context), if any."""
    for current in _chain(error):
        if isinstance(current, _NETWORK_ERRORS) and not isinstance(current, OfflineModeIsEnabled):
            return current
    return None


@contextmanager
def _mapped_errors(repo_id: str, revision: str | None, endpoint: str, offline: bool) -> Iterator[None]:
    """Turn the client's exceptions into one-line :class:`LocalLLMError` messages that name the fix."""
    try:
        yield
    except LocalLLMError:
        raise
    except HFValidationError as e:
        raise LocalLLMError(f"'{repo_id}' is not a valid Hub repo id", "write it as ORG/NAME") from e
    except GatedRepoError as e:
        raise LocalLLMError(
            f"'{repo_id}' is a gated model and this account has no access to it",
            f"request access on {endpoint}/{repo_id}, then {_LOGIN_HINT}",
        ) from e
    except RepositoryNotFoundError as e:
        raise LocalLLMError(
            f"repository '{repo_id}' not found on {endpoint}",
            f"check the name; if it is private or gated, {_LOGIN_HINT}",
        ) from e
    except RevisionNotFoundError as e:
        raise LocalLLMError(
            f"revision '{revision}' not found in '{repo_id}'",
            f"check the branch, tag or commit on {endpoint}/{repo_id}",
        ) from e
    except RemoteEntryNotFoundError as e:
        raise LocalLLMError(f"a file of '{repo_id}' vanished from the Hub during the pull", "run the pull again") from e
    except HfHubHTTPError as e:
        raise _http_error(e, repo_id, endpoint) from e
    except (CachedRepoTreeNotFoundError, LocalEntryNotFoundError, RevisionResolutionError, OfflineModeIsEnabled) as e:
        raise _unavailable(e, repo_id, revision, endpoint, offline) from e
    except _NETWORK_ERRORS as e:
        raise _network_error(e, repo_id, endpoint) from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise LocalLLMError(
                f"the disk is full while pulling '{repo_id}'",
                f"free space where the Hub cache lives ({hub_cache_dir()})",
            ) from e
        if "Consistency check failed" in str(e):  # size mismatch after http_get
            raise LocalLLMError(
                f"the download of '{repo_id}' ended short (connection cut)", "run the pull again"
            ) from e
        raise


def _http_error(error: HfHubHTTPError, repo_id: str, endpoint: str) -> LocalLLMError:
    status = error.response.status_code if error.response is not None else None
    if status == 401:
        return LocalLLMError(
            f"the Hub rejected the token (401) for '{repo_id}'",
            "check HF_TOKEN, or run `hf auth login` again with a valid token",
        )
    if status == 403:
        return LocalLLMError(
            f"access to '{repo_id}' is forbidden (403)",
            "use a token with read access to it (HF_TOKEN or `hf auth login`); "
            f"if the model is gated, request access on {endpoint}/{repo_id}",
        )
    if status is not None and status >= 500:
        return LocalLLMError(f"the Hub at {endpoint} failed ({status}) on '{repo_id}'", "try again in a few minutes")
    return LocalLLMError(
        f"the Hub at {endpoint} answered {status} for '{repo_id}'", "check the repo name and try again"
    )


def _unavailable(
    error: BaseException, repo_id: str, revision: str | None, endpoint: str, offline: bool
) -> LocalLLMError:
    """The Hub was not asked (offline) or not reachable, and the cache cannot answer."""
    what = f"'{repo_id}'" + (f" at '{revision}'" if revision else "")
    if offline:
        if isinstance(error, IncompleteSnapshotError):
            return LocalLLMError(
                f"{what} is only partly in the local cache", "run the pull again without HF_HUB_OFFLINE"
            )
        return LocalLLMError(f"{what} is not in the local cache", "run without HF_HUB_OFFLINE to download it")
    if _in_chain(error, OfflineModeIsEnabled):
        return LocalLLMError(
            "the Hub client is in offline mode (HF_HUB_OFFLINE was set when it started)", "unset HF_HUB_OFFLINE"
        )
    cause = _network_cause(error)
    if cause is not None:
        return _network_error(cause, repo_id, endpoint)
    for current in _chain(error):
        if isinstance(current, HfHubHTTPError):  # e.g. a 5xx while resolving the revision
            return _http_error(current, repo_id, endpoint)
    return LocalLLMError(
        f"{what} could not be fetched from {endpoint} ({error})", "check your connection and try again"
    )


def _network_error(error: BaseException, repo_id: str, endpoint: str) -> LocalLLMError:
    if isinstance(error, (httpx2.ConnectError, httpx2.ConnectTimeout, ConnectionRefusedError)):
        return LocalLLMError(
            f"cannot reach {endpoint}",
            "check your connection, or set HF_HUB_OFFLINE=1 to use models already downloaded",
        )
    if isinstance(error, (httpx2.TimeoutException, TimeoutError)):
        return LocalLLMError(
            f"{endpoint} stopped answering while pulling '{repo_id}'", "check your connection and run the pull again"
        )
    return LocalLLMError(
        f"the download of '{repo_id}' was interrupted (connection lost: {error})",
        "run the pull again (it resumes where it stopped)",
    )
