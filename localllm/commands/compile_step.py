"""``localllm compile MODEL``: build a model's compiled decode step now (a thin wrapper: which step
a model needs, building it, its lock, failure marks and when a background build may start belong to
:mod:`runtime.compiled_step`), and the command line a background build runs (:func:`build_in_background`).

A plain ``localllm run`` never waits for a compiler: it uses the step built for its model when there
is one, and otherwise runs eagerly and, once its reply is done, starts this command in a detached
process (``--if-idle``, at the lowest CPU priority, kept by :mod:`localllm.yielding`, its output in
``<home>/logs/compile.log``) so that the next run finds the step. Set-up builds
the embedded model's step in the foreground; ``pull`` starts the build for the model it stored,
``serve`` for each model it loads (``--batch`` its ``--parallel``). With speculation on (the default)
the batch covers a lone sequence's verify steps too: up to 1 + MAX_DRAFT rows
(:func:`runtime.compiled_step.wanted_batch`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import click
import torch

from localllm.commands.common import kv_cache_option, note, quant_head_option, threads_option
from localllm.loaders.spec import LoadSpec
from localllm.paths import DEFAULT_MODEL, build_log
from localllm.quant.formats import ALL_SCHEMES
from localllm.quant.kernels import BY_NAME as KERNELS_BY_NAME
from localllm.runtime.compiled_step import start_background_build, wanted_batch


@click.command("compile")
@click.argument("model", default=DEFAULT_MODEL, required=False)
@click.option("--device", default="auto", show_default=True, help="As for run: the step is built for how run loads it.")
@click.option("--dtype", default="auto", show_default=True, help="As for run.")
@threads_option
@click.option("--quant", "-q", type=click.Choice(ALL_SCHEMES), help="As for run.")
@click.option("--group-size", type=int, help="As for run.")
@quant_head_option("As for run.")
@click.option("--kernel", type=click.Choice(list(KERNELS_BY_NAME)), help="As for run.")
@kv_cache_option
@click.option("--batch", type=click.IntRange(min=1), default=wanted_batch(1, True), show_default=True,
              help=f"Query rows at once the step is built for: {wanted_batch(1, True)} for run's steps and its "
                   "verify steps (speculation), 1 for its plain steps alone, serve's --parallel for the server.")
@click.option("--if-idle", is_flag=True, hidden=True,
              help="A background build: leave at once if another build is running, at the lowest CPU priority.")
def compile_step(model: str, device: str, dtype: str, threads: int | None, quant: str | None,
                 group_size: int | None, quant_head: str | None, kernel: str | None, kv_cache: str, batch: int,
                 if_idle: bool) -> None:
    """Build MODEL's compiled decode step (AOTInductor, on the CPU) now, so that `localllm run MODEL`
    uses it from its first token; run with the same --threads/--quant/--kernel as those runs.

    Runs build it in the background by themselves; this is for doing it ahead (set-up does it for the
    embedded model), or now after a failed build, which runs retry only after a back-off. About a
    minute on two cores for each range of batch sizes the quantized kernels treat apart; once per
    model, for every context length.
    """
    from localllm.errors import LocalLLMError
    from localllm.loaders.load import load_model
    from localllm.runtime import compiled_step
    from localllm.threads import set_threads

    if if_idle:  # before anything runs: the loading, and every thread and compiler started later
        compiled_step.yield_cpu()
    set_threads(threads)
    spec = LoadSpec(model, device, dtype, quant, group_size, quant_head, kernel, kv_cache)
    lm = load_model(spec)
    reason = compiled_step.compile_unavailable_reason(lm.device)
    if reason:
        raise LocalLLMError(f"cannot build a compiled decode step here: {reason}",
                            "runs stay eager" + ("; install a C++ compiler" if lm.device.type == "cpu" else
                                                 "; use --device cpu"))
    result = compiled_step.build(lm.model, batch, spec.kv_dtype, wait=not if_idle, background=if_idle)
    if result.busy:
        note("another build is running; leaving it to finish")
    elif result.already:
        note(f"the compiled decode step of {model} is already built")
    elif result.error is not None:
        raise LocalLLMError(f"building the compiled decode step of {model} failed ({result.error.splitlines()[0][:300]})",
                            "runs stay eager and try again later, `localllm compile` now"
                            + (f"; the full output is in {build_log()}" if result.logged else ""))
    else:
        note(f"built the compiled decode step of {model} in {result.seconds:.0f} s; runs use it from now on")


def compile_argv(spec: LoadSpec, batch: int) -> list[str]:
    """The ``localllm compile --if-idle`` command line of a background build: the model loaded as
    ``spec`` says, with this process's thread count (packages are keyed by it), for batches of up to
    ``batch`` query rows."""
    device = spec.device if isinstance(spec.device, str) else str(spec.device.device)
    head = "none" if spec.quantize_head is False else spec.quantize_head  # --quant-head's name for 16-bit
    out = [sys.executable, "-m", "localllm", "compile", spec.ref, "--device", device, "--dtype", spec.dtype,
           "--kv-cache", spec.kv_dtype]
    for flag, value in (("--quant", spec.quant), ("--group-size", spec.group_size), ("--quant-head", head),
                        ("--kernel", spec.kernel)):
        if value is not None:
            out += [flag, str(value)]
    return out + ["--threads", str(torch.get_num_threads()), "--batch", str(batch), "--if-idle"]


def launch_build(spec: LoadSpec, batch: int) -> None:
    """Start :func:`compile_argv` in a detached process kept by :mod:`localllm.yielding` (stopped
    whenever an engine on this machine generates), its output appended to :func:`build_log`."""
    log_path = build_log()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "localllm.yielding", *compile_argv(spec, batch)]
    with open(log_path, "ab") as log:
        log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv[1:])}\n".encode())
        log.flush()
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)  # outlives this process; Ctrl-C here does not reach it


def build_in_background(spec: LoadSpec, batch: int = 1) -> bool:
    """Start a background build of the compiled decode step of the model ``spec`` loads, for batches of
    up to ``batch`` (:func:`runtime.compiled_step.start_background_build` decides whether one may
    start; :func:`launch_build` starts it). False when none was started."""
    return start_background_build(partial(launch_build, spec), batch)


def build_after(spec: LoadSpec, needed: bool, batch: int = 1) -> None:
    """After a run that found no compiled step (``needed``): start its build in the background and say
    so (it outlives this command)."""
    if needed and build_in_background(spec, batch):
        note("building this model's compiled decode steps in the background (a minute or two each, only on idle "
             "CPU time; it goes on after this command; output in the logs folder); later runs use them")
