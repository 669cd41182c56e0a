"""loaders.store: atomic writes, concurrent writers, list / resolve / remove / verify, stale folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import localllm
from localllm.loaders.store import FORMAT_VERSION, Store, StoredModel, human_size, name_from_repo, parse_model_ref
from localllm.errors import LocalLLMError

SOURCE = {"repo": "HuggingFaceTB/SmolLM2-135M-Instruct", "commit": "a" * 40}


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "home")


def _put(store: Store, name: str, scheme: str, payload: bytes = b"weights", **manifest: object) -> StoredModel:
    with store.write(name, scheme, {"source": SOURCE, **manifest}) as tmp:
        (tmp / "model.safetensors").write_bytes(payload)
        (tmp / "tokenizer.json").write_text("{}")
    stored = store.get(name, scheme)
    assert stored is not None
    return stored


def _leftovers(store: Store) -> list[Path]:
    return [p for p in store.models.iterdir() if p.name.startswith(".tmp-")] if store.models.exists() else []


# --------------------------------------------------------------------------- writing
def test_write_publishes_files_and_manifest(store: Store) -> None:
    stored = _put(store, "tiny", "int4", b"x" * 1000, config={"hidden_size": 64}, quant={"bits": 4, "group_size": 32})

    assert stored.path == store.root / "models" / "tiny" / "int4"
    assert (stored.path / "model.safetensors").read_bytes() == b"x" * 1000
    manifest = json.loads((stored.path / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert (manifest["name"], manifest["scheme"]) == ("tiny", "int4")
    assert manifest["localllm_version"] == localllm.__version__
    assert manifest["source"] == SOURCE and manifest["quant"]["group_size"] == 32
    assert manifest["files"]["model.safetensors"]["size"] == 1000
    assert len(manifest["files"]["model.safetensors"]["sha256"]) == 64
    assert set(manifest["files"]) == {"model.safetensors", "tokenizer.json"}
    created = datetime.fromisoformat(manifest["created"])
    assert created.tzinfo is not None and abs(datetime.now(timezone.utc) - created) < timedelta(minutes=1)
    assert stored.size_bytes == 1002 and stored.modified == created
    assert store.exists("tiny", "int4") and _leftovers(store) == []
    store.verify(stored)


def test_the_store_owns_its_manifest_keys(store: Store) -> None:
    with store.write("tiny", "int4", {"name": "other", "files": {}, "format_version": 99}) as tmp:
        (tmp / "model.safetensors").write_bytes(b"w")
    stored = store.resolve("tiny:int4")
    assert (stored.manifest["name"], stored.manifest["format_version"]) == ("tiny", FORMAT_VERSION)
    assert "model.safetensors" in stored.manifest["files"]


@pytest.mark.parametrize("error", [RuntimeError("quantization failed"), KeyboardInterrupt()])
def test_failed_write_leaves_nothing(store: Store, error: BaseException) -> None:
    with pytest.raises(type(error)):
        with store.write("tiny", "int4", {"source": SOURCE}) as tmp:
            assert tmp.parent == store.models and tmp.name.startswith(".tmp-")
            (tmp / "model.safetensors").write_bytes(b"half")
            raise error
    assert store.list() == [] and _leftovers(store) == []
    assert not (store.models / "tiny").exists()


def test_failed_rewrite_keeps_the_old_entry(store: Store) -> None:
    _put(store, "tiny", "int4", b"old")
    with pytest.raises(RuntimeError):
        with store.write("tiny", "int4", {}) as tmp:
            (tmp / "model.safetensors").write_bytes(b"new")
            raise RuntimeError("boom")
    assert (store.resolve("tiny:int4").path / "model.safetensors").read_bytes() == b"old"


def test_write_replaces_an_existing_entry(store: Store) -> None:
    _put(store, "tiny", "int4", b"old")
    stored = _put(store, "tiny", "int4", b"new and longer")
    assert [e.ref for e in store.list()] == ["tiny:int4"]
    assert (stored.path / "model.safetensors").read_bytes() == b"new and longer"
    store.verify(stored)
    assert _leftovers(store) == []


def test_concurrent_threads_end_with_one_good_copy(store: Store) -> None:
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            with store.write("tiny", "int4", {"writer": i}) as tmp:
                for part in range(3):
                    (tmp / f"part{part}.bin").write_bytes(bytes([i]) * 200_000)
                    time.sleep(0.01)
        except BaseException as e:  # noqa: BLE001 - reported to the main thread below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    (stored,) = store.list()
    store.verify(stored)
    winner = stored.manifest["writer"]
    assert all((stored.path / f"part{p}.bin").read_bytes() == bytes([winner]) * 200_000 for p in range(3))
    assert _leftovers(store) == []


_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from localllm.loaders.store import Store
    i = int(sys.argv[1])
    with Store(Path(sys.argv[2])).write("tiny", "int4", {"writer": i}) as tmp:
        for part in range(3):
            (tmp / f"part{part}.bin").write_bytes(bytes([i]) * 500_000)
            time.sleep(0.05)
    """
)


