"""The whole bench run: memory, speed and quality of weight schemes, measured side by side in one process.

This is the instrument later performance work is judged by, so every figure says how it was
measured and the machine's own memory bandwidth is measured in the same run (the roofline of a
decode step is bandwidth / bytes read per token, and both come from here).

For each scheme, one at a time (the previous scheme's model is freed first):

* load it (``load_s``: the whole :func:`loaders.load.load_model` call, or building the random model);
* one warm-up run, then ``runs`` timed runs: prefill of the prompt (the first ``prompt_tokens``
  tokens of the evaluation text) and ``gen_tokens`` greedy tokens with end-of-sequence ignored;
* memory while loading and running: on CUDA the growth of ``torch.cuda.max_memory_allocated`` (and
  ``max_memory_reserved``) over what was allocated before the load, the peak statistics reset per
  scheme; on the CPU the growth of the resident set (VmRSS) over its size before the load, sampled
  every few milliseconds by a background thread, in a fresh process per scheme for checkpoints
  (:mod:`localllm.bench.memprobe`: in one process the allocator's leftovers of the previous scheme
  change the next one's figure), in this process otherwise;
* with ``kv_compare`` (``--no-cache``), for the first scheme only (the cache's effect comes from
  the sequence length, not from the weight format), decode with and without the KV cache
  (:func:`runtime.kvcompare.decode_latencies`) after a 16-token prompt, the per-step latency at
  steps 1, 10, 20, 50, 100 (each the median of the steps within 2 of it).

Quality runs after the speed runs, against the highest-precision scheme of the run
(fp32 > fp16 > bf16 > int8 > int4 > nf4; fp16 before bf16: 3 more mantissa bits). The reference
model stays loaded while each other scheme is loaded next to it, compared over the whole text
(:func:`runtime.quality.compare`) and freed, so at most two models are in memory at once.

JSON schema (``SCHEMA`` = "localllm.bench/5"; keys are always present, a figure that was not
measured is ``null``; durations in seconds, sizes in bytes, rates per second)::

    schema            "localllm.bench/5"
    model             what was benchmarked (path, stored name, or "random <shape>")
    device            "cpu" | "cuda" | "cuda:N"
    settings          schemes [str], baseline str, prompt_tokens, gen_tokens, ctx, runs,
                      warmup_runs, threads, text (path or "built-in eval text"), text_tokens,
                      quality (bool), kv_compare (bool), compile (bool),
                      step_kinds (how compiled steps ran: "aot", or "eager" where a build failed)
    machine           cpu_model, cpu_count, threads, gpu_name, gpu_capability, gpu_memory_bytes,
                      torch_version, localllm_version, python_version, platform,
                      load_average ([1, 5, 15] minutes, at the start; a busy machine is warned of)
    bandwidth         method, tensor_bytes, repeats, read_bytes_per_s (t.sum() of the tensor),
                      copy_bytes_per_s (a copy into a second tensor, read + write counted),
                      bytes_per_s (the larger: the roofline's denominator)
    schemes           {scheme: {
        label, activation_dtype, kernels {kernel: layers},
        decode_step           {kind: compiled / cuda-graphs / eager, why: an eager step's reason}
        placement             null (a CPU run), or [str]: where a GPU run's experts and blocks live and
                              why, as ``run --verbose`` says it (``--cpu-moe``, ``--n-cpu-moe N``,
                              ``--gpu-layers N``, or the memory plan)
        weight_bytes          parameters and buffers in memory (a tied tensor once)
        read_bytes_per_token  weight bytes a decode step reads: all weights, once each, except an
                              untied embedding table of which decode reads one row (KV cache reads
                              not counted)
        load_s
        memory                method, peak_bytes, peak_reserved_bytes (CUDA; null on CPU),
                              after_load_bytes, weights_kv_bytes (weight_bytes + kv_cache.ctx_bytes),
                              ratio_to_weights_kv (peak_bytes / weights_kv_bytes), bound_bytes
                              (1.15 x weights_kv_bytes + 64 MB: the target), within_bound (bool),
                              process ("fresh": measured in a process of its own, "shared": in the
                              bench's), library_bytes ({library: bytes} of fixed per-process costs
                              taken before the baseline: kernel builds, bitsandbytes' import)
        kv_cache              kv_dtype ("16bit" | "int8"), bytes_per_token, ctx, ctx_bytes, max_seq_len,
                              max_seq_len_bytes
        ttft_s, prefill_tps, decode_tps, inter_token_s     {median, min, max} over the runs
        runs                  [{ttft_s, prefill_tps, decode_s, decode_tps, inter_token_s}]
        roofline              decode_bytes_per_s (read_bytes_per_token x median decode_tps),
                              fraction (of bandwidth.bytes_per_s), ceiling_tps (bandwidth /
                              read_bytes_per_token)
        quality               null, or {tokens, perplexity, ref_perplexity, ppl_ratio, kld, top1}
        ratios                to the baseline: weight_bytes, peak_bytes, ttft_s, prefill_tps,
                              decode_tps, decode_bytes_per_s (null when a side is missing)
    }}
    quality           reference (scheme), window, tokens, skipped (null or the reason)
    kv_cache_comparison   null, or {scheme, prompt_tokens, steps: [{step, seq_len, no_cache_s,
                          cache_s, speedup}]}
    notes             [str] how the figures were measured
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from localllm.bench.machine import busy_warning, describe_machine, machine_info, measure_bandwidth
from localllm.bench.quality import measure_quality
from localllm.bench.runs import MemoryProbe, measure_scheme
from localllm.bench.settings import (
    MEMORY_BOUND_FACTOR,
    MEMORY_BOUND_SLACK,
    QUALITY_WINDOW,
    Figures,
    Log,
    Settings,
    check_settings,
    check_text,
    log_stderr,
    parse_schemes,
    read_text,
)
from localllm.format import human_size
from localllm.threads import set_threads

SCHEMA = "localllm.bench/5"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def add_derived(schemes: dict[str, Figures], baseline: str, bandwidth: dict[str, Any]) -> None:
    """Roofline and ratios to the baseline column, from the figures already measured."""
    bw = bandwidth["bytes_per_s"]
    for f in schemes.values():
        dbps = f["read_bytes_per_token"] * f["decode_tps"]["median"]
        f["roofline"] = {"decode_bytes_per_s": dbps, "fraction": dbps / bw, "ceiling_tps": bw / f["read_bytes_per_token"]}
    b = schemes[baseline]
    for f in schemes.values():
        f["ratios"] = {
            "weight_bytes": _ratio(f["weight_bytes"], b["weight_bytes"]),
            "peak_bytes": _ratio(f["memory"]["peak_bytes"], b["memory"]["peak_bytes"]),
            "ttft_s": _ratio(f["ttft_s"]["median"], b["ttft_s"]["median"]),
            "prefill_tps": _ratio(f["prefill_tps"]["median"], b["prefill_tps"]["median"]),
            "decode_tps": _ratio(f["decode_tps"]["median"], b["decode_tps"]["median"]),
            "decode_bytes_per_s": _ratio(f["roofline"]["decode_bytes_per_s"], b["roofline"]["decode_bytes_per_s"]),
        }


def run_bench(
    load: Callable[[str], Any],
    model_name: str,
    prompt_ids: Sequence[int],
    quality_ids: Sequence[int] | None,
    s: Settings,
    text_source: str,
    text_tokens: int,
    quality_skipped: str | None = None,
    log: Log = log_stderr,
    probe: MemoryProbe | None = None,
) -> dict[str, Any]:
    """Measure every scheme of ``s`` with ``load(scheme) -> LoadedModel``; the JSON-ready result.
    ``probe(scheme)``: the scheme's memory figures from a process of its own (else metered in this one).

    Shared by ``localllm bench`` (checkpoints) and ``scripts/bench_gpu.py`` (random weights, no quality).
    """
    check_settings(s)
    machine = machine_info(s.device)
    log(describe_machine(machine))
    busy = busy_warning(machine)
    if busy:
        log(f"warning: {busy}")
    log(f"bandwidth: timing a large tensor's read and copy on {s.device}")
    bandwidth = measure_bandwidth(s.device)
    log(f"bandwidth: read {human_size(bandwidth['read_bytes_per_s'])}/s, copy {human_size(bandwidth['copy_bytes_per_s'])}/s")
    schemes: dict[str, Figures] = {}
    kv = None
    for i, name in enumerate(s.schemes):
        schemes[name], got = measure_scheme(load, name, prompt_ids, s, log, kv_compare=s.kv_compare and i == 0,
                                            probe=probe)
        kv = kv or got
    if s.quality and quality_ids is not None and quality_skipped is None:
        qualities = measure_quality(load, s.schemes, s.baseline, quality_ids, s.device, log)
    else:
        qualities = {}
        quality_skipped = quality_skipped or "--no-quality"
    for name, f in schemes.items():
        f["quality"] = qualities.get(name)
    predicted = next(iter(qualities.values()))["tokens"] if qualities else None  # positions scored
    add_derived(schemes, s.baseline, bandwidth)
    mem_method = next(iter(schemes.values()))["memory"]["method"]
    notes = [
        f"median (min, max) of {s.runs} runs after {s.warmup} warm-up; prompt = the first {len(prompt_ids)} tokens "
        f"of {text_source}; {s.gen_tokens} tokens generated greedily, end-of-sequence ignored",
        "TTFT = prefill + first token; prefill tok/s = prompt tokens / TTFT; decode tok/s = (generated - 1) / "
        "time from the first token to the last",
        f"memory: {mem_method}",
        f"bandwidth: {bandwidth['method']}",
        f"mem/(w+kv) = peak memory growth / (weight bytes + KV cache of ctx {s.context}); ok when the peak is at "
        f"most {MEMORY_BOUND_FACTOR} x (weights + KV cache) + {human_size(MEMORY_BOUND_SLACK)}",
        "decode bandwidth = weight bytes read per token x decode tok/s, where a decode step is taken to read "
        "every weight once (an untied embedding table: one row) and the KV cache reads are left out",
        ("quality: perplexity, mean KL divergence and top-1 agreement against " + s.baseline + " over "
         + f"{predicted} predicted positions of {text_source}, in windows of {QUALITY_WINDOW}")
        if quality_skipped is None else f"quality: skipped ({quality_skipped})",
        *([f"decode step compiled before any run (not timed): {', '.join(sorted(s.step_kinds))}"]
          if s.compile else []),
        *s.notes,
        *([f"warning: {busy}"] if busy else []),
    ]
    return {
        "schema": SCHEMA,
        "model": model_name,
        "device": str(s.device),
        "settings": {
            "schemes": list(s.schemes), "baseline": s.baseline, "prompt_tokens": len(prompt_ids),
            "gen_tokens": s.gen_tokens, "ctx": s.context, "runs": s.runs, "warmup_runs": s.warmup,
            "threads": torch.get_num_threads(), "text": text_source, "text_tokens": text_tokens,
            "quality": quality_skipped is None, "kv_compare": s.kv_compare, "compile": s.compile,
            "step_kinds": sorted(s.step_kinds),
        },
        "machine": machine,
        "bandwidth": bandwidth,
        "schemes": schemes,
        "quality": {"reference": s.baseline, "window": QUALITY_WINDOW,
                    "tokens": predicted,
                    "skipped": quality_skipped},
        "kv_cache_comparison": kv,
        "notes": notes,
    }


def bench_checkpoint(
    ref: str,
    schemes: str | None = None,
    device: str = "auto",
    prompt_tokens: int = 512,
    gen_tokens: int = 128,
    ctx: int | None = None,
    runs: int = 5,
    threads: int | None = None,
    text: str | Path | None = None,
    kv_compare: bool = False,
    quality: bool = True,
    quant_head: str | bool | None = None,
    compile: bool = False,
    log: Log = log_stderr,
    kv_dtype: str = "16bit",
    cpu_moe: bool = False,
    n_cpu_moe: int | None = None,
    gpu_layers: int | None = None,
) -> dict[str, Any]:
    """``localllm bench``: a model folder, .gguf file or stored name, in each scheme of ``schemes``.

    ``quant_head``: the output head's scheme for the quantized schemes (None: as ``run`` chooses,
    False: 16-bit); float schemes keep a float head. ``compile``: time the compiled decode step.
    ``kv_dtype``: the generators' KV cache ("16bit" or "int8"). ``cpu_moe``, ``n_cpu_moe``,
    ``gpu_layers``: where each scheme's parts live on a GPU (:class:`loaders.spec.LoadSpec`'s fields).
    """
    from localllm.bench.memprobe import probe_memory
    from localllm.loaders.load import load_model, load_tokenizer, open_checkpoint, resolve_device
    from localllm.loaders.spec import LoadSpec
    from localllm.quant.formats import QUANT_SCHEMES

    dev = resolve_device(device)  # fails at once on --device cuda without a GPU
    s = Settings(parse_schemes(schemes, dev), dev, prompt_tokens, gen_tokens, ctx, runs, quality, kv_compare,
                 compile=compile, kv_dtype=kv_dtype)
    if kv_dtype != "16bit":
        s.notes.append(f"KV cache: {kv_dtype}")
    if quant_head is not None:
        s.notes.append(f"output head of the quantized schemes: {quant_head or '16-bit'}")
    check_settings(s)
    set_threads(threads)
    source, body = read_text(text)
    ckpt = open_checkpoint(ref)
    ids = load_tokenizer(ckpt).encode(body)
    check_text(ids, prompt_tokens, source)
    if s.context > ckpt.config.max_seq_len:
        log(f"warning: a context of {s.context} tokens is beyond the {ckpt.config.max_seq_len} the model was trained on")

    def load(name: str) -> Any:
        head = quant_head if name in QUANT_SCHEMES else None
        return load_model(LoadSpec(ref, str(dev), quant=name, quantize_head=head, kv_dtype=kv_dtype,
                                   cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, gpu_layers=gpu_layers))

    probe = None
    if dev.type == "cpu":  # each scheme's memory in a fresh process: figures that do not depend on the order

        def probe(name: str) -> dict[str, Any]:
            head = quant_head if name in QUANT_SCHEMES else None
            return probe_memory(ref, name, prompt_tokens, gen_tokens, s.context, str(dev), head, threads, kv_dtype)

    return run_bench(load, ckpt.describe(), ids[:prompt_tokens], ids, s, source, len(ids), log=log, probe=probe)
