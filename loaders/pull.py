"""Pull a model into the store: from a Hub repo's safetensors, a GGUF file of a Hub repo, a local model
folder or a local ``.gguf`` file, quantized while it streams and stored as ``NAME:SCHEME``
(:mod:`loaders.store`).

Nothing here prints: what a pull is doing goes to the ``notify`` callback (one line of text each:
"pulling ...", "quantizing to ...", "waiting for another pull ..."), the outcome comes back as a
:class:`PullResult`, and every failure a user can fix is a :class:`~localllm.errors.LocalLLMError`.
The Hub client draws its own download bar on stderr (see :mod:`loaders.hub`).

Also here: what a reference names when it is a Hub repo id (``owner/name[@rev]``): the entries
pulled from it (:func:`entries_from_repo`, :func:`find_stored`) and ``run``'s pull-if-missing.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from filelock import Timeout

from localllm.errors import LocalLLMError, disk_errors
from localllm.quant.formats import ALL_SCHEMES
from localllm.loaders.calibrate import AUTO_AWQ_PARAMETERS, PULL_CALIBRATION, calibrates_to, resolve_calibration
from localllm.loaders.store import (
    Store,
    StoredModel,
    default_entry,
    file_sha256,
    looks_like_path,
    missing_path_error,
    name_from_repo,
    validate_name,
)

if TYPE_CHECKING:  # torch-heavy modules, imported only when a pull runs
    from localllm.loaders.hub import Snapshot
    from localllm.loaders.load import Checkpoint
    from localllm.quant.formats import QuantScheme

#: One line of text about what a pull is doing (the CLI prints it on stderr).
Notify = Callable[[str], None]

#: The schemes ``pull`` stores: every scheme but fp32, which doubles a bf16 model's size for nothing.
PULL_SCHEMES = tuple(s for s in ALL_SCHEMES if s != "fp32")
DEFAULT_PULL_SCHEME = "int4"
#: A GGUF file name's quantization suffix: ``.Q4_1``, ``-Q4_K_M``, ``.IQ2_XS``, ``-F16``, ``.BF16``.
_GGUF_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16|FP16)$", re.IGNORECASE)
#: ``owner/name`` or ``owner/name@revision``: a Hub repo id as ``run`` recognizes one.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(?:@[\w./-]+)?")


def _silent(message: str) -> None:
    pass


# =========================================================================== what to pull
@dataclass(frozen=True)
class PullSource:
    """What to pull: ``kind`` is ``hub`` (safetensors repo), ``hub-gguf``, ``folder`` or ``gguf``."""

    kind: str
    ref: str  # repo id, or a resolved local path
    revision: str | None = None
    file: str | None = None  # the GGUF file inside a Hub repo

    def default_name(self) -> str:
        if self.kind == "hub":
            return name_from_repo(self.ref)
        if self.kind == "folder":
            return name_from_repo(Path(self.ref).name)
        return gguf_name(self.file or self.ref)

    def label(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"{self.ref}{at}" + (f" ({self.file})" if self.file else "")


@dataclass(frozen=True)
class PullOptions:
    quant: str | None = None  # None: a quantized Hub repo's or GGUF file's own format, else DEFAULT_PULL_SCHEME
    group_size: int | None = None
    quant_head: str | bool | None = None  # None: as the source has it; False: a 16-bit head
    name: str | None = None
    prune: bool = False
    force: bool = False
    calibration: str = PULL_CALIBRATION  # int4 from float weights: data-aware (awq) or round to nearest (none)


@dataclass
class Fetched:
    """A pulled source on local disk: its checkpoint and what the manifest records about it."""

    ckpt: Checkpoint
    source: dict[str, Any]
    seconds: float
    nbytes: int
    snapshot: Snapshot | None = None  # Hub safetensors pulls: what --prune deletes

    @property
    def downloaded(self) -> bool:
        """From the Hub (else read from local files: hashed and opened)."""
        return "repo" in self.source


@dataclass
class PullResult:
    """What a pull did. ``kept``: the entry was already stored and nothing was fetched (``fetched`` is
    None then). ``pruned_bytes``: what ``prune`` freed, None when nothing was pruned."""

    entry: StoredModel
    kept: bool = False
    fetched: Fetched | None = None
    quantize_s: float = 0.0
    pruned_bytes: int | None = None


def gguf_name(filename: str) -> str:
    """Store name of a GGUF file: its stem in lower case without the quantization suffix
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct``)."""
    stem = PurePosixPath(filename).name.removesuffix(".gguf")
    return name_from_repo(_GGUF_QUANT_SUFFIX.sub("", stem) or stem)


def parse_source(source: str, revision: str | None = None, gguf: str | None = None) -> PullSource:
    """Tell a local ``.gguf`` file or model folder from a Hub ``REPO[@REV]`` (with ``--gguf FILE``)."""
    path = Path(source).expanduser()
    if path.exists():
        if gguf or revision:
            raise LocalLLMError(f"--{'gguf' if gguf else 'revision'} applies to Hub repos, and {source} is a local path",
                                "give the local file or folder alone")
        if path.is_dir():
            return PullSource("folder", str(path.resolve()))
        if path.suffix == ".gguf":
            return PullSource("gguf", str(path.resolve()))
        raise LocalLLMError(f"cannot pull {source}", "give a Hub repo id, a model folder or a .gguf file")
    if looks_like_path(source):
        raise missing_path_error(source)
    from localllm.loaders.hub import parse_ref

    repo_id, rev = parse_ref(source)
    if revision and rev and revision != rev:
        raise LocalLLMError(f"two revisions given: '{rev}' in {source} and --revision {revision}", "give one")
    if gguf is not None and not gguf.endswith(".gguf"):
        raise LocalLLMError(f"--gguf {gguf} is not a .gguf file name", "name a .gguf file of the repo")
    return PullSource("hub-gguf" if gguf else "hub", repo_id, revision or rev, gguf)


def check_quant(quant: str, group_size: int | None) -> None:
    """Refuse an unknown scheme or group size before anything is downloaded."""
    from localllm.quant.formats import parse_scheme

    if quant not in PULL_SCHEMES:
        raise LocalLLMError(f"unknown quantization scheme '{quant}'", f"use one of {', '.join(PULL_SCHEMES)}")
    parse_scheme(quant, group_size)


# =========================================================================== pulling
def pull_model(source: PullSource, options: PullOptions, store: Store | None = None,
               notify: Notify = _silent) -> PullResult:
    """Fetch ``source``, convert it to ``options.quant`` and store it.

    An entry already stored from the same source in the same scheme is kept as it is (unless
    ``force``; the result says ``kept``); the same name stored from another source is an error (pick
    another ``name``). Two pulls of one entry at once take turns on the entry's lock: the second
    finds it stored.
    """
    store = store or Store()
    check_quant(options.quant or DEFAULT_PULL_SCHEME, options.group_size)
    name = validate_name(options.name or source.default_name())
    with disk_errors(f"pull {source.label()}", "point LOCALLLM_HOME (the store) and HF_HOME (downloads) at a "
                                                "folder on a disk with room"):
        return _pull(source, options, store, name, notify)


def _pull(source: PullSource, options: PullOptions, store: Store, name: str, notify: Notify) -> PullResult:
    kept = _already_stored(store, name, source, options, notify)
    if kept is not None:
        return PullResult(kept, kept=True)
    fetched = fetch(source, notify)
    from localllm.loaders.convert import convert_to_store, entry_scheme
    from localllm.loaders.hub_quant import source_format
    from localllm.loaders.load import choose_scheme
    from localllm.quant.formats import parse_scheme

    # The scheme asked for, else the source's own: a quantized Hub repo's format (:mod:`loaders.hub_quant`),
    # a quantized GGUF's blocks (every tensor on its own grid, as `run FILE.gguf` loads it); a float
    # source is quantized to int4. With no group size, --quant int4 of a Q4 GGUF keeps its own grid.
    own = fetched.ckpt.default_scheme()
    scheme = choose_scheme(fetched.ckpt, options.quant, options.group_size) or parse_scheme(
        options.quant or DEFAULT_PULL_SCHEME, options.group_size)
    with _entry_lock(store, name, entry_scheme(scheme), notify):
        # another pull may have finished meanwhile; the entry this one writes is now known exactly
        kept = _already_stored(store, name, source, options, notify, entry_scheme(scheme))
        if kept is not None:
            return PullResult(kept, kept=True)
        # the source's format, for the manifest: a Hub-quantized repo's, a GGUF file's types
        found = source_format(fetched.ckpt) or gguf_format(fetched.ckpt)
        calibration = resolve_calibration(options.calibration, fetched.ckpt.config)
        if own is None:  # float weights: quantized here
            awq = calibrates_to(fetched.ckpt, scheme, calibration)
            too_large = options.calibration == "auto" and calibration == "none"
            if too_large and calibrates_to(fetched.ckpt, scheme, "awq"):
                notify(f"rounding to nearest: data-aware scales (--calibration awq) take about an hour a billion "
                       f"parameters on a CPU; auto computes them up to {AUTO_AWQ_PARAMETERS / 1e9:g}B")
            notify(f"quantizing to {scheme.label()}{' with data-aware scales (awq)' if awq else ''}...")
        elif scheme == own:
            notify(_storing_exactly(found.get("format") or {}, scheme))
        else:
            fmt = found.get("format") or {}
            gguf_file = fmt.get("method") == GGUF_METHOD
            notify(f"re-quantizing its {fmt.get('type') if gguf_file else fmt.get('label', own.label())} weights to "
                   f"{scheme.label()} from their {'dequantized' if gguf_file else 'exact'} values...")
        entry, quantize_s = convert_to_store(fetched.ckpt, scheme, name, store, {**fetched.source, **found},
                                             options.quant_head, calibration)
    freed = None
    if options.prune:
        if fetched.snapshot is None:
            notify("--prune: nothing to prune (only Hub safetensors pulls leave files in the HF cache)")
        else:
            from localllm.loaders.hub import prune

            freed = prune(fetched.snapshot)
    return PullResult(entry, False, fetched, quantize_s, freed)


# --------------------------------------------------------------------------- a GGUF file's format
#: ``source.format.method`` of an entry pulled from a GGUF file.
GGUF_METHOD = "gguf"


def gguf_format(ckpt: Any) -> dict[str, Any]:
    """``{"format": {...}}`` for a GGUF file (what a manifest's ``source`` records, beside a Hub
    format's): ``type``, its main tensor type (the one its own scheme keeps: ``Q4_K``; for a float file
    its most common one); ``file_type``, llama.cpp's name for the file's mix (``Q4_K_M``; None when the
    metadata has none); ``tensor_types``, how many tensors of each type it holds; ``scheme``, the scheme
    that keeps it on its own grids (None: a float file, which a pull quantizes); and a ``label``.
    Nothing for other checkpoints."""
    from localllm.loaders.gguf import GGUFCheckpoint
    from localllm.quant.gguf_blocks import exact_scheme

    if not isinstance(ckpt, GGUFCheckpoint):
        return {}
    own = ckpt.default_scheme()
    counts = Counter(t.tensor_type.name for t in ckpt.reader.tensors)
    weights = Counter(t.tensor_type.name for t in ckpt.reader.tensors if len(t.shape) >= 2) or counts
    kept = [k for k in weights if own is not None and exact_scheme(k) == own]
    main = max(kept or weights, key=lambda k: weights[k])
    file_type = _file_type(ckpt.metadata.get("general.file_type"))
    types = ", ".join(f"{n} {k}" for k, n in counts.most_common())
    return {"format": {"method": GGUF_METHOD, "type": main, "file_type": file_type, "tensor_types": dict(counts),
                       "scheme": own.to_dict() if own is not None else None,
                       "label": f"GGUF {file_type or main} ({types} tensors)"}}


def _file_type(value: Any) -> str | None:
    """llama.cpp's ``general.file_type`` as its name (``15`` -> ``Q4_K_M``; ``ALL_F32`` -> ``F32``)."""
    import gguf

    try:
        name = gguf.LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return None
    return None if name == "GUESSED" else name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _storing_exactly(fmt: dict[str, Any], scheme: QuantScheme) -> str:
    """The progress line of a source stored in its own format: ``storing its Q4_K weights exactly,
    its Q6_K and Q8_0 tensors in theirs...``."""
    if fmt.get("method") != GGUF_METHOD:
        return f"storing its {fmt.get('label', scheme.label())} weights as {scheme.label()}, exactly..."
    floats = ("F32", "F16", "BF16")
    others = [k for k in fmt["tensor_types"] if k not in floats and k != fmt["type"]]
    grid = "" if scheme.name == "gguf" else f" as {scheme.label()}"
    listed = ", ".join(others[:-1]) + f" and {others[-1]}" if len(others) > 1 else "".join(others)
    theirs = f", its {listed} tensors on their own grids" if others else ""
    return f"storing its {fmt['type']} weights exactly{grid}{theirs}..."