def test_concurrent_processes_end_with_one_good_copy(store: Store) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(i), str(store.root)], env=env, cwd=root)
        for i in (1, 2, 3)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    (stored,) = store.list()
    store.verify(stored)
    assert (stored.path / "part2.bin").read_bytes() == bytes([stored.manifest["writer"]]) * 500_000
    assert _leftovers(store) == []


def test_lock_allows_check_then_write(store: Store) -> None:
    with store.lock("tiny", "int4"):  # re-entrant: write() takes it again to publish
        if not store.exists("tiny", "int4"):
            _put(store, "tiny", "int4")
    assert store.exists("tiny", "int4")


# --------------------------------------------------------------------------- list / resolve
def test_list_is_sorted_and_skips_broken_entries(store: Store) -> None:
    _put(store, "zeta", "int8")
    _put(store, "alpha", "int4")
    _put(store, "alpha", "fp16")
    (store.models / "broken" / "int4").mkdir(parents=True)  # no manifest
    (store.models / "broken" / "int4" / "model.safetensors").write_bytes(b"x")
    (store.models / "garbled" / "int4").mkdir(parents=True)
    (store.models / "garbled" / "int4" / "manifest.json").write_text("{not json")
    assert [e.ref for e in store.list()] == ["alpha:fp16", "alpha:int4", "zeta:int8"]
    assert Store(store.root / "empty").list() == []


def test_resolve_exact_and_bare_names(store: Store) -> None:
    _put(store, "solo", "int8")
    assert store.resolve("solo").ref == "solo:int8"
    assert store.resolve("SOLO:INT8").ref == "solo:int8"  # names are case-insensitive

    _put(store, "multi", "fp16")
    _put(store, "multi", "int8")
    assert store.resolve("multi").ref == "multi:int8"  # no int4, no flag: the most recent
    _put(store, "multi", "int4")
    _put(store, "multi", "nf4")
    assert store.resolve("multi").ref == "multi:int4"  # int4 preferred
    assert store.resolve("multi:fp16").ref == "multi:fp16"
    _put(store, "multi", "fp16", default=True)
    assert store.resolve("multi").ref == "multi:fp16"  # the manifest's default flag wins


def test_resolve_unknown_names_suggest(store: Store) -> None:
    _put(store, "smollm2-135m-instruct", "int4")
    with pytest.raises(LocalLLMError) as err:
        store.resolve("smollm2-135m-instrct")
    assert str(err.value) == "model 'smollm2-135m-instrct' not found; did you mean 'smollm2-135m-instruct'?"
    with pytest.raises(LocalLLMError, match="run `localllm pull <repo>` or `localllm list`"):
        store.resolve("llama")
    with pytest.raises(LocalLLMError, match="stored: smollm2-135m-instruct:int4"):
        store.resolve("smollm2-135m-instruct:int8")
    with pytest.raises(LocalLLMError, match="run `localllm pull org/model` first"):
        store.resolve("org/model")


@pytest.mark.parametrize("bad", ["", "bad name", "-dash", "a:b:c", "name:", "x" * 200, "na/me:int4", "émoji"])
def test_bad_names_are_refused(store: Store, bad: str) -> None:
    with pytest.raises(LocalLLMError):
        store.resolve(bad)


def test_write_refuses_bad_names(store: Store) -> None:
    with pytest.raises(LocalLLMError, match="not a valid model name"):
        with store.write("../escape", "int4", {}):
            pass
    with pytest.raises(LocalLLMError, match="not a valid scheme"):
        with store.write("ok", "int 4", {}):
            pass
    assert _leftovers(store) == []


