"""What several commands share: options defined once, and how loaders' progress lines are printed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from localllm.quant.formats import QUANT_SCHEMES
from localllm.loaders.calibrate import CALIBRATIONS
from localllm.runtime.cache import DEFAULT_KV_DTYPE, KV_DTYPES

def note(message: str) -> None:
    """A line about what is going on (a loader's progress callback): stderr, so stdout keeps only results."""
    click.echo(message, err=True)


speculate_option = click.option(
    "--speculate", type=click.Choice(["on", "off"]), default="on", show_default=True,
    help="on: propose tokens from the text's own history (n-gram lookup) and check them in one step where the "
         "measured step times say it pays; the tokens are the same either way. off: one token per step.")

threads_option = click.option("--threads", type=int, help="CPU threads torch computes with (default: one per core).")

kv_cache_option = click.option(
    "--kv-cache", "kv_cache", type=click.Choice(KV_DTYPES), default=DEFAULT_KV_DTYPE, show_default=True,
    help="KV cache storage: 16bit (the activations' dtype), fp16 (float16 under the CPU's fp32 activations: half "
         "the bytes, so a batch's attention reads half as much) or int8 (codes with a scale per token and head: "
         "half the bytes of a 16-bit cache).")

def calibration_option(default: str | None, said: str) -> Callable[[Any], Any]:
    """``--calibration auto|awq|none``; ``default`` None: the command decides (``said`` tells how)."""
    return click.option(
        "--calibration", type=click.Choice(list(CALIBRATIONS)), default=default,
        help="int4 from float weights (a safetensors model): awq scales each layer's inputs by statistics of a "
             "calibration text shipped with localllm, searched to minimise the layer's output error (seconds "
             "to minutes a layer on the CPU, by its size); none rounds each weight to nearest; auto is awq up to "
             "1B parameters, none above. GGUF and quantized sources keep their values. " + said)


def quant_head_option(default: str) -> Callable[[Any], Any]:
    """``--quant-head int8|int4|nf4|none``: the output head's scheme; ``none`` arrives as False (16-bit)."""
    return click.option(
        "--quant-head", type=click.Choice([*QUANT_SCHEMES, "none"]),
        callback=lambda ctx, param, value: False if value == "none" else value,
        help="Scheme of the output head (int8 also serves a tied embedding table); none = 16-bit. " + default)


def placement_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--cpu-moe`` and ``--n-cpu-moe N`` (llama.cpp's names): a MoE model's experts in CPU RAM on a GPU;
    ``--gpu-layers N`` (llama.cpp's ``-ngl``): the last N blocks on the GPU, the first ones in CPU RAM.

    One definition for ``run``, ``serve`` and ``bench``: each passes the values on as
    :class:`loaders.spec.LoadSpec`'s ``cpu_moe``, ``n_cpu_moe`` and ``gpu_layers`` (a negative N is
    click's usage error; ``--cpu-moe`` beside ``--n-cpu-moe`` means every layer's experts, as in
    llama.cpp; on a CPU device the flags are accepted and change nothing)."""
    command = click.option(
        "--gpu-layers", "gpu_layers", type=click.IntRange(0), metavar="N",
        help="On a GPU: keep the last N transformer blocks (and the head) on the GPU and the first ones, with "
             "their KV cache, in CPU RAM, run there (llama.cpp's -ngl; more than the model has: all). Default: "
             "every block on the GPU when the model fits, else as many as fit. No effect on a CPU run.")(command)
    command = click.option(
        "--n-cpu-moe", "n_cpu_moe", type=click.IntRange(0), metavar="N",
        help="On a GPU: keep the experts of the first N layers of a Mixture-of-Experts model in CPU RAM and run "
             "them there. Default: as many layers' experts on the GPU as its memory holds beside the rest of "
             "the model. No effect on a CPU run or a dense model.")(command)
    return click.option(
        "--cpu-moe", is_flag=True,
        help="On a GPU: keep every expert of a Mixture-of-Experts model in CPU RAM and run them there "
             "(attention, routers, shared experts and the KV cache stay on the GPU).")(command)
