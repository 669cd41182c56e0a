"""``localllm compile MODEL``: build a model's compiled decode step now, and the background build that
``run`` and ``pull`` start when a model has none yet.

A plain ``localllm run`` never waits for a compiler: it uses the step built for its model when there
is one (the batch engine's decode step, :mod:`runtime.paged_aot`: one package serves every context,
pool and batch size in a range; for a sliding-window model the one-sequence step of
:mod:`runtime.aot`), and otherwise runs eagerly and, once its reply is done, starts this command in a
detached process so that the next run finds the step. Set-up builds the embedded model's step in the
foreground; ``pull`` starts the build for the model it stored, ``serve`` for each model it loads
(``--batch`` its ``--parallel``). Builds take a lock, so at most one runs at a time (on a small CPU
two would slow each other and the user's run); one that finds the lock taken leaves.

``LOCALLLM_BACKGROUND_BUILD=0`` turns the background builds off (the test suite does).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import click
import torch

from localllm.commands.common import kv_cache_option, note, quant_head_option, threads_option
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
    kv_cache: str = "16bit"  # the pool's dtype is part of the batch step's shapes

    def argv(self) -> list[str]:
        out = [self.model, "--device", self.device, "--dtype", self.dtype, "--kv-cache", self.kv_cache]
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


def start_background_build(args: LoadArgs, ctx: int | None = None, batch: int = 1) -> bool:
    """Start ``localllm compile`` for ``args`` (and batches of up to ``batch`` sequences) in a detached
    process (its output in ``<home>/logs/compile.log``), with this process's thread count. False when
    background builds are off, no compiler is here, or a build is already running."""
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
            "--threads", str(torch.get_num_threads()), "--batch", str(batch), "--if-idle"]
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
@kv_cache_option
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sequences at once the step is built for: 1 for run, serve's --parallel for the server.")
@click.option("--if-idle", is_flag=True, hidden=True, help="Leave at once if another build is running.")
def compile_step(model: str, ctx: int | None, device: str, dtype: str, threads: int | None, quant: str | None,
                 group_size: int | None, quant_head: str | None, kernel: str | None, kv_cache: str, batch: int,
                 if_idle: bool) -> None:
    """Build MODEL's compiled decode step (AOTInductor, on the CPU) now, so that `localllm run MODEL`
    uses it from its first token; run with the same --threads/--quant/--kernel as those runs.

    Runs build it in the background by themselves; this is for doing it ahead (set-up does it for the
    embedded model). About a minute on two cores for one sequence (and once more for each range of
    batch sizes the quantized kernels treat apart); once per model, not per context length.
    """
    from filelock import FileLock, Timeout

    from localllm.errors import LocalLLMError
    from localllm.loaders.load import load_model
    from localllm.runtime.aot import failure_marker
    from localllm.runtime.compile import compile_unavailable_reason
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
    windowed = any(layer.attn.window is not None for layer in lm.model.layers)
    try:
        with FileLock(_lock_path(), timeout=0 if if_idle else -1):
            step = _SequenceStep(lm.model, ctx) if windowed else _BatchStep(lm.model, batch, kv_cache)
            if step.ready():
                note(f"the compiled decode step of {model} is already built")
                return
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                why = step.build()
    except Timeout:
        note("another build is running; leaving it to finish")
        return
    if why is not None:  # recorded, so that runs stop starting a build that fails
        why = "; ".join([*(str(w.message) for w in said), why])
        for path in step.paths():
            if not path.exists():  # each that is missing: a run looks up the first one it misses
                failure_marker(path).write_text(why + "\n")
        raise LocalLLMError(f"building the compiled decode step of {model} failed ({why.splitlines()[0][:300]})",
                            "runs stay eager; `localllm compile` tries again (set LOCALLLM_DEBUG=1 for the details)")
    for path in step.paths():
        failure_marker(path).unlink(missing_ok=True)  # an earlier failure, fixed since
    note(f"built the compiled decode step of {model} in {time.perf_counter() - t0:.0f} s; runs use it from now on")


class _BatchStep:
    """The batch engine's decode step (:mod:`runtime.paged_aot`), for batches of up to ``batch``: what
    ``run`` (one sequence) and ``serve`` (``--parallel`` sequences) use."""

    def __init__(self, model, batch: int, kv_dtype: str = "16bit") -> None:  # type: ignore[no-untyped-def]
        from localllm.runtime.kv_pool import DEFAULT_BLOCK_SIZE, block_bytes

        self.model, self.batch, self.kv_dtype = model, batch, kv_dtype
        # the packages serve any pool size: the smallest pool will do to find or build them
        self.budget = 4 * block_bytes(model.config, DEFAULT_BLOCK_SIZE, model.dtype, kv_dtype)
        self.engine = self._engine("auto")

    def _engine(self, compile: bool | str):  # type: ignore[no-untyped-def]
        from localllm.runtime.batch import BatchEngine

        return BatchEngine(self.model, kv_budget_bytes=self.budget, max_running=self.batch, compile=compile,
                           kv_dtype=self.kv_dtype)

    def ready(self) -> bool:
        return self.engine.compiled

    def build(self) -> str | None:
        """Build the missing packages; why they could not be (None: built)."""
        self.engine = self._engine(True)
        return None if self.engine.compiled else (self.engine.compile_note or "the step runs eagerly")

    def paths(self) -> list[Path]:
        from localllm.runtime.paged_aot import package_paths

        paths, _ = package_paths(self.model, self.engine.pool, home() / "inductor" / "aot")
        return [p for (lo, _), p in paths if lo <= self.batch]


class _SequenceStep:
    """The one-sequence decode step (:mod:`runtime.aot`) of a model with sliding-window layers, whose
    ring caches ``run`` keeps (see :class:`runtime.engine.Engine`)."""

    def __init__(self, model, ctx: int) -> None:  # type: ignore[no-untyped-def]
        from localllm.runtime.generate import Generator

        self.model, self.ctx = model, ctx
        self.generator = Generator(model, ctx, compile="auto")

    def ready(self) -> bool:
        return self.generator.step_kind == "aot"

    def build(self) -> str | None:
        from localllm.runtime.generate import Generator

        self.generator = Generator(self.model, self.ctx, compile=True)
        kind = self.generator.step_kind
        return None if kind == "aot" else f"it runs {kind}"

    def paths(self) -> list[Path]:
        from localllm.runtime.aot import package_paths

        return [p for _, p in package_paths(self.model, self.generator.cache, home() / "inductor" / "aot")[0]]


def build_after(args: LoadArgs, ctx: int, needed: bool) -> None:
    """After a run that found no compiled step (``needed``): start its build in the background and say so."""
    if needed and start_background_build(args, ctx):
        note("building a compiled decode step for this model in the background (about a minute); "
             "later runs use it")