# --------------------------------------------------------------------------- already stored?
def kept_for(entry: StoredModel, quant: str | None) -> bool:
    """Whether ``entry`` is what a pull asking ``quant`` (None: nothing asked) writes: that scheme
    (int4 by default), or the source's own format: a GGUF file's grids (its manifest's
    ``source.format.scheme``; a float file's int4), a quantized Hub repo's (``int4z`` for int4; with
    nothing asked, whichever it landed on)."""
    fmt = _source_format(entry)
    if fmt.get("method") == GGUF_METHOD:
        if quant is not None:
            return entry.scheme == quant
        if fmt.get("scheme") is None:  # a float file: quantized to the default
            return entry.scheme == DEFAULT_PULL_SCHEME
        return (entry.manifest.get("quant") or {}).get("scheme") == fmt["scheme"]
    own = bool(fmt)
    if quant is None:
        return entry.scheme == DEFAULT_PULL_SCHEME or own
    return entry.scheme == quant or (own and entry.scheme == f"{quant}z")


def _source_format(entry: StoredModel) -> dict[str, Any]:
    """An entry's ``source.format`` (empty: a float source, or a GGUF pulled before formats were recorded)."""
    return (entry.manifest.get("source") or {}).get("format") or {}


def _stored_for(store: Store, name: str, quant: str | None) -> StoredModel | None:
    """The entry named ``name`` that a pull asking ``quant`` would have written, if one is stored."""
    entries = [e for e in store.list() if e.name == name and kept_for(e, quant)]
    asked = quant or DEFAULT_PULL_SCHEME
    return next((e for e in entries if e.scheme == asked), entries[0] if entries else None)


