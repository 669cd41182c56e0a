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


def run_cli(*args: str, stdin: str | None = None, timeout: float = 240, home: Path | None = None
            ) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALLLM_DEBUG": ""}
    if home is not None:
        env["LOCALLLM_HOME"] = str(home)
    return subprocess.run([*LOCALLLM, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=env, stdin=None if stdin is not None else subprocess.DEVNULL)


def run_cli_bytes(*args: str | bytes, stdin: bytes | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """Arguments and stdin as raw bytes (a terminal or file in another encoding); output decoded as UTF-8."""
    proc = subprocess.run([*LOCALLLM, *args], input=stdin, capture_output=True, timeout=timeout,
                          env={**os.environ, "LOCALLLM_DEBUG": ""},
                          stdin=None if stdin is not None else subprocess.DEVNULL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str, code: int = 1) -> None:
    assert proc.returncode == code, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: ") and "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.mark.slow
def test_run_streams_only_text_to_stdout_and_stats_to_stderr(smollm2_path, france_fp32):
    # fp32: the greedy answer is reached by wide margins on every CPU (france_fp32 checks them); the
    # default int4 path opens on a 0.08 gap that bf16 rounding decides differently on AMX machines.
    proc = run_cli("run", "smollm2", "What is the capital of France?", "--temperature", "0", "-n", "30",
                   "--verbose", "--quant", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    for stat in ("load duration", "prompt eval count", "prompt eval rate", "eval count", "eval rate"):
        assert stat in proc.stderr and stat not in proc.stdout


@pytest.mark.slow
def test_prompt_from_stdin_and_raw_mode(smollm2_path):
    from tests.answers import WIDE_MARGIN, fp32_greedy

    # " Paris" comes first, by a margin (2.5 in fp32) that no bf16 rounding of the int4 path reverses.
    assert fp32_greedy(str(smollm2_path), "The capital of France is", 1, chat=False).margin_until("Paris") >= 20 * WIDE_MARGIN
    proc = run_cli("run", str(smollm2_path), "--temperature", "0", "-n", "8", "--raw", stdin="The capital of France is")
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
    proc = subprocess.Popen([*LOCALLLM, "run", "smollm2", "--temperature", "0", "-n", "40"], stdin=slave,
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


def assert_one_warning(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 0, and exactly one line on stderr, a warning (no traceback)."""
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# ------------------------------------------------------------------------------ bad input: paths
@pytest.mark.parametrize("path", ["./no/such/model", "/no/such/model", "../no-such-model", "~/no-such-localllm-model",
                                  "no-such-model.gguf"])
def test_missing_model_path(path: str):
    """Written as a path (or a .gguf name): said not to exist, not taken for a Hub repo or a model name."""
    assert_one_line_error(run_cli("run", path, "hi"), f"no such file or folder: {path}")


@pytest.mark.parametrize("command", ["show", "bench", "pull"])
def test_missing_path_in_other_commands(command: str, tmp_path: Path):
    proc = run_cli(command, "./no-such-folder", home=tmp_path)
    assert_one_line_error(proc, "no such file or folder: ./no-such-folder")


# ------------------------------------------------------------------------------ bad input: --ctx
def chat_template_tokens(folder: Path) -> int:
    from localllm.runtime.chat import encode_chat
    from localllm.runtime.tokenizer import Tokenizer

    return len(encode_chat(Tokenizer.from_folder(folder), [{"role": "user", "content": ""}]))


@pytest.mark.parametrize("ctx", ["0", "-3"])
def test_ctx_not_positive(tiny_folder, ctx: str):
    _, folder = tiny_folder("llama")
    assert_one_line_error(run_cli("run", str(folder), "h", "--ctx", ctx), f"--ctx {ctx} is not positive", "2 or more")


def test_ctx_minimum_is_one_prompt_token_and_one_generated(tiny_folder):
    """--raw: the start-of-text token, one prompt token and one generated token is the real minimum
    (3 for the tiny model, which starts with BOS); it runs, 2 does not."""
    _, folder = tiny_folder("llama")
    assert_one_line_error(run_cli("run", str(folder), "h", "--raw", "--ctx", "2"), "--ctx 2 is too small",
                          "start-of-text token", "--ctx 3 or more")
    proc = run_cli("run", str(folder), "h", "--raw", "--ctx", "3", "-n", "1", "--temperature", "0")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_ctx_minimum_of_a_chat_counts_the_template(tiny_folder):
    """A chat needs the template's tokens too: the error names the exact number, and that number runs."""
    _, folder = tiny_folder("llama")
    need = chat_template_tokens(folder) + 2
    assert_one_line_error(run_cli("run", str(folder), "h", "--ctx", "1"), f"chat template takes {need - 2} tokens",
                          f"--ctx {need} or more", "--raw")
    proc = run_cli("run", str(folder), "h", "--ctx", str(need), "--temperature", "0")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_ctx_beyond_the_trained_length_is_warned_of(tiny_folder):
    _, folder = tiny_folder("llama")  # max_position_embeddings 256
    proc = run_cli("run", str(folder), "h", "--raw", "--ctx", "300", "-n", "2", "--temperature", "0")
    assert_one_warning(proc, "--ctx 300", "256 tokens")


# ------------------------------------------------------------------------------ bad input: flags
@pytest.mark.parametrize("args, needles", [
    (["run", "smollm2", "hi", "-t", "4"], ["No such option '-t'", "--temperature", "--threads"]),
    (["run", "smollm2", "hi", "-s", "be brief"], ["No such option '-s'", "--system", "--seed"]),
    (["pull", "org/name", "-f"], ["No such option '-f'", "--force"]),
    (["run", "smollm2", "hi", "--quant", "int3"], ["Invalid value for '--quant'", "int4"]),
], ids=["-t", "-s", "-f", "bad-choice"])
def test_dropped_short_flags_and_usage_errors_are_one_line(args: list[str], needles: list[str]):
    """-t is threads in llama.cpp, -s the seed, -f a prompt file: localllm does not give them other meanings."""
    assert_one_line_error(run_cli(*args), *needles, code=2)


def test_threads(tiny_folder):
    _, folder = tiny_folder("llama")
    proc = run_cli("run", str(folder), "h", "--raw", "-n", "2", "--temperature", "0", "--threads", "1", "--verbose")
    assert proc.returncode == 0 and "cpu, 1 thread," in proc.stderr, proc.stderr
    assert_one_line_error(run_cli("run", str(folder), "h", "--threads", "0"), "--threads 0 is not positive")


# ------------------------------------------------------------------------------ bad input: bytes that are not UTF-8
NOT_UTF8 = "warning: the input is not valid UTF-8; undecodable bytes were replaced with U+FFFD"


def test_prompt_argument_that_is_not_utf8(tiny_folder):
    _, folder = tiny_folder("llama")
    proc = run_cli_bytes("run", str(folder), b"caf\xe9 \xff\xfe", "--raw", "-n", "2", "--temperature", "0")
    assert_one_warning(proc)
    assert proc.stderr.strip() == NOT_UTF8


def test_piped_stdin_that_is_not_utf8(tiny_folder):
    _, folder = tiny_folder("llama")
    proc = run_cli_bytes("run", str(folder), "--raw", "-n", "2", "--temperature", "0", stdin=b"Latin-1: caf\xe9\n")
    assert_one_warning(proc)
    assert proc.stderr.strip() == NOT_UTF8
    clean = run_cli_bytes("run", str(folder), "--raw", "-n", "2", "--temperature", "0", stdin="café\n".encode())
    assert clean.returncode == 0 and clean.stderr == "", clean.stderr  # valid UTF-8: no warning


# ------------------------------------------------------------------------------ show takes what run takes
@pytest.mark.slow
def test_show_the_embedded_default_model(smollm2_path: Path, tmp_path: Path):
    proc = run_cli("show", "smollm2", "--json", home=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["name"] == "smollm2" and facts["architecture"] == "llama" and facts["context_length"] == 8192
    assert facts["source"] == {"path": str(smollm2_path.resolve())}
    text = run_cli("show", "smollm2", home=tmp_path)
    assert text.returncode == 0 and "smollm2" in text.stdout and "135M" in text.stdout
    assert_one_line_error(run_cli("show", "smollm2", "--verify", home=tmp_path), "--verify checks stored models")


def test_show_a_model_folder(tiny_folder, tmp_path: Path):
    _, folder = tiny_folder("llama")
    proc = run_cli("show", str(folder), "--json", home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["name"] is None and facts["layers"] == 2 and facts["source"] == {"path": str(folder.resolve())}


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


# ------------------------------------------------------------------------------ --format
def test_format_schema_file_holds_the_reply_and_bad_schemas_are_one_line(tiny_folder, tmp_path: Path):
    """A random-weight model's reply to --format SCHEMA_FILE parses and validates (the grammar decides
    every token it may pick), --logprobs lists its tokens on stderr; a schema it cannot enforce is
    refused before anything loads."""
    import jsonschema

    from tests.test_constrain import PERSON

    _, folder = tiny_folder("llama")
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    proc = run_cli("run", str(folder), "Who?", "--raw", "--format", str(schema), "--temperature", "1", "--top-k", "0",
                   "--top-p", "1", "--seed", "4", "-n", "400", "--logprobs", "2")
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), PERSON)
    # --logprobs: a line per generated token (one byte each here) on stderr, with two alternatives
    header, *lines = proc.stderr.splitlines()
    assert header.startswith("token probabilities") and len(lines) == len(proc.stdout.strip().encode())
    assert lines[0].startswith("  '{'") and all(line.count("%") == 3 for line in lines)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}))
    assert_one_line_error(run_cli("run", str(folder), "hi", "--format", str(bad)),
                          "--format.properties.ids uses 'uniqueItems', which localllm cannot enforce")
