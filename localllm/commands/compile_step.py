"""``localllm compile MODEL``: build a model's compiled decode step now (a thin wrapper: which step
a model needs, building it, its lock, failure marks and background builds belong to
:mod:`runtime.compiled_step`).

A plain ``localllm run`` never waits for a compiler: it uses the step built for its model when there
is one, and otherwise runs eagerly and, once its reply is done, starts this command in a detached
process (``--if-idle``, at the lowest CPU priority) so that the next run finds the step. Set-up builds
the embedded model's step in the foreground; ``pull`` starts the build for the model it stored,
``serve`` for each model it loads (``--batch`` its ``--parallel``). With speculation on (the default)
the batch covers a lone sequence's verify steps too: up to 1 + MAX_DRAFT rows
(:func:`runtime.compiled_step.wanted_batch`).
"""

from __future__ import annotations

import click

from localllm.commands.common import kv_cache_option, note, quant_head_option, threads_option
from localllm.paths import DEFAULT_MODEL
from localllm.quant.formats import ALL_SCHEMES
from localllm.quant.kernels import BY_NAME as KERNELS_BY_NAME
from localllm.runtime.compiled_step import LoadArgs, start_background_build, wanted_batch


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
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help=f"Query rows at once the step is built for: 1 for run's plain steps, {wanted_batch(1, True)} "
                   "for its verify steps too (speculation), serve's --parallel for the server.")
@click.option("--if-idle", is_flag=True, hidden=True,
              help="A background build: leave at once if another build is running, at the lowest CPU priority.")
def compile_step(model: str, device: str, dtype: str, threads: int | None, quant: str | None,
                 group_size: int | None, quant_head: str | None, kernel: str | None, kv_cache: str, batch: int,
                 if_idle: bool) -> None:
    """Build MODEL's compiled decode step (AOTInductor, on the CPU) now, so that `localllm run MODEL`
    uses it from its first token; run with the same --threads/--quant/--kernel as those runs.

    Runs build it in the background by themselves; this is for doing it ahead (set-up does it for the
    embedded model). About a minute on two cores for one sequence (and once more for each range of
    batch sizes the quantized kernels treat apart); once per model, for every context length.
    """
    from localllm.errors import LocalLLMError
    from localllm.loaders.load import load_model
    from localllm.runtime import compiled_step
    from localllm.threads import set_threads

    if if_idle:  # before anything runs: the loading, and every thread and compiler started later
        compiled_step.yield_cpu()
    set_threads(threads)
    lm = load_model(model, device=device, dtype=dtype, quant=quant, group_size=group_size,
                    quantize_head=quant_head, kernel=kernel)
    reason = compiled_step.compile_unavailable_reason(lm.device)
    if reason:
        raise LocalLLMError(f"cannot build a compiled decode step here: {reason}",
                            "runs stay eager" + ("; install a C++ compiler" if lm.device.type == "cpu" else
                                                 "; use --device cpu"))
    result = compiled_step.build(lm.model, batch, kv_cache, wait=not if_idle, background=if_idle)
    if result.busy:
        note("another build is running; leaving it to finish")
    elif result.already:
        note(f"the compiled decode step of {model} is already built")
    elif result.error is not None:
        raise LocalLLMError(f"building the compiled decode step of {model} failed ({result.error.splitlines()[0][:300]})",
                            "runs stay eager; `localllm compile` tries again (set LOCALLLM_DEBUG=1 for the details)")
    else:
        note(f"built the compiled decode step of {model} in {result.seconds:.0f} s; runs use it from now on")


def build_after(args: LoadArgs, needed: bool, batch: int = 1) -> None:
    """After a run that found no compiled step (``needed``): start its build in the background and say
    so (it outlives this command)."""
    if needed and start_background_build(args, batch):
        note("building this model's compiled decode steps in the background (a minute or two each, only on idle "
             "CPU time; it goes on after this command; output in the logs folder); later runs use them")
