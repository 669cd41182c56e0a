"""One scheme's column: load it, time ``runs`` generations after a warm-up, meter its memory, and
(optionally) compare decode with and without the KV cache."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from localllm.bench.meters import memory_meter, release_memory
from localllm.bench.settings import (
    KV_PROMPT_TOKENS,
    KV_REPORT_STEPS,
    MEMORY_BOUND_FACTOR,
    MEMORY_BOUND_SLACK,
    Figures,
    Log,
    Settings,
)
from localllm.format import human_size
from localllm.report import placement_lines


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed_runs(model: Any, prompt_ids: Sequence[int], s: Settings, log: Log, name: str,
               step: dict[str, str] | None = None) -> list[dict[str, float]]:
    """``s.warmup`` untimed then ``s.runs`` timed generations through the batch engine (one sequence,
    as ``run``): full prefill (no prefix cache), greedy, EOS ignored, one token per step (no speculative
    decoding: these rows measure the weights' decode step, which the bandwidth figures divide; the
    serving workloads measure speculation). ``step`` receives how the decode steps ran
    (:func:`decode_step`)."""
    from localllm.runtime.engine import sequence_engine
    from localllm.runtime.sampling import SamplingParams

    engine = sequence_engine(model, s.context, compile=s.compile, kv_dtype=s.kv_dtype, prefix_cache=False,
                             speculate=False)
    greedy = SamplingParams(temperature=0)
    runs = []
    for i in range(s.warmup + s.runs):
        handle = engine.submit(list(prompt_ids), greedy, max_tokens=s.gen_tokens)
        n = len(handle.result())
        st = handle.stats
        if n != s.gen_tokens:
            raise RuntimeError(f"{name}: generated {n} tokens, expected {s.gen_tokens} ({st.stop_reason})")
        if i < s.warmup:
            continue
        runs.append({
            "ttft_s": st.ttft_s,
            "prefill_tps": st.prompt_tps,
            "decode_s": st.decode_s,
            "decode_tps": st.decode_tps,
            "inter_token_s": statistics.fmean(st.token_latencies_s),
        })
        log(f"  {name} run {len(runs)}/{s.runs}: TTFT {st.ttft_s * 1e3:.1f} ms, decode {st.decode_tps:.1f} tok/s")
    if s.compile:  # how the step really ran (a failed build runs eagerly, saying why)
        s.step_kinds.add("aot" if engine.compiled else "cuda-graphs" if engine.graphs is not None else "eager")
    if step is not None:
        step.update(decode_step(engine, s.compile))
    return runs


def decode_step(engine: Any, compile: bool) -> dict[str, str]:
    """How a scheme's decode steps ran, so that a slow path shows in the table: ``kind`` (compiled,
    cuda-graphs or eager) and, for eager, ``why`` (the compiled step's own reason: a model it cannot
    run, a failed build; or that ``--compile`` was not given)."""
    if engine.compiled:
        return {"kind": "compiled", "why": ""}
    if engine.graphs is not None:
        return {"kind": "cuda-graphs", "why": ""}
    why = engine.compile_note if compile else "--compile not given"
    return {"kind": "eager", "why": (why or "").removeprefix("decode steps run eagerly: ")}


def decode_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every weight once, except an untied embedding table,
    of which a step reads one row (a tied one is read whole as the output head)."""
    from localllm.loaders.load import weight_bytes

    total = weight_bytes(model)
    embed = getattr(model.embed, "weight", None)  # None: the embedding reads the head's int8 table
    if embed is None or getattr(model.output, "weight", None) is embed:  # type: ignore[union-attr]
        return total
    return total - embed.numel() * embed.element_size() + embed.shape[1] * embed.element_size()


def kv_cache_figures(config: Any, dtype: torch.dtype, ctx: int, kv_dtype: str = "16bit") -> dict[str, Any]:
    """Bytes of the KV cache per token (an int8 cache: codes and their scales) and at ``ctx``."""
    from localllm.runtime.kv_pool import cache_bytes

    per_token = cache_bytes(config, 1, dtype, kv_dtype)
    return {"kv_dtype": kv_dtype, "bytes_per_token": per_token, "ctx": ctx, "ctx_bytes": per_token * ctx,
            "max_seq_len": config.max_seq_len, "max_seq_len_bytes": per_token * config.max_seq_len}


