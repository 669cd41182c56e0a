"""Builds of the compiled decode step that recover (runtime.compiled_step): a failed build keeps its
full output in the build log and a mark of when, how often and with which versions it failed; runs
start it again after a back-off (at once after localllm, torch or the compiler changed); `localllm
compile` always retries, every batch package a default run uses; `run --verbose` and `show` say which
steps run eagerly and why; two builds at once in one home wait for each other. The builds here are
stand-ins (no compiler runs): tests/test_compiled_step.py builds real packages."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from localllm.cli import main
from localllm.commands import compile_step
from localllm.runtime import build_failures, compiled_step
from localllm.runtime.speculate import MAX_DRAFT

needs_compiler = pytest.mark.skipif(compiled_step.compile_unavailable_reason(torch.device("cpu")) is not None,
                                    reason="no C++ compiler: runs never start a build")
COMPILE_ERROR = "C++ compile error\n\nCommand:\ng++ step.cpp -o step.so\n\nOutput:\nstep.cpp:7:3: error: 'vec' was not declared"


@pytest.fixture
def folder(tiny_folder, tmp_path, monkeypatch):
    """The tiny Llama's folder, in a home of the test's own."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    return str(tiny_folder("llama")[1])


def marks() -> dict[str, dict]:
    """Each failure mark in the home, as JSON, by its batch range ("1-1", "2-1024")."""
    return {"-".join(map(str, build_failures.package_batch(m))): json.loads(m.read_text())
            for m in compiled_step.aot_dir().glob("*.failed")}


def fail_build(monkeypatch, folder: str):
    """`localllm compile` whose compiler fails: marks beside every package a default run wants. The
    result of the command."""
    def broken(*a, **k):
        raise RuntimeError(COMPILE_ERROR)

    with monkeypatch.context() as m:
        m.setattr(compiled_step, "build_package", broken)
        result = CliRunner().invoke(main, ["compile", folder, "--quant", "fp32"])
    assert result.exit_code == 1, result.output
    return result


def set_marks(**fields: object) -> None:
    for mark in compiled_step.aot_dir().glob("*.failed"):
        data = json.loads(mark.read_text())
        data.update(fields)
        mark.write_text(json.dumps(data))


def fake_build(monkeypatch) -> list[str]:
    """Packages "built" as files (and "loaded" as nothing), recorded by name: the build's bookkeeping
    without a compiler."""
    built: list[str] = []

    def build_package(model, pool, kernel, path: Path, batch) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"package")
        built.append(path.name)

    monkeypatch.setattr(compiled_step, "build_package", build_package)
    monkeypatch.setattr(compiled_step, "load_runner", lambda path: object())
    return built


@needs_compiler
def test_a_failed_build_keeps_its_full_output_and_counts_its_failures(folder, monkeypatch):
    fail_build(monkeypatch, folder)
    log = (compiled_step.home() / "logs" / "compile.log").read_text()
    assert "step.cpp:7:3: error: 'vec' was not declared" in log  # the compiler's output, not only its first line
    got = marks()
    assert set(got) == {"1-1", f"2-{compiled_step.MAX_BATCH}"}  # the verify steps' package too
    for mark in got.values():
        assert mark["reason"] == "RuntimeError: C++ compile error" and mark["failures"] == 1
        assert mark["versions"] == build_failures.build_versions() and time.time() - mark["failed_at"] < 60
    result = fail_build(monkeypatch, folder)  # compile always tries again, whatever the back-off
    assert "RuntimeError: C++ compile error" in result.output
    assert "compile.log" in result.output and "Traceback" not in result.output
    assert [m["failures"] for m in marks().values()] == [2, 2]


