"""The CLI through real subprocesses: stdout carries only generated text; errors are one line."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

LOCALLLM = [sys.executable, "-m", "localllm"]


def run_cli(*args: str, stdin: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALLLM_DEBUG": ""}
    return subprocess.run([*LOCALLLM, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=env, stdin=None if stdin is not None else subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: ") and "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.mark.slow
def test_run_streams_only_text_to_stdout_and_stats_to_stderr(smollm2_path):
    proc = run_cli("run", "smollm2", "What is the capital of France?", "-t", "0", "-n", "30", "--verbose")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    for stat in ("load duration", "prompt eval count", "prompt eval rate", "eval count", "eval rate"):
        assert stat in proc.stderr and stat not in proc.stdout


@pytest.mark.slow
def test_prompt_from_stdin_and_raw_mode(smollm2_path):
    proc = run_cli("run", str(smollm2_path), "-t", "0", "-n", "8", "--raw", stdin="The capital of France is")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and proc.stderr == ""


@pytest.mark.slow
def test_prompt_longer_than_ctx(smollm2_path):
    proc = run_cli("run", "smollm2", "word " * 100, "--ctx", "32")
    assert_one_line_error(proc, "context holds 32", "--ctx")


@pytest.mark.slow
def test_interactive_chat_keeps_history_and_ends_on_ctrl_d(smollm2_path):
    """A real terminal (pty) on stdin: two turns, the second relying on the first, then Ctrl-D."""
    master, slave = os.openpty()
    proc = subprocess.Popen([*LOCALLLM, "run", "smollm2", "-t", "0", "-n", "40"], stdin=slave,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(slave)
    err_fd, seen = proc.stderr.fileno(), b""  # the '>>> ' prompts go to stderr: stdout is not a terminal
    try:
        def read_until_prompt(count: int) -> None:
            """Wait until the chat has shown its '>>> ' prompt ``count`` times (on the pty)."""
            nonlocal seen
            deadline = time.time() + 120
            while seen.count(b">>> ") < count and time.time() < deadline:
                if select.select([err_fd], [], [], 1)[0]:
                    seen += os.read(err_fd, 4096)
            assert seen.count(b">>> ") >= count, seen

        read_until_prompt(2)  # the banner line starts with '>>> ' too
        os.write(master, b"My name is Ada. Please remember it.\n")
        read_until_prompt(3)
        os.write(master, b"What is my name?\n")
        read_until_prompt(4)
        os.write(master, b"\x04")  # Ctrl-D
        out_b, err_b = proc.communicate(timeout=60)
        out, err = out_b.decode(), seen.decode() + err_b.decode()
    finally:
        os.close(master)
        proc.kill()
    assert proc.returncode == 0, err
    assert "Ada" in out.split("\n\n")[1]  # the second reply remembers the first turn
    assert "Traceback" not in err


@pytest.mark.parametrize("path", ["./no/such/model", "/no/such/model", "../no-such-model", "~/no-such-localllm-model",
                                  "no-such-model.gguf"])
def test_missing_model_path(path: str):
    """Written as a path (or a .gguf name): said not to exist, not taken for a Hub repo or a model name."""
    assert_one_line_error(run_cli("run", path, "hi"), f"no such file or folder: {path}")


@pytest.mark.parametrize("command", ["show", "bench", "pull"])
def test_missing_path_in_other_commands(command: str):
    assert_one_line_error(run_cli(command, "./no-such-folder"), "no such file or folder: ./no-such-folder")


def test_unsupported_architecture(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_error(run_cli("run", str(tmp_path), "hi"), "unsupported architecture", "llama")


def test_pickle_only_folder_is_refused(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    assert_one_line_error(run_cli("run", str(tmp_path), "hi"), "pickle", "safetensors")


def test_bad_sampling_option():
    assert_one_line_error(run_cli("run", "smollm2", "hi", "--top-p", "2"), "top-p")


def test_debug_shows_the_traceback():
    proc = subprocess.run([*LOCALLLM, "run", "./no/such/model", "hi"], capture_output=True, text=True,
                          env={**os.environ, "LOCALLLM_DEBUG": "1"}, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr
