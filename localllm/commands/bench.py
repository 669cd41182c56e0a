"""``localllm bench MODEL``: memory, speed and quality of weight schemes, side by side in one run."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from localllm.bench.settings import DEFAULT_SCHEMES
from localllm.commands.common import kv_cache_option, placement_options, quant_head_option, threads_option
from localllm.paths import DEFAULT_MODEL
from localllm.quant.formats import ALL_SCHEMES
from localllm.quant.kernels import BY_NAME as KERNELS_BY_NAME

if TYPE_CHECKING:
    from localllm.bench.serving import ServingSettings


@click.command()
@click.argument("model", default=DEFAULT_MODEL, required=False)
@click.option("--quant", "-q", metavar="SCHEMES",
              help=f"Comma-separated schemes among {', '.join(ALL_SCHEMES)}. Default: "
                   f"{','.join(DEFAULT_SCHEMES['cpu'])} on the CPU, {','.join(DEFAULT_SCHEMES['cuda'])} on CUDA.")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA if available), cpu, cuda, cuda:N.")
@placement_options
@click.option("--prompt-tokens", type=int,
              help="Prompt length, cut from the evaluation text. Default: 512; 128 with --concurrency.")
@click.option("--gen-tokens", type=int, default=128, show_default=True,
              help="Tokens generated per run (greedy, end-of-sequence ignored).")
@click.option("--ctx", type=int, help="KV cache length. Default: prompt + generated tokens.")
@click.option("--runs", type=int, default=5, show_default=True, help="Timed runs per scheme, after one warm-up.")
@threads_option
@click.option("--json", "json_path", metavar="FILE", help="Write every figure as JSON ('-': to stdout).")
@click.option("--plot", "plot_path", metavar="FILE.png", help="Write bar charts (needs pip install localllm[plot]).")
@click.option("--text", "text_path", metavar="FILE",
              help="Your own text for the prompt and the quality figures (default: the built-in eval text).")
@click.option("--no-cache", "kv_compare", is_flag=True,
              help="Also time decode with and without the KV cache (first scheme only).")
@click.option("--no-quality", is_flag=True, help="Skip perplexity / KL divergence / top-1 agreement.")
@quant_head_option("For the quantized schemes only; default: as in run.")
@click.option("--compile", "compile_", is_flag=True,
              help="Time the compiled decode step (AOTInductor, on the CPU; built before "
                   "the runs, not timed).")
@kv_cache_option
@click.option("--concurrency", metavar="LEVELS",
              help="Serving mode: drive the batch engine with this many concurrent streams per level, e.g. "
                   "1,2,4,8,16 (one scheme: --quant SCHEME or the model's own). Reports TTFT, inter-token "
                   "latency, throughput, prefix-cache hits. Default levels per workload: uniform 1,2,4,8,16, "
                   "mixed 8 slots, agent 4 agents, edit/summarize/open 1,8.")
@click.option("--workload", type=click.Choice(["uniform", "mixed", "agent", "edit", "summarize", "open"]),
              help="Serving mode's workload (implies serving mode; default uniform): same-length requests; "
                   "32 short and long replies, continuous vs static batching; agents resending a growing "
                   "history, with and without the prefix cache; edit (a source file returned with one change), "
                   "summarize (an article summarised with quotes) and open (free text), each with speculative "
                   "decoding off and on side by side.")
@click.option("--speculate", type=click.Choice(["on", "off", "compare"]), default="on", show_default=True,
              help="Serving mode: speculative decoding in the engine; compare: each level with it off and on, "
                   "interleaved rounds (the edit, summarize and open workloads always compare).")
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Serving mode: prompt tokens the engine prefills per step, all requests together. Smaller "
                   "chunks keep running streams' inter-token latency low while a long prompt is prefilled; "
                   "larger ones give that prompt its first token sooner.")
@click.option("--kernel", type=click.Choice(list(KERNELS_BY_NAME)),
              help="Serving mode: force a matmul kernel, as for run (e.g. int4-q8-cpu: int8 activations).")
def bench(
    model: str,
    quant: str | None,
    device: str,
    cpu_moe: bool,
    n_cpu_moe: int | None,
    gpu_layers: int | None,
    prompt_tokens: int,
    gen_tokens: int,
    ctx: int | None,
    runs: int,
    threads: int | None,
    json_path: str | None,
    plot_path: str | None,
    text_path: str | None,
    kv_compare: bool,
    no_quality: bool,
    quant_head: str | bool | None,
    compile_: bool,
    kv_cache: str,
    concurrency: str | None,
    workload: str | None,
    speculate: str,
    chunk_tokens: int,
    kernel: str | None,
) -> None:
    """Benchmark MODEL (a model folder, a .gguf file, a stored NAME or 'smollm2') in each weight scheme:
    weight bytes, load time, peak memory, KV cache size, TTFT, prefill and decode speed, decode bandwidth
    against the machine's measured bandwidth, and quality against the highest-precision scheme.

    The table goes to stdout; progress, machine and method notes to stderr.
    """
    from localllm.bench.measure import bench_checkpoint
    from localllm.bench.plot import require_matplotlib
    from localllm.bench.report import report, require_writable
    from localllm.loaders.store import check_local_path

    check_local_path(model)
    placement = {"cpu_moe": cpu_moe, "n_cpu_moe": n_cpu_moe, "gpu_layers": gpu_layers}  # LoadSpec's fields
    if plot_path is not None:
        require_matplotlib()
    require_writable(json_path, plot_path)
    if concurrency is not None or workload is not None:
        from localllm.bench.serving import ServingSettings, parse_levels

        workload = workload or "uniform"
        s = ServingSettings(workload, parse_levels(concurrency, workload),
                            prompt_tokens=128 if prompt_tokens is None else prompt_tokens, gen_tokens=gen_tokens,
                            chunk_tokens=chunk_tokens, kv_dtype=kv_cache, speculate=speculate)
        serving(model, quant, device, threads, json_path, plot_path, text_path, s, compile_ or kv_compare, kernel,
                **placement)
        return
    if kernel is not None:
        from localllm.errors import LocalLLMError

        raise LocalLLMError("--kernel applies to the serving mode only",
                            "add --concurrency or --workload, or time the kernel with `localllm run --kernel`")
    prompt_tokens = 512 if prompt_tokens is None else prompt_tokens
    result = bench_checkpoint(model, quant, device, prompt_tokens, gen_tokens, ctx, runs, threads, text_path,
                              kv_compare, not no_quality, quant_head, compile_, kv_dtype=kv_cache, **placement)
    report(result, json_path, plot_path)


def serving(model: str, quant: str | None, device: str, threads: int | None, json_path: str | None,
            plot_path: str | None, text_path: str | None, s: ServingSettings, single_stream_flags: bool,
            kernel: str | None = None, cpu_moe: bool = False, n_cpu_moe: int | None = None,
            gpu_layers: int | None = None) -> None:
    """``bench --concurrency/--workload``: the serving figures of one scheme on the batch engine."""
    from localllm.bench.report import report
    from localllm.bench.serving import bench_serving
    from localllm.bench.serving_report import format_serving, write_serving_plot
    from localllm.errors import LocalLLMError

    if single_stream_flags:
        raise LocalLLMError("--compile and --no-cache time single-stream decoding, not the serving mode",
                            "drop them, or drop --concurrency/--workload")
    if quant is not None and "," in quant:
        raise LocalLLMError(f"serving mode measures one scheme, not '{quant}'", "give one --quant SCHEME")
    result = bench_serving(model, s, quant, device, threads, text_path, kernel=kernel, cpu_moe=cpu_moe,
                           n_cpu_moe=n_cpu_moe, gpu_layers=gpu_layers)
    report(result, json_path, plot_path, table_of=format_serving, plot=write_serving_plot)
