"""Human-readable figures for the terminal (stderr)."""

from __future__ import annotations

import click
import torch

from localllm.format import human_size
from localllm.runtime.cache import kv_label
from localllm.runtime.kv_pool import cache_bytes, sequence_bytes
from localllm.runtime.batch import GenerationStats


def human_duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds:.3f}s"


def print_stats(stats: GenerationStats, load_s: float | None = None) -> None:
    """Ollama's ``--verbose`` block: load duration, prompt eval and eval counts, durations and rates."""
    rows = []
    if load_s is not None:
        rows.append(("load duration", human_duration(load_s)))
    rows += [
        ("prompt eval count", f"{stats.prefilled_tokens} token(s)"
         + (f" (+{stats.cached_tokens} cached)" if stats.cached_tokens else "")),
        ("prompt eval duration", human_duration(stats.prompt_s)),
        ("prompt eval rate", f"{stats.prompt_tps:.2f} tokens/s"),
        ("eval count", f"{stats.generated_tokens} token(s)"),
        ("eval duration", human_duration(stats.decode_s)),
        ("eval rate", f"{stats.decode_tps:.2f} tokens/s"),
    ]
    if stats.drafted_tokens:
        rows.append(("draft tokens", f"{stats.accepted_tokens} of {stats.drafted_tokens} accepted, "
                                     f"{stats.mean_accepted:.2f} per verify step ({stats.draft_steps} steps)"))
    for name, value in rows:
        click.echo(f"{name + ':':<22}{value}", err=True)


def describe_model(lm, ctx: int, kv_dtype: str = "16bit") -> None:  # type: ignore[no-untyped-def]
    """What runs: source, device, weight scheme, kernels, weight and KV cache bytes (stderr)."""
    act = str(lm.dtype).removeprefix("torch.")
    kernels = ", ".join(f"{name} x{n}" for name, n in sorted(lm.kernels.items())) or "torch (float)"
    # a generator's cache holds the activations' dtype, float16, or int8 codes and their scales
    kv = sequence_bytes(lm.config, ctx, lm.model.dtype, kv_dtype)
    kv_kind = kv_label(kv_dtype, lm.model.dtype)
    click.echo(f"model:   {lm.source}", err=True)
    threads = torch.get_num_threads()
    on_cpu = f", {threads} thread{'s' if threads != 1 else ''}" if lm.device.type == "cpu" else ""
    click.echo(f"device:  {lm.device}{on_cpu}, activations {act}", err=True)
    click.echo(f"weights: {lm.scheme_label}, {human_size(lm.weight_bytes)} in memory; kernels: {kernels}", err=True)
    for kind, became in lm.tensor_import.items():  # a GGUF: what each tensor type became
        click.echo(f"tensors: {kind}: {became}", err=True)
    click.echo(f"kv cache: {human_size(kv)} for {ctx} tokens ({kv_kind}, "
               f"{human_size(cache_bytes(lm.config, 1, lm.model.dtype, kv_dtype))} per token)", err=True)


#: Said with a MoE model's placement on a GPU: why its decode steps are not captured.
MOE_GRAPHS_NOTE = ("CUDA graphs off for MoE models (the routing reads back each expert's rows, and a step with "
                   "experts in CPU RAM cannot be captured)")


def placement_lines(lm, eager_reason: str | None = None) -> list[str]:  # type: ignore[no-untyped-def]
    """Where a GPU run's experts and blocks live, and why (:meth:`loaders.placement.Placement.describe`):
    the lines ``run --verbose`` prints after "placement: ", and ``bench`` and ``serve`` report likewise.
    No line on a CPU run (everything is in RAM there). ``eager_reason``: an engine's reason for eager
    steps (a model split between devices), where there is an engine to ask."""
    lines = []
    if lm.placement is not None:
        lines += lm.placement.describe()
        if lm.config.is_moe:
            lines.append(MOE_GRAPHS_NOTE)
    if eager_reason:
        lines.append(eager_reason)
    return lines
