"""``localllm pull | list | show | rm``: the local model store from the command line.

``pull`` fetches a model (a Hub repo's safetensors, a GGUF file in a Hub repo, a local model folder or
``.gguf`` file), quantizes it while streaming and stores it as ``NAME:SCHEME`` (see
:mod:`loaders.store`).  Tables and JSON go to stdout; progress, notes and summaries to stderr.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import click
from filelock import Timeout

from localllm.errors import LocalLLMError
from localllm.format import human_size
from localllm.loaders.store import Store, StoredModel, file_sha256, name_from_repo, validate_name

if TYPE_CHECKING:  # torch-heavy modules, imported by the commands only when they run
    from localllm.loaders.hub import Snapshot
    from localllm.loaders.load import Checkpoint

#: The schemes ``pull`` stores (fp32 is left out: it doubles a bf16 model's size for nothing).
PULL_SCHEMES = ("bf16", "fp16", "int8", "int4", "nf4")
DEFAULT_PULL_SCHEME = "int4"
#: A GGUF file name's quantization suffix: ``.Q4_1``, ``-Q4_K_M``, ``.IQ2_XS``, ``-F16``, ``.BF16``.
_GGUF_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16|FP16)$", re.IGNORECASE)
#: ``owner/name`` or ``owner/name@revision``: a Hub repo id as ``run`` recognizes one.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(?:@[\w./-]+)?")
_CACHE_VALUE_BYTES = 2  # fp16 / bf16 KV cache


# =========================================================================== pull
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
    quant: str = DEFAULT_PULL_SCHEME
    group_size: int | None = None
    quant_head: str | None = None
    name: str | None = None
    prune: bool = False
    force: bool = False


@dataclass
class Fetched:
    """A pulled source on local disk: its checkpoint and what the manifest records about it."""

    ckpt: Checkpoint
    source: dict[str, Any]
    seconds: float
    nbytes: int
    snapshot: Snapshot | None = None  # Hub safetensors pulls: what --prune deletes


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
    if source.startswith((".", "/", "~")) or source.endswith(".gguf"):
        raise LocalLLMError(f"{source} not found", "check the path, or give a Hub repo id such as ORG/NAME")
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


def pull_model(source: PullSource, options: PullOptions, store: Store | None = None) -> StoredModel:
    """Fetch ``source``, convert it to ``options.quant`` and store it; return the entry.

    An entry already stored from the same source in the same scheme is kept as it is (unless
    ``force``); the same name stored from another source is an error (pick another ``--name``).
    Two pulls of one entry at once take turns on the entry's lock: the second finds it stored.
    """
    store = store or Store()
    check_quant(options.quant, options.group_size)
    name = validate_name(options.name or source.default_name())
    kept = _already_stored(store, name, source, options)
    if kept is not None:
        return kept
    fetched = _fetch(source)
    from localllm.loaders.convert import convert_to_store
    from localllm.loaders.load import choose_scheme
    from localllm.quant.formats import parse_scheme

    # The scheme asked for; with no group size, a Q4 GGUF's own grid (its blocks are then kept exactly).
    scheme = choose_scheme(fetched.ckpt, options.quant, options.group_size) or parse_scheme(options.quant)
    with _entry_lock(store, name, scheme.name):
        kept = _already_stored(store, name, source, options)  # another pull may have finished meanwhile
        if kept is not None:
            return kept
        click.echo(f"quantizing to {scheme.label()}...", err=True)
        entry, quant_s = convert_to_store(fetched.ckpt, scheme, name, store, fetched.source, options.quant_head)
    freed = _prune(fetched) if options.prune else None
    _summary(entry, fetched, quant_s, freed)
    return entry


def _already_stored(store: Store, name: str, source: PullSource, options: PullOptions) -> StoredModel | None:
    """The stored entry if this pull has nothing to do (and says so); None when it must run."""
    existing = store.get(name, options.quant)
    if existing is None or options.force:
        return None
    theirs = existing.manifest.get("source") or {}
    if not _same_source(theirs, source):
        raise LocalLLMError(
            f"'{existing.ref}' is already stored from {_source_label(theirs)}",
            "give this one another name with --name, or replace it with --force",
        )
    quant = existing.manifest.get("quant") or {}
    same_group = options.group_size is None or (quant.get("scheme") or {}).get("group_size") == options.group_size
    from localllm.loaders.artifact import plan_from_manifest

    head = plan_from_manifest(quant).get("output") if quant else None  # None: a 16-bit head
    # --quant-head none arrives as False: it matches a stored 16-bit head.
    same_head = options.quant_head is None or (head.name if head else False) == options.quant_head
    if not (same_group and same_head):
        click.echo(f"replacing '{existing.ref}' (stored with other quantization settings)", err=True)
        return None
    click.echo(f"'{existing.ref}' is already stored ({existing.size}); use --force to pull it again", err=True)
    click.echo(f"run it:    localllm run {existing.ref}", err=True)
    return existing


def _same_source(stored: dict[str, Any], source: PullSource) -> bool:
    """Whether a manifest's ``source`` is this pull's source (a revision counts when one is given)."""
    if source.kind in ("hub", "hub-gguf"):
        if str(stored.get("repo", "")).lower() != source.ref.lower() or stored.get("file") != source.file:
            return False
        return source.revision is None or source.revision in (stored.get("revision"), stored.get("commit"))
    if source.kind == "gguf":
        return stored.get("sha256") == _file_sha256(Path(source.ref))
    return stored.get("path") == source.ref


def _source_label(source: dict[str, Any]) -> str:
    if source.get("repo"):
        return f"{source['repo']}@{source.get('revision') or 'main'}" + (f" ({source['file']})" if source.get("file") else "")
    return str(source.get("path") or "an unknown source")


@contextmanager
def _entry_lock(store: Store, name: str, scheme: str) -> Iterator[None]:
    """Hold the store's lock of ``name:scheme`` (re-entrant: ``Store.write`` takes it again to publish)."""
    lock = store.lock(name, scheme)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        click.echo(f"waiting for another pull of '{name}:{scheme}' to finish...", err=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


# --------------------------------------------------------------------------- fetching
def _fetch(source: PullSource) -> Fetched:
    if source.kind == "hub":
        return _fetch_hub(source)
    if source.kind == "hub-gguf":
        return _fetch_hub_gguf(source)
    if source.kind == "gguf":
        return _open_gguf(Path(source.ref), {"path": source.ref}, 0.0)
    from localllm.loaders.checkpoint import HFCheckpoint

    ckpt = HFCheckpoint(Path(source.ref))
    return Fetched(ckpt, {"path": source.ref}, 0.0, sum(f.stat().st_size for f in ckpt.files))


def _fetch_hub(source: PullSource) -> Fetched:
    from localllm.loaders import hub
    from localllm.loaders.checkpoint import HFCheckpoint

    click.echo(f"pulling {source.label()}", err=True)
    t0 = time.perf_counter()
    snapshot = hub.download(source.ref + (f"@{source.revision}" if source.revision else ""))
    seconds = time.perf_counter() - t0
    nbytes = sum((snapshot.path / n).stat().st_size for n in snapshot.files)
    recorded = {"repo": snapshot.repo_id, "revision": snapshot.revision, "commit": snapshot.commit_sha}
    return Fetched(HFCheckpoint(snapshot.path), recorded, seconds, nbytes, snapshot)


def _fetch_hub_gguf(source: PullSource) -> Fetched:
    """One GGUF file of a Hub repo, through the client's ``hf_hub_download`` (its cache, lock and retries)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    from localllm.loaders import hub

    assert source.file is not None
    click.echo(f"pulling {source.label()}", err=True)
    endpoint, offline = hub.hub_endpoint(), hub.offline_from_env()
    t0 = time.perf_counter()
    # hub's error mapping (private there, shared here) gives the same one-line messages as safetensors pulls.
    with hub._mapped_errors(source.ref, source.revision, endpoint, offline):
        try:
            local = Path(hf_hub_download(
                source.ref, source.file, revision=source.revision, cache_dir=hub.hub_cache_dir(),
                endpoint=endpoint, local_files_only=offline, tqdm_class=hub._ProgressBar,
            ))
        except RemoteEntryNotFoundError as e:
            raise LocalLLMError(f"'{source.file}' not found in '{source.ref}'",
                                f"see the repo's files at {endpoint}/{source.ref}") from e
    seconds = time.perf_counter() - t0
    commit = local.parents[len(PurePosixPath(source.file).parts) - 1].name  # .../snapshots/<commit>/<file>
    recorded = {"repo": source.ref, "revision": source.revision or "main", "commit": commit, "file": source.file}
    return _open_gguf(local, recorded, seconds, expected_sha256=_lfs_etag(local))


def _lfs_etag(link: Path) -> str | None:
    """The sha256 the Hub listed for a cached LFS file: the cache names its blob after it."""
    name = link.resolve().name
    return name if re.fullmatch(r"[0-9a-f]{64}", name) else None


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


def _prune(fetched: Fetched) -> int | None:
    """Delete the float weights just converted from the HF cache (Hub safetensors pulls only)."""
    if fetched.snapshot is None:
        click.echo("--prune: nothing to prune (only Hub safetensors pulls leave files in the HF cache)", err=True)
        return None
    from localllm.loaders.hub import prune

    return prune(fetched.snapshot)


def _summary(entry: StoredModel, fetched: Fetched, quant_s: float, freed: int | None) -> None:
    fetched_what = "download" if "repo" in fetched.source else "read"  # local files: hashing and opening
    click.echo(f"{fetched_what + ':':<10} {fetched.seconds:.2f}s ({human_size(fetched.nbytes)})", err=True)
    click.echo(f"{'quantize:':<10} {quant_s:.2f}s", err=True)
    click.echo(f"{'stored:':<10} {entry.ref}, {entry.size}", err=True)
    if freed is not None:
        click.echo(f"{'pruned:':<10} {human_size(freed)} of downloaded weights from the HF cache", err=True)
    click.echo(f"{'run it:':<10} localllm run {entry.ref}", err=True)


@click.command()
@click.argument("source")
@click.option("--quant", "-q", default=DEFAULT_PULL_SCHEME, show_default=True, metavar="|".join(PULL_SCHEMES),
              help="Weight scheme to store.")
@click.option("--group-size", type=int, help="Group size (int4: 32/64/128/256, default 32; a Q4 GGUF keeps its own).")
@click.option("--quant-head", type=click.Choice(["int8", "int4", "nf4", "none"]),
              callback=lambda ctx, param, value: False if value == "none" else value,
              help="Scheme of the output head (int8 also serves a tied embedding table); none = 16-bit. "
                   "Default: as stored, else 16-bit.")
@click.option("--name", help="Store name (default: the repo's or file's base name, lower case).")
@click.option("--revision", help="Branch, tag or commit of a Hub repo (same as REPO@REV).")
@click.option("--gguf", "gguf_file", metavar="FILE", help="Import this GGUF file of the Hub repo instead of its safetensors.")
@click.option("--prune", is_flag=True, help="Delete the downloaded float weights from the HF cache afterwards.")
@click.option("--force", "-f", is_flag=True, help="Pull and convert again even if already stored.")
def pull(source: str, quant: str, group_size: int | None, quant_head: str | None, name: str | None, revision: str | None,
         gguf_file: str | None, prune: bool, force: bool) -> None:
    """Download SOURCE, quantize it and store it.

    SOURCE is a Hub repo (ORG/NAME[@REV]), a local model folder or a local .gguf file.
    """
    options = PullOptions(quant, group_size, quant_head, name, prune, force)
    pull_model(parse_source(source, revision, gguf_file), options)


# =========================================================================== run's auto-pull
def looks_like_repo(model: str) -> bool:
    """``owner/name[@rev]`` that is not a local path."""
    return bool(_REPO_ID.fullmatch(model)) and not Path(model).expanduser().exists()


def entries_from_repo(store: Store, repo_id: str) -> list[StoredModel]:
    """Stored entries pulled from the safetensors of Hub repo ``repo_id`` (any name)."""
    return [e for e in store.list()
            if str((e.manifest.get("source") or {}).get("repo", "")).lower() == repo_id.lower()
            and not (e.manifest.get("source") or {}).get("file")]


def pull_if_missing(model: str, quant: str | None = None, group_size: int | None = None) -> str:
    """What ``run`` should load for MODEL: MODEL itself, unless it is a Hub repo id (``owner/name``),
    which is then pulled first (in ``quant`` when it is a pull scheme, else int4) unless already stored.
    Returns the store reference (``name:scheme``)."""
    if not looks_like_repo(model):
        return model
    scheme = quant if quant in PULL_SCHEMES else DEFAULT_PULL_SCHEME
    source = parse_source(model)
    store = Store()
    for entry in entries_from_repo(store, source.ref):
        if entry.scheme == scheme and _same_source(entry.manifest["source"], source):
            return entry.ref
    click.echo(f"'{model}' is not stored yet: pulling it ({scheme})", err=True)
    return pull_model(source, PullOptions(scheme, group_size), store).ref


# =========================================================================== list
def human_ago(then: datetime, now: datetime | None = None) -> str:
    """How long ago, as Ollama writes it: "Less than a second ago", "About a minute ago", "3 days ago"."""
    seconds = max(0.0, ((now or datetime.now(timezone.utc)) - then).total_seconds())
    if seconds < 1:
        return "Less than a second ago"
    for limit, unit, size in ((60, "second", 1), (3600, "minute", 60), (86400, "hour", 3600), (7 * 86400, "day", 86400),
                              (30 * 86400, "week", 7 * 86400), (365 * 86400, "month", 30 * 86400)):
        if seconds < limit:
            return _ago(int(seconds // size), unit)
    return _ago(int(seconds // (365 * 86400)), "year")


def _ago(n: int, unit: str) -> str:
    if n != 1:
        return f"{n} {unit}s ago"
    if unit in ("minute", "hour"):
        return f"About {'an' if unit == 'hour' else 'a'} {unit} ago"
    return f"1 {unit} ago"


def scheme_short(manifest: dict[str, Any]) -> str:
    """A stored scheme in a few characters: ``int4 g32``, ``int4 g32 sym``, ``int8``, ``nf4 b64``, ``bf16``."""
    q = (manifest.get("quant") or {}).get("scheme")
    if not q:
        return str(manifest.get("dtype") or manifest.get("scheme"))
    name, group = q["name"], q.get("group_size")
    if name == "int4":
        return f"int4 g{group}" + (" sym" if q.get("symmetric") else "")
    if name == "nf4":
        return f"nf4 b{group}"
    return name + (f" g{group}" if group else "")


def list_json(entry: StoredModel) -> dict[str, Any]:
    """One ``list --json`` object: name (NAME:SCHEME), model, scheme, quant, size (bytes), modified (ISO 8601), source, path."""
    return {
        "name": entry.ref,
        "model": entry.name,
        "scheme": entry.scheme,
        "quant": (entry.manifest.get("quant") or {}).get("scheme"),
        "size": entry.size_bytes,
        "modified": entry.modified.isoformat(),
        "source": entry.manifest.get("source"),
        "path": str(entry.path),
    }


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns three spaces apart, the way ``ollama ls`` prints."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="A JSON list of objects instead of the table.")
def list_models(as_json: bool) -> None:
    """List stored models."""
    entries = Store().list()
    if as_json:
        click.echo(json.dumps([list_json(e) for e in entries], indent=2))
        return
    rows = [["NAME", "SCHEME", "SIZE", "MODIFIED"]]
    rows += [[e.ref, scheme_short(e.manifest), e.size, human_ago(e.modified)] for e in entries]
    click.echo(table(rows))
    if not entries:
        click.echo("no models stored yet; pull one with `localllm pull ORG/NAME`", err=True)


# =========================================================================== show
def find_stored(store: Store, ref: str) -> StoredModel:
    """A stored entry by ``name[:scheme]``, or by the Hub repo it was pulled from (``owner/name``)."""
    if looks_like_repo(ref):
        from localllm.loaders.hub import parse_ref

        entries = entries_from_repo(store, parse_ref(ref)[0])
        if entries:
            from localllm.loaders.store import _default_entry

            return _default_entry(entries)
    return store.resolve(ref)


def describe(config: Any, *, name: str | None, path: Path, scheme: Any, dtype: str | None, quantized: int,
             weight_bytes: int, source: dict[str, Any], chat_template: bool, created: str | None) -> dict[str, Any]:
    """The ``show --json`` object (the text view prints the same fields)."""
    return {
        "name": name,
        "path": str(path),
        "architecture": config.arch,
        "parameters": config.num_parameters(),
        "context_length": config.max_seq_len,
        "embedding_length": config.dim,
        "layers": config.n_layers,
        "heads": config.n_heads,
        "kv_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "scheme": scheme.name if scheme is not None else dtype,
        "quant": scheme.to_dict() if scheme is not None else None,
        "quantized_modules": quantized,
        "weight_bytes": weight_bytes,
        "kv_cache_bytes_per_token": config.kv_cache_bytes(1, _CACHE_VALUE_BYTES),
        "kv_cache_bytes_context": config.kv_cache_bytes(config.max_seq_len, _CACHE_VALUE_BYTES),
        "source": source,
        "chat_template": chat_template,
        "created": created,
    }


def describe_stored(entry: StoredModel) -> dict[str, Any]:
    from localllm.quant.formats import QuantScheme
    from localllm.runtime.config import ModelConfig
    from localllm.runtime.tokenizer import Tokenizer

    m = entry.manifest
    quant = m.get("quant") or {}
    scheme = QuantScheme.from_dict(quant["scheme"]) if quant.get("scheme") else None
    return describe(ModelConfig.from_dict(m["config"]), name=entry.ref, path=entry.path, scheme=scheme,
                    dtype=m.get("dtype"), quantized=len(quant.get("modules", [])),
                    weight_bytes=int(m["files"].get("model.safetensors", {}).get("size", entry.size_bytes)),
                    source=m.get("source") or {}, chat_template=Tokenizer.from_folder(entry.path).chat_template is not None,
                    created=entry.modified.isoformat())


def describe_path(path: Path) -> dict[str, Any]:
    """A quick look at a .gguf file or HF folder, without storing it (a store entry's folder: as stored)."""
    from localllm.loaders.artifact import ArtifactCheckpoint
    from localllm.loaders.gguf import GGUFCheckpoint
    from localllm.loaders.load import load_tokenizer, model_tensors, open_checkpoint

    ckpt = open_checkpoint(str(path))
    if isinstance(ckpt, ArtifactCheckpoint):
        return describe_stored(ckpt.stored)
    scheme = ckpt.default_scheme()
    quantized = len(model_tensors(ckpt, scheme)[2]) if scheme is not None else 0
    if isinstance(ckpt, GGUFCheckpoint):
        weight_bytes, dtype = path.stat().st_size, None
    else:
        weight_bytes = sum(f.stat().st_size for f in ckpt.files)
        dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
            str(ckpt.hf_config.get("torch_dtype") or ckpt.hf_config.get("dtype")), "float")
    return describe(ckpt.config, name=None, path=path.resolve(), scheme=scheme, dtype=dtype, quantized=quantized,
                    weight_bytes=weight_bytes, source={"path": str(path.resolve())},
                    chat_template=load_tokenizer(ckpt).chat_template is not None, created=None)


def human_count(n: int) -> str:
    """A parameter count as model cards write it: 135M, 1.2B, 7.2B, 70B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value >= 10 else f"{value:.1f}{unit}"
    return str(n)


def show_text(facts: dict[str, Any]) -> str:
    """The text view of :func:`describe`'s object, in sections like ``ollama show``."""
    from localllm.quant.formats import QuantScheme

    q = facts["quant"]
    scheme = QuantScheme(**q).label() if q else f"{facts['scheme']} (not quantized)"
    heads = f"{facts['heads']} ({facts['kv_heads']} kv heads, head dim {facts['head_dim']})"
    kv = (f"{human_size(facts['kv_cache_bytes_per_token'])} per token, {human_size(facts['kv_cache_bytes_context'])} "
          f"for {facts['context_length']} tokens (16-bit cache)")
    src = facts["source"]
    source_rows = ([("repo", src["repo"]), ("revision", src.get("revision") or "main"), ("commit", src.get("commit") or "?")]
                   if src.get("repo") else [("path", src.get("path", "?"))])
    source_rows += [(k, src[k]) for k in ("file", "sha256") if src.get(k)]
    sections = {
        "Model": [("name", facts["name"] or "(not stored)"), ("architecture", facts["architecture"]),
                  ("parameters", human_count(facts["parameters"])), ("context length", facts["context_length"]),
                  ("embedding length", facts["embedding_length"]), ("layers", facts["layers"]),
                  ("attention heads", heads), ("vocabulary", facts["vocab_size"]),
                  ("chat template", "yes" if facts["chat_template"] else "no")],
        "Weights": [("scheme", scheme), ("quantized modules", facts["quantized_modules"]),
                    ("weight bytes", f"{human_size(facts['weight_bytes'])} ({facts['weight_bytes']:,} bytes)"),
                    ("kv cache", kv)],
        "Source": source_rows + ([("created", _created_text(facts["created"])), ("location", facts["path"])]
                                 if facts["created"] else []),
    }
    lines = []
    for title, rows in sections.items():
        lines += [f"  {title}"] + [f"    {k:<20}{v}" for k, v in rows] + [""]
    return "\n".join(lines).rstrip("\n")


def _created_text(iso: str) -> str:
    when = datetime.fromisoformat(iso)
    return f"{when.astimezone().strftime('%Y-%m-%d %H:%M')} ({human_ago(when)})"


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="A JSON object instead of the text view.")
@click.option("--verify", is_flag=True, help="Re-hash the stored files against the manifest.")
def show(model: str, as_json: bool, verify: bool) -> None:
    """Show a model's details: a stored NAME[:SCHEME], or a .gguf file / model folder by path."""
    path = Path(model).expanduser()
    if path.exists():
        if verify:
            raise LocalLLMError(f"--verify checks stored models, and {model} is a path", "leave --verify out")
        facts = describe_path(path)
    else:
        store = Store()
        entry = find_stored(store, model)
        facts = describe_stored(entry)
        if verify:
            store.verify(entry)  # a LocalLLMError names the first bad file
            facts["verified"] = True
            click.echo(f"verified: {len(entry.manifest['files'])} files match their sha256", err=True)
    click.echo(json.dumps(facts, indent=2, default=str) if as_json else show_text(facts))


# =========================================================================== rm
@click.command()
@click.argument("models", nargs=-1, required=True)
def rm(models: tuple[str, ...]) -> None:
    """Remove stored models (NAME[:SCHEME]...).

    A bare name removes its default scheme (the one `run NAME` loads).  Every name is checked first, so a typo removes nothing.  Never asks for confirmation.
    """
    store = Store()
    entries: dict[Path, StoredModel] = {}
    for ref in models:
        entry = find_stored(store, ref)
        entries.setdefault(entry.path, entry)
    for entry in entries.values():
        store.remove(entry.ref)
        click.echo(f"deleted '{entry.ref}' ({entry.size} freed)", err=True)
    if len(entries) > 1:
        click.echo(f"{human_size(sum(e.size_bytes for e in entries.values()))} freed in all", err=True)