def memory_figures(memory: dict[str, Any], weight_bytes: int, kv_bytes: int) -> dict[str, Any]:
    """``memory`` with the peak's ratio to weights + KV cache, and whether it is within the target
    (at most MEMORY_BOUND_FACTOR x (weights + KV cache) + MEMORY_BOUND_SLACK)."""
    wkv = weight_bytes + kv_bytes
    bound = MEMORY_BOUND_FACTOR * wkv + MEMORY_BOUND_SLACK
    return {**memory, "weights_kv_bytes": wkv, "ratio_to_weights_kv": memory["peak_bytes"] / wkv,
            "bound_bytes": int(bound), "within_bound": memory["peak_bytes"] <= bound}


def kv_comparison(model: Any, prompt_ids: Sequence[int], scheme: str, steps: int = max(KV_REPORT_STEPS)
                  ) -> dict[str, Any]:
    """The seeds' experiment on this model: per-step decode latency with and without the KV cache.

    Each reported step is the median of the steps within 2 of it, so that one step that lost its CPU
    to another process does not stand for the trend.
    """
    from localllm.runtime.kvcompare import decode_latencies

    prompt = torch.tensor([list(prompt_ids[:KV_PROMPT_TOKENS])], device=model.device)
    decode_latencies(model, prompt, 3, use_cache=True)  # warm-up
    cached = decode_latencies(model, prompt, steps, use_cache=True)
    uncached = decode_latencies(model, prompt, steps, use_cache=False)
    T = prompt.shape[1]

    def at(times: list[float], step: int) -> float:
        return statistics.median(times[max(0, step - 3): step + 2])  # steps step-2 .. step+2 (1-based)

    rows = [{"step": k, "seq_len": T + k, "no_cache_s": at(uncached, k), "cache_s": at(cached, k),
             "speedup": at(uncached, k) / at(cached, k)} for k in KV_REPORT_STEPS if k <= steps]
    return {"scheme": scheme, "prompt_tokens": T, "steps": rows}


MemoryProbe = Callable[[str], dict[str, Any]]


def measure_scheme(load: Callable[[str], Any], name: str, prompt_ids: Sequence[int], s: Settings, log: Log,
                   kv_compare: bool = False, probe: MemoryProbe | None = None) -> tuple[Figures, dict[str, Any] | None]:
    """Load ``name`` and time it; the figures of one column (quality, roofline and ratios come later).

    ``probe``: measures the scheme's memory in a process of its own (:mod:`localllm.bench.memprobe`),
    whose figures replace the in-process meter's (which depend on the schemes measured before)."""
    if probe is not None:
        log(f"{name}: memory, in a fresh process")
        probed = probe(name)
    release_memory(s.device)
    meter = memory_meter(s.device)
    meter.start()
    lm = load(name)
    after_load = meter.now()
    log(f"{name}: {lm.scheme_label}, {human_size(lm.weight_bytes)} of weights, loaded in {lm.load_s:.2f} s"
        + (f"; kernels: {', '.join(f'{k} x{n}' for k, n in sorted(lm.kernels.items()))}" if lm.kernels else ""))
    placement = placement_lines(lm)  # on a GPU: where its experts and blocks live, as run --verbose says
    for line in placement:
        log(f"  {name}: placement: {line}")
    step: dict[str, str] = {}
    runs = timed_runs(lm.model, prompt_ids, s, log, name, step)
    log(f"  {name}: decode step {step['kind']}" + (f" ({step['why']})" if step["why"] else ""))
    kv_cache = kv_cache_figures(lm.config, lm.model.dtype, s.context, s.kv_dtype)
    memory = memory_figures({**meter.stop(), "after_load_bytes": after_load, "process": "shared",
                             "library_bytes": {}}, lm.weight_bytes, kv_cache["ctx_bytes"])
    if probe is not None:
        memory = probed
    figures: Figures = {
        "label": lm.scheme_label,
        "activation_dtype": str(lm.dtype).removeprefix("torch."),
        "kernels": dict(sorted(lm.kernels.items())),
        "decode_step": step,
        "placement": placement or None,
        "weight_bytes": lm.weight_bytes,
        "read_bytes_per_token": decode_read_bytes(lm.model),
        "load_s": lm.load_s,
        "memory": memory,
        "kv_cache": kv_cache,
        **{key: spread([r[key] for r in runs]) for key in ("ttft_s", "prefill_tps", "decode_tps", "inter_token_s")},
        "runs": runs,
    }
    kv = None
    if kv_compare:  # after the memory figures: its own caches must not count
        log(f"  {name}: decode with and without the KV cache ({max(KV_REPORT_STEPS)} steps each)")
        kv = kv_comparison(lm.model, prompt_ids, name)
    del lm
    release_memory(s.device)
    return figures, kv
