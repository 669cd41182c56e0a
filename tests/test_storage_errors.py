"""A disk that refuses a write (full, a size limit, a path through a file) is one line naming the file
and the fix, in the CLI and in the server (507 in the API's shape), and leaves nothing half-written."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import localllm.loaders.artifact as artifact
from localllm.loaders.store import Store
from localllm.server.config import ServerConfig
from tests.server_fixtures import running_server

ROOT = Path(__file__).parents[1]


def cli(home: Path, *args: str, file_limit: int | None = None) -> subprocess.CompletedProcess:
    """``localllm ARGS`` in a subprocess with its store in ``home``; ``file_limit``: the most bytes it may
    write to any one file (RLIMIT_FSIZE: a write past it fails with EFBIG, as a full disk fails)."""

    def limit() -> None:
        if file_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    env = {**os.environ, "LOCALLLM_HOME": str(home), "LOCALLLM_DEBUG": ""}
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=300, cwd=ROOT, preexec_fn=limit)


def one_error_line(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 1, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    return errors[0]


def test_a_pull_the_disk_refuses_is_one_line_and_stores_nothing(tiny_folder, tmp_path: Path) -> None:
    _, folder = tiny_folder("llama")
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    home = tmp_path / "home"
    run = cli(home, "pull", str(folder), "--name", "tiny", "--quant", "int8", file_limit=weights // 8)
    line = one_error_line(run)
    assert line == (f"Error: cannot pull {folder}: a file grew past the size this process may write; free some "
                    "space, or point LOCALLLM_HOME (the store) and HF_HOME (downloads) at a folder on a disk with room")
    assert Store(home).list() == []  # nothing half-written is listed
    assert cli(home, "pull", str(folder), "--name", "tiny", "--quant", "int8").returncode == 0  # room again: it works


def test_export_into_a_file_fails_before_loading(tiny_folder, tmp_path: Path) -> None:
    _, folder = tiny_folder("llama")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    line = one_error_line(cli(tmp_path / "home", "export", str(folder), str(blocker / "out")))
    assert line == (f"Error: cannot export to {blocker / 'out'}: a part of the path is a file, not a folder "
                    f"({blocker / 'out'}); choose a folder you can write, on a disk with room")


def test_a_full_disk_during_a_server_pull_is_a_507(tiny_folder, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from the store's writer, half-way through a pull: a 507 in Ollama's shape (stream or not),
    no entry left, and the server goes on answering."""
    _, folder = tiny_folder("llama")
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALLLM_HOME", str(home))
    write = artifact.write_safetensors

    def full_disk(path: Path, *args, **kwargs):  # type: ignore[no-untyped-def]
        Path(path).write_bytes(b"\0" * 1024)  # some of it made it to disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(artifact, "write_safetensors", full_disk)
    with running_server(ServerConfig(allow_local_paths=True, keep_alive_s=0)) as server:
        r = httpx.post(f"{server.url}/api/pull", json={"model": str(folder), "stream": False}, timeout=120)
        assert r.status_code == 507, r.text
        assert r.json()["error"].startswith(f"cannot pull {folder}: no space is left on the disk (")
        streamed = httpx.post(f"{server.url}/api/pull", json={"model": str(folder)}, timeout=120)
        assert streamed.status_code == 200 and "no space is left on the disk" in streamed.text.splitlines()[-1]
        monkeypatch.setattr(artifact, "write_safetensors", write)
        assert Store(home).list() == []
        assert httpx.get(f"{server.url}/api/tags", timeout=30).status_code == 200