def _already_stored(store: Store, name: str, source: PullSource, options: PullOptions,
                    notify: Notify, tag: str | None = None) -> StoredModel | None:
    """The stored entry if this pull has nothing to do; None when it must run. ``tag``: the entry this
    pull writes, once its source is open; before, the entry is found by what the pull asks. A GGUF file
    pulled without ``--quant`` lands on a tag its types decide: before it is open, only an entry of the
    same file holding its own format is looked for (another source's entry of that name is no conflict
    yet; one stored before formats were recorded may be re-quantized)."""
    if tag is not None:
        existing = store.get(name, tag)
    elif options.quant is None and source.kind in ("gguf", "hub-gguf"):
        existing = next((e for e in store.list() if e.name == name and _source_format(e).get("method") == GGUF_METHOD
                         and kept_for(e, None) and same_source(e.manifest["source"], source)), None)
    else:
        existing = _stored_for(store, name, options.quant)
    if existing is None or options.force:
        return None
    theirs = existing.manifest.get("source") or {}
    if not same_source(theirs, source):
        raise LocalLLMError(
            f"'{existing.ref}' is already stored from {source_label(theirs)}",
            "give this one another name with --name, or replace it with --force",
        )
    quant = existing.manifest.get("quant") or {}
    same_group = options.group_size is None or (quant.get("scheme") or {}).get("group_size") == options.group_size
    from localllm.loaders.artifact import plan_from_manifest

    head = plan_from_manifest(quant).get("output") if quant else None  # None: a 16-bit head
    # --quant-head none arrives as False: it matches a stored 16-bit head.
    same_head = options.quant_head is None or (head.name if head else False) == options.quant_head
    same_calibration = options.calibration != "none" or "calibration" not in existing.manifest
    if not (same_group and same_head and same_calibration):
        notify(f"replacing '{existing.ref}' (stored with other quantization settings)")
        return None
    return existing