def test_names() -> None:
    assert name_from_repo("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert name_from_repo("meta-llama/Llama-3.2-1B") == "llama-3.2-1b"
    assert name_from_repo("gpt2") == "gpt2"
    assert name_from_repo("org/Weird Name+v2") == "weird-name-v2"
    assert parse_model_ref("tiny:int4") == ("tiny", "int4")
    assert parse_model_ref("tiny") == ("tiny", None)
    assert human_size(98_000_000) == "98 MB" and human_size(4_700_000_000) == "4.7 GB" and human_size(512) == "512 B"


# --------------------------------------------------------------------------- remove / verify
def test_remove(store: Store) -> None:
    _put(store, "tiny", "int4")
    _put(store, "tiny", "fp16")
    removed = store.remove("tiny:int4")
    assert removed.ref == "tiny:int4" and not removed.path.exists()
    assert [e.ref for e in store.list()] == ["tiny:fp16"]
    store.remove("tiny")
    assert store.list() == [] and not (store.models / "tiny").exists() and _leftovers(store) == []
    with pytest.raises(LocalLLMError, match="not found"):
        store.remove("tiny")


def test_verify_detects_a_flipped_byte(store: Store) -> None:
    stored = _put(store, "tiny", "int4", bytes(range(256)) * 100)
    weights = stored.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1234] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(LocalLLMError) as err:
        store.verify(stored)
    assert str(err.value) == (
        "model 'tiny:int4' is corrupted: model.safetensors does not match its sha256; "
        "run `localllm rm tiny:int4 && localllm pull HuggingFaceTB/SmolLM2-135M-Instruct`"
    )


def test_verify_detects_truncated_and_missing_files(store: Store) -> None:
    stored = _put(store, "tiny", "int4", b"x" * 5000)
    with open(stored.path / "model.safetensors", "r+b") as f:
        f.truncate(4000)
    with pytest.raises(LocalLLMError, match="model.safetensors has 4000 bytes instead of 5000"):
        store.verify(stored)
    (stored.path / "model.safetensors").write_bytes(b"x" * 5000)
    store.verify(stored)
    (stored.path / "tokenizer.json").unlink()
    with pytest.raises(LocalLLMError, match="tokenizer.json is missing"):
        store.verify(stored)


# --------------------------------------------------------------------------- stale folders
def test_stale_tmp_folder_is_ignored_then_cleaned(store: Store) -> None:
    _put(store, "tiny", "int4")
    stale = store.models / ".tmp-deadbeefdeadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written by a killed process")
    assert [e.ref for e in store.list()] == ["tiny:int4"]

    _put(store, "other", "int4")  # the next write cleans up

    assert not stale.exists() and _leftovers(store) == []
    assert [e.ref for e in store.list()] == ["other:int4", "tiny:int4"]


def test_live_writer_tmp_folder_is_not_cleaned(store: Store) -> None:
    with store.write("tiny", "int4", {}) as tmp:
        (tmp / "model.safetensors").write_bytes(b"in progress")
        cleaner = threading.Thread(target=store.clean_stale)
        cleaner.start()
        cleaner.join()
        assert tmp.exists()
        _put(store, "other", "int4")  # a nested write in the same thread must not eat it either
        assert tmp.exists()
    assert store.resolve("tiny:int4") is not None and _leftovers(store) == []


def test_complete_entry_stranded_in_a_stale_folder_is_restored(store: Store) -> None:
    """A writer killed between 'old entry aside' and 'new entry in' leaves the entry in a tmp folder."""
    stored = _put(store, "tiny", "int4", b"good")
    os.rename(stored.path, store.models / ".tmp-0123456789abcdef")
    assert store.list() == []
    assert store.clean_stale() == 1
    restored = store.resolve("tiny:int4")
    assert (restored.path / "model.safetensors").read_bytes() == b"good"
    store.verify(restored)


# --------------------------------------------------------------------------- names on the command line
@pytest.mark.parametrize("args, says", [
    (["rm", ".."], "'..' is a path, and rm removes stored models by name"),
    (["rm", "../x."], "'../x.' is a path"),
    (["rm", "a" * 300], "is too long for a model name or path (300 characters)"),
    (["show", "a" * 300], "is too long for a model name or path (300 characters)"),
    (["show", "../" + "a" * 300], "is too long for a model name or path (303 characters)"),
    (["pull", "a" * 300], "is too long for a model name or path (300 characters)"),
    (["run", "a" * 300, "hi"], "is too long for a model name or path (300 characters)"),
    (["show", "~no-such-user-here/x"], "no such file or folder: ~no-such-user-here/x"),
])
def test_a_malformed_name_on_the_command_line_is_one_error_line(tmp_path: Path, args: list[str], says: str) -> None:
    from click.testing import CliRunner

    from localllm.cli import main

    result = CliRunner().invoke(main, args, env={"LOCALLLM_DEBUG": "", "LOCALLLM_HOME": str(tmp_path)})
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and says in lines[0], result.stderr