@needs_compiler
def test_runs_retry_a_failed_build_after_its_back_off_or_at_once_after_an_upgrade(folder, monkeypatch):
    """The launcher stands in for the detached `localllm compile`; what is checked is whether a run
    starts it, and what `run --verbose` says about the steps that run eagerly."""
    fail_build(monkeypatch, folder)
    monkeypatch.setenv("LOCALLLM_BACKGROUND_BUILD", "1")
    launched: list[int] = []
    monkeypatch.setattr(compile_step, "launch_build", lambda spec, batch: launched.append(batch))
    run = ["run", folder, "hello", "--raw", "-n", "2", "--quant", "fp32", "--temperature", "0", "--verbose"]

    fresh = CliRunner().invoke(main, run)
    assert fresh.exit_code == 0, fresh.output
    assert launched == [] and "decode step: eager" in fresh.output
    assert "decode steps of 1 row run eagerly: their build failed once (RuntimeError: C++ compile error); " \
           "tried again after" in fresh.output
    assert f"decode steps of 2-{compiled_step.MAX_BATCH} rows run eagerly" in fresh.output

    set_marks(failed_at=time.time() - build_failures.RETRY_AFTER_S[0] - 5)  # ten minutes on: due
    due = CliRunner().invoke(main, run)
    assert due.exit_code == 0 and launched == [1 + MAX_DRAFT], due.output
    assert "a new build is due" in due.output and "in the background" in due.output

    launched.clear()
    set_marks(failures=2)  # the second failure in a row waits an hour
    assert CliRunner().invoke(main, run).exit_code == 0 and launched == []

    set_marks(failed_at=time.time(), failures=4, versions={**build_failures.build_versions(), "torch": "2.0.0"})
    upgraded = CliRunner().invoke(main, run)  # failed a moment ago, but with another torch
    assert upgraded.exit_code == 0 and launched == [1 + MAX_DRAFT], upgraded.output

    launched.clear()
    for mark in compiled_step.aot_dir().glob("*.failed"):  # a mark an older localllm wrote: one line
        mark.write_text("decode steps run eagerly: CppCompileError: C++ compile error\n")
    assert CliRunner().invoke(main, run).exit_code == 0 and launched == [1 + MAX_DRAFT]


@needs_compiler
def test_compile_retries_and_clears_the_marks_of_every_batch_package(folder, monkeypatch):
    """After a failure whose retry is a day away, `localllm compile` builds at once every package a
    default run uses (its lone steps and its verify steps), clears their marks, and a run then finds
    nothing to say or build."""
    fail_build(monkeypatch, folder)
    set_marks(failures=9)
    built = fake_build(monkeypatch)
    result = CliRunner().invoke(main, ["compile", folder, "--quant", "fp32"])
    assert result.exit_code == 0 and "built the compiled decode step" in result.output, result.output
    assert sorted(built) == sorted(p.name for p in compiled_step.aot_dir().glob("*.pt2")) and len(built) == 2
    assert marks() == {}
    shown = CliRunner().invoke(main, ["show", folder])
    assert shown.exit_code == 0 and "Compiled decode step" not in shown.output


@needs_compiler
def test_show_says_which_steps_run_eagerly_and_why(folder, monkeypatch):
    fail_build(monkeypatch, folder)
    text = CliRunner().invoke(main, ["show", folder])
    assert text.exit_code == 0, text.output
    assert "Compiled decode step" in text.output
    assert "decode steps of 1 row run eagerly: their build failed once (RuntimeError: C++ compile error)" in text.output
    facts = json.loads(CliRunner().invoke(main, ["show", folder, "--json"]).output)
    steps = {tuple(s["rows"]): s for s in facts["eager_steps"]}
    assert set(steps) == {(1, 1), (2, compiled_step.MAX_BATCH)}
    assert steps[(1, 1)]["reason"] == "RuntimeError: C++ compile error" and steps[(1, 1)]["retry_due"] is False


BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from localllm.runtime import compiled_step

    def say(what):
        with open(sys.argv[3], "a") as f:
            f.write(f"{what} {time.time()}\\n")

    def build_package(model, pool, kernel, path, batch):  # a build that lasts until the other has started
        say("start")
        deadline = time.time() + 120
        while Path(sys.argv[3]).read_text().count("ready") < 2 and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(4)  # the other process's load, and its way to the build
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(b"package")
        tmp.rename(path)
        say("end")

    compiled_step.build_package = build_package
    compiled_step.load_runner = lambda path: object()
    say("ready")
    if sys.argv[1] == "compile":  # `localllm compile`
        from localllm.cli import main
        main(["compile", sys.argv[2], "--quant", "fp32", "--batch", "1"])
    else:  # `run --compile`: an engine that builds its step now
        from localllm.loaders.load import load_model
        from localllm.runtime.batch import BatchEngine
        engine = BatchEngine(load_model(sys.argv[2], quant="fp32").model, kv_budget_bytes=1 << 20,
                             max_running=1, compile=True, speculate=False)
        assert engine.compiled and engine.compile_note is None, engine.compile_note
""")


@needs_compiler
def test_two_builds_at_once_in_one_home_wait_for_each_other(folder, tmp_path):
    """`localllm compile` and a `run --compile` of the same model start together in one home: one
    builds while the other waits (never two compilers over one inductor cache), then finds the
    package built and builds nothing; both succeed."""
    script, log = tmp_path / "builder.py", tmp_path / "builds.log"
    script.write_text(BUILDER)
    procs = [subprocess.Popen([sys.executable, str(script), kind, folder, str(log)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for kind in ("compile", "engine")]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    events = [line.split()[0] for line in log.read_text().splitlines() if not line.startswith("ready")]
    assert events == ["start", "end"], events  # built once, by one of them, while the other waited
    assert list(compiled_step.aot_dir().glob("*.pt2")) != [] and marks() == {}