def same_source(stored: dict[str, Any], source: PullSource) -> bool:
    """Whether a manifest's ``source`` is this pull's source (a revision counts when one is given)."""
    if source.kind in ("hub", "hub-gguf"):
        if str(stored.get("repo", "")).lower() != source.ref.lower() or stored.get("file") != source.file:
            return False
        return source.revision is None or source.revision in (stored.get("revision"), stored.get("commit"))
    if source.kind == "gguf":
        return stored.get("sha256") == _file_sha256(Path(source.ref))
    return stored.get("path") == source.ref


def source_label(source: dict[str, Any]) -> str:
    """A manifest's ``source`` in a few words: ``repo@revision (file)``, or the local path."""
    if source.get("repo"):
        return f"{source['repo']}@{source.get('revision') or 'main'}" + (f" ({source['file']})" if source.get("file") else "")
    return str(source.get("path") or "an unknown source")


@contextmanager
def _entry_lock(store: Store, name: str, scheme: str, notify: Notify) -> Iterator[None]:
    """Hold the store's lock of ``name:scheme`` (re-entrant: ``Store.write`` takes it again to publish)."""
    lock = store.lock(name, scheme)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        notify(f"waiting for another pull of '{name}:{scheme}' to finish...")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


# --------------------------------------------------------------------------- fetching
def fetch(source: PullSource, notify: Notify = _silent) -> Fetched:
    """The source on local disk (downloaded into the HF cache for Hub sources), opened as a checkpoint."""
    if source.kind == "hub":
        return _fetch_hub(source, notify)
    if source.kind == "hub-gguf":
        return _fetch_hub_gguf(source, notify)
    if source.kind == "gguf":
        return _open_gguf(Path(source.ref), {"path": source.ref}, 0.0)
    from localllm.loaders.hub_quant import open_hf_folder

    ckpt = open_hf_folder(Path(source.ref))
    return Fetched(ckpt, {"path": source.ref}, 0.0, sum(f.stat().st_size for f in ckpt.files))


