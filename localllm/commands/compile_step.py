"""``localllm compile MODEL``: build a model's compiled decode step now, and the background build that
``run`` and ``pull`` start when a model has none yet.

A plain ``localllm run`` never waits for a compiler: it uses the step built for its model (one
AOTInductor package serves every context length, see :mod:`runtime.aot`) when there is one, and
otherwise runs eagerly and, once its reply is done, starts this command in a detached process so
that the next run finds the step. Set-up builds the embedded model's step in the foreground; ``pull``
starts the build for the model it stored. Builds take a lock, so at most one runs at a time (on a
small CPU two would slow each other and the user's run); one that finds the lock taken leaves.

``LOCALLLM_BACKGROUND_BUILD=0`` turns the background builds off (the test suite does).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass

import click
import torch

from localllm.commands.common import note, quant_head_option, threads_option
from localllm.paths import DEFAULT_MODEL, home
from localllm.quant.formats import ALL_SCHEMES
from localllm.quant.kernels import BY_NAME as KERNELS_BY_NAME

ENV_SWITCH = "LOCALLLM_BACKGROUND_BUILD"


@dataclass(frozen=True)
class LoadArgs:
    """How ``run`` loaded a model: what the build must load the same way, since the package is keyed
    by the model's modules, kernels and tensor shapes, and by the thread count."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    quant: str | None = None
    group_size: int | None = None
    quant_head: str | None = None
    kernel: str | None = None

    def argv(self) -> list[str]:
        out = [self.model, "--device", self.device, "--dtype", self.dtype]
        for flag, value in (("--quant", self.quant), ("--group-size", self.group_size),
                            ("--quant-head", self.quant_head), ("--kernel", self.kernel)):
            if value is not None:
                out += [flag, str(value)]
        return out


def _lock_path():  # type: ignore[no-untyped-def]
    folder = home() / "inductor" / "aot"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / ".build.lock"


def background_builds_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") not in ("0", "")


def start_background_build(args: LoadArgs, ctx: int | None = None) -> bool:
    """Start ``localllm compile`` for ``args`` in a detached process (its output in
    ``<home>/logs/compile.log``), with this process's thread count. False when background builds are
    off, no compiler is here, or a build is already running."""
    from filelock import FileLock, Timeout

    from localllm.runtime.compile import compile_unavailable_reason

    if not background_builds_enabled() or compile_unavailable_reason(torch.device("cpu")):
        return False
    try:  # a build in progress holds the lock: do not queue a second behind it
        with FileLock(_lock_path(), timeout=0):
            pass
    except Timeout:
        return False
    logs = home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "localllm", "compile", *args.argv(), *(["--ctx", str(ctx)] if ctx else []),
            "--threads", str(torch.get_num_threads()), "--if-idle"]
    with open(logs / "compile.log", "ab") as log:
        log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv[1:])}\n".encode())
        log.flush()
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)  # outlives this process; Ctrl-C here does not reach it
    return True


@click.command("compile")
@click.argument("model", default=DEFAULT_MODEL, required=False)
@click.option("--ctx", type=int, help="Context length to build for (only matters for sliding-window models, whose "
                                      "step is built per length). Default: the model's, at most 4096.")
@click.option("--device", default="auto", show_default=True, help="As for run: the step is built for how run loads it.")
@click.option("--dtype", default="auto", show_default=True, help="As for run.")
@threads_option
@click.option("--quant", "-q", type=click.Choice(ALL_SCHEMES), help="As for run.")
@click.option("--group-size", type=int, help="As for run.")
@quant_head_option("As for run.")
@click.option("--kernel", type=click.Choice(list(KERNELS_BY_NAME)), help="As for run.")
@click.option("--if-idle", is_flag=True, hidden=True, help="Leave at once if another build is running.")
def compile_step(model: str, ctx: int | None, device: str, dtype: str, threads: int | None, quant: str | None,
                 group_size: int | None, quant_head: str | None, kernel: str | None, if_idle: bool) -> None:
    """Build MODEL's compiled decode step (AOTInductor, on the CPU) now, so that `localllm run MODEL`
    uses it from its first token; run with the same --threads/--quant/--kernel as those runs.

    Runs build it in the background by themselves; this is for doing it ahead (set-up does it for the
    embedded model). About a minute on two cores; once per model, not per context length.
    """
    from filelock import FileLock, Timeout

    from localllm.errors import LocalLLMError
    from localllm.loaders.load import load_model
    from localllm.runtime.aot import failure_marker, package_paths
    from localllm.runtime.compile import compile_unavailable_reason
    from localllm.runtime.generate import Generator
    from localllm.threads import set_threads

    set_threads(threads)
    lm = load_model(model, device=device, dtype=dtype, quant=quant, group_size=group_size,
                    quantize_head=quant_head, kernel=kernel)
    if lm.device.type != "cpu":
        raise LocalLLMError(f"nothing to build ahead on {lm.device}: CUDA steps are compiled by run --compile",
                            "use --device cpu, or run with --compile")
    reason = compile_unavailable_reason(lm.device)
    if reason:
        raise LocalLLMError(f"cannot build a compiled step here: {reason}", "runs stay eager; install a C++ compiler")
    ctx = ctx if ctx is not None else min(lm.config.max_seq_len, 4096)
    try:
        with FileLock(_lock_path(), timeout=0 if if_idle else -1):
            ready = Generator(lm.model, ctx, compile="auto")
            if ready.step_kind == "aot":
                note(f"the compiled decode step of {model} is already built")
                return
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                built = Generator(lm.model, ctx, compile=True)
            kind = built.step_kind
    except Timeout:
        note("another build is running; leaving it to finish")
        return
    if kind != "aot":  # recorded, so that runs stop starting a build that fails
        why = "; ".join(str(w.message) for w in said) or f"it runs {kind}"
        paths, _ = package_paths(lm.model, built.cache, home() / "inductor" / "aot")
        for _, path in paths:  # each that is missing: a run looks up the first one it misses
            if not path.exists():
                failure_marker(path).write_text(why + "\n")
        raise LocalLLMError(f"building the compiled decode step of {model} failed ({why.splitlines()[0][:300]})",
                            "runs stay eager; `localllm compile` tries again (set LOCALLLM_DEBUG=1 for the details)")
    for _, path in package_paths(lm.model, built.cache, home() / "inductor" / "aot")[0]:
        failure_marker(path).unlink(missing_ok=True)  # an earlier failure, fixed since
    note(f"built the compiled decode step of {model} in {time.perf_counter() - t0:.0f} s; runs use it from now on")


def build_after(args: LoadArgs, ctx: int, needed: bool) -> None:
    """After a run that found no compiled step (``needed``): start its build in the background and say so."""
    if needed and start_background_build(args, ctx):
        note("building a compiled decode step for this model in the background (about a minute); "
             "later runs use it")