def _fetch_hub(source: PullSource, notify: Notify) -> Fetched:
    from localllm.loaders import hub
    from localllm.loaders.hub_quant import open_hf_folder

    notify(f"pulling {source.label()}")
    t0 = time.perf_counter()
    snapshot = hub.download(source.ref + (f"@{source.revision}" if source.revision else ""))
    seconds = time.perf_counter() - t0
    nbytes = sum((snapshot.path / n).stat().st_size for n in snapshot.files)
    recorded = {"repo": snapshot.repo_id, "revision": snapshot.revision, "commit": snapshot.commit_sha}
    return Fetched(open_hf_folder(snapshot.path), recorded, seconds, nbytes, snapshot)


def _fetch_hub_gguf(source: PullSource, notify: Notify) -> Fetched:
    """One GGUF file of a Hub repo (:func:`loaders.hub.download_file`), its sha256 checked against the Hub's."""
    from localllm.loaders import hub

    assert source.file is not None
    notify(f"pulling {source.label()}")
    t0 = time.perf_counter()
    got = hub.download_file(source.ref, source.file, source.revision)
    seconds = time.perf_counter() - t0
    recorded = {"repo": source.ref, "revision": source.revision or "main", "commit": got.commit, "file": source.file}
    return _open_gguf(got.path, recorded, seconds, expected_sha256=got.sha256)


def _open_gguf(path: Path, recorded: dict[str, Any], seconds: float, expected_sha256: str | None = None) -> Fetched:
    from localllm.loaders.gguf import GGUFCheckpoint

    t0 = time.perf_counter()
    digest = _file_sha256(path)
    if expected_sha256 is not None and digest != expected_sha256:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise LocalLLMError(f"downloaded {path.name} is corrupted (sha256 {digest[:12]}..., the Hub lists "
                            f"{expected_sha256[:12]}...); the bad copy was deleted", "run the pull again")
    ckpt = GGUFCheckpoint(path)
    return Fetched(ckpt, {**recorded, "sha256": digest}, seconds + time.perf_counter() - t0, path.stat().st_size)


_HASHED: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) for this process (a pull may ask twice)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = file_sha256(path)
    return _HASHED[key]


# =========================================================================== Hub repo ids as references
def looks_like_repo(ref: str) -> bool:
    """``owner/name[@rev]`` that is not a local path."""
    return bool(_REPO_ID.fullmatch(ref)) and not Path(ref).expanduser().exists()


def entries_from_repo(store: Store, repo_id: str) -> list[StoredModel]:
    """Stored entries pulled from the safetensors of Hub repo ``repo_id`` (any name)."""
    return [e for e in store.list()
            if str((e.manifest.get("source") or {}).get("repo", "")).lower() == repo_id.lower()
            and not (e.manifest.get("source") or {}).get("file")]


def find_stored(store: Store, ref: str) -> StoredModel:
    """A stored entry by ``name[:scheme]``, or by the Hub repo it was pulled from (``owner/name``)."""
    if looks_like_repo(ref):
        from localllm.loaders.hub import parse_ref

        entries = entries_from_repo(store, parse_ref(ref)[0])
        if entries:
            return default_entry(entries)
    return store.resolve(ref)


def pull_if_missing(model: str, quant: str | None = None, group_size: int | None = None,
                    notify: Notify = _silent, calibration: str = PULL_CALIBRATION) -> str:
    """What ``run`` should load for MODEL: MODEL itself, unless it is a Hub repo id (``owner/name``),
    which is then pulled first (in ``quant`` when it is a pull scheme, else int4) unless already stored.
    Returns the store reference (``name:scheme``)."""
    if not looks_like_repo(model):
        return model
    scheme = quant if quant in PULL_SCHEMES else DEFAULT_PULL_SCHEME
    source = parse_source(model)
    store = Store()
    asked = quant in PULL_SCHEMES  # else a quantized Hub repo keeps its own format (int4 for the others)
    for entry in entries_from_repo(store, source.ref):
        if kept_for(entry, scheme if asked else None) and same_source(entry.manifest["source"], source):
            return entry.ref
    notify(f"'{model}' is not stored yet: pulling it ({scheme if asked else 'its own format, else ' + scheme})")
    options = PullOptions(scheme if asked else None, group_size, calibration=calibration)
    return pull_model(source, options, store, notify).entry.ref
