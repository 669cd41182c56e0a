"""Memory, speed and quality of weight schemes, measured side by side in one process run.

This is the instrument later performance work is judged by, so every figure says how it was
measured and the machine's own memory bandwidth is measured in the same run (the roofline of a
decode step is bandwidth / bytes read per token, and both come from here).

For each scheme, one at a time (the previous scheme's model is freed first):

* load it (``load_s``: the whole :func:`loaders.load.load_model` call, or building the random model);
* one warm-up run, then ``runs`` timed runs: prefill of the prompt (the first ``prompt_tokens``
  tokens of the evaluation text) and ``gen_tokens`` greedy tokens with end-of-sequence ignored;
* memory while loading and running: on CUDA the growth of ``torch.cuda.max_memory_allocated`` (and
  ``max_memory_reserved``) over what was allocated before the load, the peak statistics reset per
  scheme; on the CPU the growth of the process's resident set (VmRSS) over its size before the
  load, sampled every few milliseconds by a background thread (VmHWM cannot serve: it is
  process-wide and only grows, so after the first scheme it says nothing about the next);
* with ``kv_compare`` (``--no-cache``), for the first scheme only (the cache's effect comes from
  the sequence length, not from the weight format), decode with and without the KV cache
  (:func:`runtime.kvcompare.decode_latencies`) after a 16-token prompt, the per-step latency at
  steps 1, 10, 20, 50, 100 (each the median of the steps within 2 of it).

Quality runs after the speed runs, against the highest-precision scheme of the run
(fp32 > fp16 > bf16 > int8 > int4 > nf4; fp16 before bf16: 3 more mantissa bits). The reference
model stays loaded while each other scheme is loaded next to it, compared over the whole text
(:func:`runtime.quality.compare`) and freed, so at most two models are in memory at once.

JSON schema (``SCHEMA`` = "localllm.bench/2"; keys are always present, a figure that was not
measured is ``null``; durations in seconds, sizes in bytes, rates per second)::

    schema            "localllm.bench/2"
    model             what was benchmarked (path, stored name, or "random <shape>")
    device            "cpu" | "cuda" | "cuda:N"
    settings          schemes [str], baseline str, prompt_tokens, gen_tokens, ctx, runs,
                      warmup_runs, threads, text (path or "built-in eval text"), text_tokens,
                      quality (bool), kv_compare (bool), compile (bool),
                      step_kinds (how compiled steps ran: "aot", "torch.compile", "eager")
    machine           cpu_model, cpu_count, threads, gpu_name, gpu_capability, gpu_memory_bytes,
                      torch_version, localllm_version, python_version, platform,
                      load_average ([1, 5, 15] minutes, at the start; a busy machine is warned of)
    bandwidth         method, tensor_bytes, repeats, read_bytes_per_s (t.sum() of the tensor),
                      copy_bytes_per_s (a copy into a second tensor, read + write counted),
                      bytes_per_s (the larger: the roofline's denominator)
    schemes           {scheme: {
        label, activation_dtype, kernels {kernel: layers},
        weight_bytes          parameters and buffers in memory (a tied tensor once)
        read_bytes_per_token  weight bytes a decode step reads: all weights, once each, except an
                              untied embedding table of which decode reads one row (KV cache reads
                              not counted)
        load_s
        memory                method, peak_bytes, peak_reserved_bytes (CUDA; null on CPU),
                              after_load_bytes
        kv_cache              bytes_per_token, ctx, ctx_bytes, max_seq_len, max_seq_len_bytes
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

import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from localllm import __version__
from localllm.errors import LocalLLMError
from localllm.format import human_size

SCHEMA = "localllm.bench/2"
#: Highest precision first: the first of these in a run is the quality reference and the baseline column.
PRECISION_ORDER = ("fp32", "fp16", "bf16", "int8", "int4", "nf4")
DEFAULT_SCHEMES = {"cpu": ("fp32", "bf16", "int8", "int4", "nf4"), "cuda": ("fp16", "bf16", "int8", "int4", "nf4")}
KV_REPORT_STEPS = (1, 10, 20, 50, 100)  # as scripts/kv_cache_experiment.py reports them
KV_PROMPT_TOKENS = 16  # short, so that 100 uncached steps show the growth with length (and stay quick)
QUALITY_WINDOW = 512
WARMUP_RUNS = 1
EVAL_TEXT = Path(__file__).resolve().parent / "data" / "eval.txt"

Log = Callable[[str], None]
Figures = dict[str, Any]


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ settings
@dataclass
class Settings:
    """What to measure; validated by :func:`check_settings` before anything is loaded."""

    schemes: list[str]
    device: torch.device
    prompt_tokens: int = 512
    gen_tokens: int = 128
    ctx: int | None = None  # None: prompt_tokens + gen_tokens
    runs: int = 5
    quality: bool = True
    kv_compare: bool = False
    compile: bool = False  # torch.compile the decode step (compiled before the first run)
    warmup: int = WARMUP_RUNS
    notes: list[str] = field(default_factory=list)
    #: How the compiled decode steps actually ran ("aot", "torch.compile", "eager"), filled by the runs.
    step_kinds: set[str] = field(default_factory=set)

    @property
    def context(self) -> int:
        return self.ctx if self.ctx is not None else self.prompt_tokens + self.gen_tokens

    @property
    def baseline(self) -> str:
        return baseline_scheme(self.schemes)


def parse_schemes(text: str | None, device: torch.device) -> list[str]:
    """``"fp32,int4"`` -> ["fp32", "int4"] (order kept, duplicates dropped); None -> the device's default."""
    if text is None:
        return list(DEFAULT_SCHEMES["cuda" if device.type == "cuda" else "cpu"])
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not names:
        raise LocalLLMError("--quant is empty", f"give a comma-separated list of {', '.join(PRECISION_ORDER)}")
    for name in names:
        if name not in PRECISION_ORDER:
            raise LocalLLMError(f"unknown scheme '{name}' in --quant",
                                f"use a comma-separated list of {', '.join(PRECISION_ORDER)}")
    return names


def baseline_scheme(schemes: Sequence[str]) -> str:
    """The highest-precision scheme of the run: the quality reference and the ratios' denominator."""
    return min(schemes, key=PRECISION_ORDER.index)


def check_settings(s: Settings) -> None:
    """Refuse settings that cannot give meaningful figures, with the fix, before any loading."""
    if s.prompt_tokens < 1:
        raise LocalLLMError(f"--prompt-tokens {s.prompt_tokens} is not positive", "give 1 or more (default 512)")
    if s.gen_tokens < 2:
        raise LocalLLMError(f"--gen-tokens {s.gen_tokens} is too few to time decoding",
                            "give 2 or more (the first token comes from prefill)")
    if s.runs < 1:
        raise LocalLLMError(f"--runs {s.runs} is not positive", "give 1 or more (default 5)")
    need = s.prompt_tokens + s.gen_tokens
    if s.ctx is not None and s.ctx < need:
        raise LocalLLMError(
            f"--ctx {s.ctx} is shorter than the {s.prompt_tokens} prompt + {s.gen_tokens} generated tokens",
            f"give --ctx {need} or more, or fewer --prompt-tokens/--gen-tokens")


def check_text(ids: Sequence[int], prompt_tokens: int, source: str) -> None:
    if len(ids) < max(prompt_tokens, 2):
        raise LocalLLMError(
            f"{source} is {len(ids)} tokens long, shorter than the {prompt_tokens} the prompt needs",
            "give a longer --text or fewer --prompt-tokens")


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise LocalLLMError(f"--threads {threads} is not positive", "give 1 or more")
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ machine
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict[str, Any]:
    gpu = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if gpu else None
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu_name": props.name if props else None,
        "gpu_capability": f"{props.major}.{props.minor}" if props else None,
        "gpu_memory_bytes": props.total_memory if props else None,
        "torch_version": torch.__version__,
        "localllm_version": __version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def busy_warning(m: dict[str, Any]) -> str | None:
    """A warning when other work competes for the CPUs the bench uses (timings then swing widely:
    a CPU thread that loses its core stalls the others at every parallel region)."""
    load = m["load_average"]
    spare = (m["cpu_count"] or 1) - m["threads"]
    if load is None or load[0] <= spare + 0.5:
        return None
    return (f"the machine was busy when the bench started (load average {load[0]:.1f} over the last minute, "
            f"{m['cpu_count']} CPUs, {m['threads']} threads used here): timings are unreliable; "
            "compare the min-max spreads, or rerun on an idle machine")


def describe_machine(m: dict[str, Any]) -> str:
    gpu = f"; GPU {m['gpu_name']} (sm {m['gpu_capability']}, {human_size(m['gpu_memory_bytes'])})" if m["gpu_name"] else ""
    return (f"machine: {m['cpu_model']}, {m['threads']} torch threads of {m['cpu_count']} CPUs{gpu}; "
            f"torch {m['torch_version']}, localllm {m['localllm_version']}, Python {m['python_version']}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_op(op: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``op`` (CUDA: timed with events, so launch latency does not count)."""
    for _ in range(warmup):
        op()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 9) -> dict[str, Any]:
    """The machine's memory bandwidth as this process sees it (same threads as the decode).

    A tensor far larger than any cache (512 MiB on the CPU, 2 GiB on a GPU) is read (``t.sum()``)
    and copied into another (read + write counted); the median of ``repeats`` after two warm-ups.
    """
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 512 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # written, so its pages are resident
    dst = torch.zeros_like(src)
    read_s = _time_op(lambda: src.sum(), device, repeats)
    copy_s = _time_op(lambda: dst.copy_(src), device, repeats)
    del src, dst
    release_memory(device)
    read_bps, copy_bps = nbytes / read_s, 2 * nbytes / copy_s
    return {
        "method": f"median of {repeats}: t.sum() of a {nbytes >> 20} MiB fp32 tensor (read), and a copy into "
                  "another (read + write counted); the larger is the machine's bandwidth",
        "tensor_bytes": nbytes,
        "repeats": repeats,
        "read_bytes_per_s": read_bps,
        "copy_bytes_per_s": copy_bps,
        "bytes_per_s": max(read_bps, copy_bps),
    }


# ------------------------------------------------------------------------------ memory
def release_memory(device: torch.device) -> None:
    """Return freed memory to the system, so the next scheme's baseline does not hide its growth."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed heap pages otherwise
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """The resident set size now (VmRSS of /proc/self/status; psutil where there is no /proc)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss


class RSSMeter:
    """Peak growth of the resident set over its size at :meth:`start`, sampled in a background thread."""

    method = "cpu: peak growth of the process's resident set (VmRSS) over its size before the load, " \
             "sampled every 10 ms during load and runs"

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.baseline = self.peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())

    def now(self) -> int:
        current = rss_bytes()
        self.peak = max(self.peak, current)
        return current - self.baseline

    def stop(self) -> dict[str, Any]:
        self.now()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return {"method": self.method, "peak_bytes": self.peak - self.baseline, "peak_reserved_bytes": None}


class CudaMeter:
    """Peak of ``max_memory_allocated`` (and reserved) over what was allocated before the load."""

    method = "cuda: torch.cuda.max_memory_allocated (and max_memory_reserved) during load and runs, " \
             "minus what was allocated before the load; peak statistics reset per scheme"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.allocated = self.reserved = 0

    def start(self) -> None:
        sync(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.allocated = torch.cuda.memory_allocated(self.device)
        self.reserved = torch.cuda.memory_reserved(self.device)

    def now(self) -> int:
        sync(self.device)
        return torch.cuda.memory_allocated(self.device) - self.allocated

    def stop(self) -> dict[str, Any]:
        sync(self.device)
        return {"method": self.method,
                "peak_bytes": torch.cuda.max_memory_allocated(self.device) - self.allocated,
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device) - self.reserved}


def memory_meter(device: torch.device) -> RSSMeter | CudaMeter:
    return CudaMeter(device) if device.type == "cuda" else RSSMeter()


# ------------------------------------------------------------------------------ one scheme
def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed_runs(model: Any, prompt_ids: Sequence[int], s: Settings, log: Log, name: str) -> list[dict[str, float]]:
    """``s.warmup`` untimed then ``s.runs`` timed generations: full prefill, greedy, EOS ignored."""
    from localllm.runtime.generate import Generator
    from localllm.runtime.sampling import SamplingParams

    gen = Generator(model, s.context, compile=s.compile)
    greedy = SamplingParams(temperature=0)
    runs = []
    for i in range(s.warmup + s.runs):
        gen.reset()  # nothing reused from the previous run: the whole prompt is prefilled
        n = sum(1 for _ in gen.generate(list(prompt_ids), greedy, max_tokens=s.gen_tokens, stop_ids=()))
        st = gen.stats
        if n != s.gen_tokens:
            raise RuntimeError(f"{name}: generated {n} tokens, expected {s.gen_tokens} ({st.stop_reason})")
        if i < s.warmup:
            continue
        runs.append({
            "ttft_s": st.ttft_s,
            "prefill_tps": st.prompt_tokens / st.prompt_s,
            "decode_s": st.decode_s,
            "decode_tps": st.decode_tps,
            "inter_token_s": statistics.fmean(st.token_latencies_s),
        })
        log(f"  {name} run {len(runs)}/{s.runs}: TTFT {st.ttft_s * 1e3:.1f} ms, decode {st.decode_tps:.1f} tok/s")
    if s.compile:  # how the step really ran (a failure on the way falls back, with a warning)
        s.step_kinds.add(gen.step_kind)
    return runs


def decode_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every weight once, except an untied embedding table,
    of which a step reads one row (a tied one is read whole as the output head)."""
    from localllm.loaders.load import weight_bytes

    total = weight_bytes(model)
    embed = getattr(model.embed, "weight", None)  # None: the embedding reads the head's int8 table
    if embed is None or getattr(model.output, "weight", None) is embed:  # type: ignore[union-attr]
        return total
    return total - embed.numel() * embed.element_size() + embed.shape[1] * embed.element_size()


def kv_cache_figures(config: Any, dtype: torch.dtype, ctx: int) -> dict[str, int]:
    per_token = config.kv_cache_bytes(1, torch.empty(0, dtype=dtype).element_size())
    return {"bytes_per_token": per_token, "ctx": ctx, "ctx_bytes": per_token * ctx,
            "max_seq_len": config.max_seq_len, "max_seq_len_bytes": per_token * config.max_seq_len}


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


def measure_scheme(load: Callable[[str], Any], name: str, prompt_ids: Sequence[int], s: Settings, log: Log,
                   kv_compare: bool = False) -> tuple[Figures, dict[str, Any] | None]:
    """Load ``name`` and time it; the figures of one column (quality, roofline and ratios come later)."""
    release_memory(s.device)
    meter = memory_meter(s.device)
    meter.start()
    lm = load(name)
    after_load = meter.now()
    log(f"{name}: {lm.scheme_label}, {human_size(lm.weight_bytes)} of weights, loaded in {lm.load_s:.2f} s"
        + (f"; kernels: {', '.join(f'{k} x{n}' for k, n in sorted(lm.kernels.items()))}" if lm.kernels else ""))
    runs = timed_runs(lm.model, prompt_ids, s, log, name)
    memory = {**meter.stop(), "after_load_bytes": after_load}
    figures: Figures = {
        "label": lm.scheme_label,
        "activation_dtype": str(lm.dtype).removeprefix("torch."),
        "kernels": dict(sorted(lm.kernels.items())),
        "weight_bytes": lm.weight_bytes,
        "read_bytes_per_token": decode_read_bytes(lm.model),
        "load_s": lm.load_s,
        "memory": memory,
        "kv_cache": kv_cache_figures(lm.config, lm.model.dtype, s.context),
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


# ------------------------------------------------------------------------------ quality
def measure_quality(load: Callable[[str], Any], schemes: Sequence[str], baseline: str, ids: Sequence[int],
                    device: torch.device, log: Log, window: int = QUALITY_WINDOW) -> dict[str, dict[str, float]]:
    """Each scheme against ``baseline`` over ``ids``, with at most the reference and one scheme loaded."""
    from localllm.runtime.quality import Quality, compare

    release_memory(device)
    ref = load(baseline).model
    out: dict[str, Quality] = {}
    for name in schemes:
        if name == baseline:
            continue
        log(f"quality: {name} against {baseline} over {len(ids)} tokens")
        model = load(name).model
        out[name] = compare(ref, {name: model}, list(ids), window)[name]
        del model
        release_memory(device)
    if out:  # the reference against itself is exact by definition: ratio 1, KLD 0, top-1 1
        any_q = next(iter(out.values()))
        out[baseline] = Quality(any_q.tokens, any_q.ref_perplexity, any_q.ref_perplexity, 0.0, 1.0)
    else:
        out[baseline] = compare(ref, {baseline: ref}, list(ids), window)[baseline]
    del ref
    return {name: out[name].to_dict() for name in schemes}


# ------------------------------------------------------------------------------ the whole run
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
) -> dict[str, Any]:
    """Measure every scheme of ``s`` with ``load(scheme) -> LoadedModel``; the JSON-ready result.

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
        schemes[name], got = measure_scheme(load, name, prompt_ids, s, log, kv_compare=s.kv_compare and i == 0)
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
) -> dict[str, Any]:
    """``localllm bench``: a model folder, .gguf file or stored name, in each scheme of ``schemes``.

    ``quant_head``: the output head's scheme for the quantized schemes (None: as ``run`` chooses,
    False: 16-bit); float schemes keep a float head. ``compile``: time the compiled decode step.
    """
    from localllm.loaders.load import load_model, load_tokenizer, open_checkpoint, resolve_device
    from localllm.quant.formats import QUANT_SCHEMES

    dev = resolve_device(device)  # fails at once on --device cuda without a GPU
    s = Settings(parse_schemes(schemes, dev), dev, prompt_tokens, gen_tokens, ctx, runs, quality, kv_compare,
                 compile=compile)
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
        return load_model(ref, device=str(dev), quant=name, quantize_head=head)

    return run_bench(load, ckpt.describe(), ids[:prompt_tokens], ids, s, source, len(ids), log=log)


def read_text(path: str | Path | None) -> tuple[str, str]:
    """(what to call it, the text): the user's file, or the evaluation text shipped with localllm."""
    if path is None:
        return "the built-in eval text", EVAL_TEXT.read_text(encoding="utf-8")
    try:
        return str(path), Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"cannot read --text {path}: {getattr(e, 'strerror', None) or e}",
                            "give a readable UTF-8 text file") from None


# ------------------------------------------------------------------------------ random weights
def random_model(config: Any, scheme_name: str, device: torch.device, source: str, seed: int = 0,
                 std: float = 0.02) -> Any:
    """A model of ``config``'s shape with random weights, made on ``device`` and quantized there.

    Built on meta; each tensor is created on the device and quantized one at a time, so neither a
    download nor a CPU copy nor the full float model is ever needed (a 7B fp16 model fits a 16 GB GPU
    this way; peak is the packed model plus one float layer).
    """
    from localllm.loaders.build import empty_model, load_weights
    from localllm.loaders.load import LoadedModel, resolve_dtype
    from localllm.quant.formats import FLOAT_SCHEMES, parse_scheme
    from localllm.quant.linear import prepare_model, swap_linears

    t0 = time.perf_counter()
    scheme = parse_scheme(scheme_name)
    act = FLOAT_SCHEMES[scheme.name] if scheme.is_float else resolve_dtype("auto", device, quantized=True)
    model = empty_model(config)
    quantized = set() if scheme.is_float else set(swap_linears(model, scheme))
    tensors = _random_tensors(model, quantized, scheme, device, act, seed, std)
    model = load_weights(model, tensors, device, act, source)
    used = prepare_model(model, act)
    sync(device)
    return LoadedModel(model, None, config, source, device, act, time.perf_counter() - t0,  # type: ignore[arg-type]
                       None if scheme.is_float else scheme, used)


def _random_tensors(model: torch.nn.Module, quantized: set[str], scheme: Any, device: torch.device,
                    dtype: torch.dtype, seed: int, std: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every entry of ``model``'s state dict, one tensor alive at a time."""
    from localllm.quant.formats import quantize

    g = torch.Generator(device=device).manual_seed(seed)
    done: set[str] = set()
    for name, meta in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in quantized:
            if module not in done:
                lin = model.get_submodule(module)
                w = torch.randn(lin.out_features, lin.in_features, generator=g, device=device, dtype=dtype) * std
                tensors = quantize(w, scheme)
                del w
                yield from ((f"{module}.{k}", v) for k, v in tensors.items())
                if lin.bias is not None:
                    yield f"{module}.bias", torch.zeros(lin.out_features, device=device, dtype=dtype)
                done.add(module)
            continue
        if leaf == "weight" and name.endswith("norm.weight"):
            yield name, torch.ones(meta.shape, device=device, dtype=dtype)
        elif leaf == "bias":
            yield name, torch.zeros(meta.shape, device=device, dtype=dtype)
        else:
            yield name, torch.randn(meta.shape, generator=g, device=device, dtype=dtype) * std


# ------------------------------------------------------------------------------ output
def _fmt_ms(v: float) -> str:
    return f"{v * 1e3:.1f}"


def _fmt_num(v: float) -> str:
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _cell(value: float | None, fmt: Callable[[float], str], ratio: float | None, show_ratio: bool) -> str:
    if value is None:
        return "-"
    text = fmt(value)
    return f"{text} ({ratio:.2f}x)" if show_ratio and ratio is not None else text


def table_rows(result: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(label, cells) of the table: one column per scheme, ratios to the baseline in brackets."""
    names = list(result["schemes"])
    base = result["settings"]["baseline"]
    S = result["schemes"]
    cuda = result["device"].startswith("cuda")

    def row(label: str, get: Callable[[Figures], float | None], fmt: Callable[[float], str],
            ratio: Callable[[Figures], float | None] | None = None) -> tuple[str, list[str]]:
        return label, [_cell(get(S[n]), fmt, ratio(S[n]) if ratio else None, ratio is not None and n != base)
                       for n in names]

    def span(key: str, fmt: Callable[[float], str]) -> tuple[str, list[str]]:
        return "  min-max", [f"{fmt(S[n][key]['min'])}-{fmt(S[n][key]['max'])}" for n in names]

    def q(key: str) -> Callable[[Figures], float | None]:
        return lambda f: f["quality"][key] if f["quality"] else None

    ctx = result["settings"]["ctx"]
    rows = [
        row("weights", lambda f: f["weight_bytes"], human_size, lambda f: f["ratios"]["weight_bytes"]),
        row("load s", lambda f: f["load_s"], lambda v: f"{v:.2f}"),
        row("peak memory" + (" (allocated)" if cuda else " (RSS growth)"), lambda f: f["memory"]["peak_bytes"],
            human_size, lambda f: f["ratios"]["peak_bytes"]),
    ]
    if cuda:
        rows.append(row("peak reserved", lambda f: f["memory"]["peak_reserved_bytes"], human_size))
    rows += [
        row("KV cache / token", lambda f: f["kv_cache"]["bytes_per_token"], human_size),
        row(f"KV cache @ ctx {ctx}", lambda f: f["kv_cache"]["ctx_bytes"], human_size),
        row("TTFT ms", lambda f: f["ttft_s"]["median"], _fmt_ms, lambda f: f["ratios"]["ttft_s"]),
        span("ttft_s", _fmt_ms),
        row("prefill tok/s", lambda f: f["prefill_tps"]["median"], _fmt_num, lambda f: f["ratios"]["prefill_tps"]),
        span("prefill_tps", _fmt_num),
        row("decode tok/s", lambda f: f["decode_tps"]["median"], _fmt_num, lambda f: f["ratios"]["decode_tps"]),
        span("decode_tps", _fmt_num),
        row("inter-token ms", lambda f: f["inter_token_s"]["median"], lambda v: f"{v * 1e3:.2f}"),
        row("decode bandwidth", lambda f: f["roofline"]["decode_bytes_per_s"], lambda v: f"{human_size(v)}/s"),
        row(f"  of measured {human_size(result['bandwidth']['bytes_per_s'])}/s",
            lambda f: f["roofline"]["fraction"], lambda v: f"{v:.0%}"),
        row("  roofline tok/s", lambda f: f["roofline"]["ceiling_tps"], _fmt_num),
    ]
    if result["quality"]["skipped"] is None:
        rows += [
            row("perplexity", q("perplexity"), lambda v: f"{v:.3f}"),
            row(f"  ratio to {base}", q("ppl_ratio"), lambda v: f"{v:.4f}"),
            row("mean KLD (nats)", q("kld"), lambda v: f"{v:.5f}"),
            row("top-1 agreement", q("top1"), lambda v: f"{v:.2%}"),
        ]
    return rows


def format_table(result: dict[str, Any]) -> str:
    st, m = result["settings"], result["machine"]
    where = m["gpu_name"] or m["cpu_model"]
    header = [
        f"# {result['model']} on {result['device']} ({where}, {st['threads']} threads): prompt {st['prompt_tokens']} "
        f"tokens, {st['gen_tokens']} generated, ctx {st['ctx']}; median of {st['runs']} runs; (ratio to {st['baseline']})",
    ]
    if result["quality"]["skipped"] is not None:
        header.append(f"# quality skipped: {result['quality']['skipped']}")
    rows = table_rows(result)
    names = list(result["schemes"])
    label_w = max(len(label) for label, _ in rows)
    widths = [max(len(n), *(len(cells[i]) for _, cells in rows)) for i, n in enumerate(names)]
    lines = [*header, " " * label_w + "".join(f"  {n:>{w}}" for n, w in zip(names, widths))]
    for label, cells in rows:
        lines.append(f"{label:<{label_w}}" + "".join(f"  {c:>{w}}" for c, w in zip(cells, widths)))
    kv = result["kv_cache_comparison"]
    if kv:
        lines += ["", f"# decode with and without the KV cache ({kv['scheme']}, prompt {kv['prompt_tokens']} tokens): "
                      "per-step latency (median of the steps within 2 of it)",
                  f"{'step':>6} {'seq len':>8} {'no cache ms':>12} {'KV cache ms':>12} {'speed-up':>9}"]
        for r in kv["steps"]:
            lines.append(f"{r['step']:>6} {r['seq_len']:>8} {r['no_cache_s'] * 1e3:>12.2f} {r['cache_s'] * 1e3:>12.2f}"
                         f" {r['speedup']:>8.1f}x")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    text = json.dumps(result, indent=2)
    if str(path) == "-":
        print(text)
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text + "\n")


def require_writable(*paths: str | Path | None) -> None:
    """Fail before the measurements, not after them, when an output file cannot be written."""
    for path in paths:
        if path is None or str(path) == "-":
            continue
        folder = Path(path).expanduser().absolute().parent
        existing = next(p for p in (folder, *folder.parents) if p.exists())  # mkdir -p will start here
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise LocalLLMError(f"cannot write {path}: {existing} is not a writable folder",
                                "give a path in a folder you can write to")


def require_matplotlib() -> None:
    """Fail before the measurements, not after them, when --plot cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LocalLLMError("--plot needs matplotlib, which is not installed", "pip install localllm[plot]") from None


def write_plot(result: dict[str, Any], path: str | Path) -> None:
    """Bars per scheme: memory (weights, peak), prefill and decode speed (with the roofline ceiling),
    and quality (perplexity ratio, top-1 agreement)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    S = result["schemes"]
    names = list(S)
    x = range(len(names))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    st = result["settings"]
    where = result["machine"]["gpu_name"] or result["machine"]["cpu_model"]
    fig.suptitle(f"{Path(result['model']).name} on {result['device']} ({where}, {st['threads']} threads)\n"
                 f"prompt {st['prompt_tokens']}, {st['gen_tokens']} generated, median of {st['runs']} runs",
                 fontsize=10)

    def bars(ax, series: dict[str, list[float]], ylabel: str, title: str, fmt: str = "{:.0f}",  # type: ignore[no-untyped-def]
             labels: list[str] | None = None):
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            pos = [j + (i - (len(series) - 1) / 2) * width for j in x]
            drawn = ax.bar(pos, values, width, label=label)
            ax.bar_label(drawn, labels=labels or [fmt.format(v) for v in values], fontsize=7, padding=1)
        ax.set_xticks(list(x), names)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.12)
        if len(series) > 1:
            ax.legend(fontsize=8)

    mem = "allocated" if result["device"].startswith("cuda") else "RSS growth"
    bars(axes[0][0], {"weights": [S[n]["weight_bytes"] / 1e6 for n in names],
                      f"peak ({mem})": [S[n]["memory"]["peak_bytes"] / 1e6 for n in names]}, "MB", "memory")
    bars(axes[0][1], {"prefill": [S[n]["prefill_tps"]["median"] for n in names]}, "tokens/s",
         f"prefill speed ({st['prompt_tokens']}-token prompt)")
    ax = axes[1][0]
    decode = [S[n]["decode_tps"]["median"] for n in names]
    bars(ax, {"decode": decode}, "tokens/s",
         f"decode speed (% of bandwidth); '_' = ceiling: {result['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s / bytes per token",
         labels=[f"{v:.0f} ({S[n]['roofline']['fraction']:.0%})" for v, n in zip(decode, names)])
    ax.scatter(list(x), [S[n]["roofline"]["ceiling_tps"] for n in names], marker="_", s=900, color="black", zorder=3)
    ax = axes[1][1]
    if result["quality"]["skipped"] is None:
        bars(ax, {"perplexity ratio": [S[n]["quality"]["ppl_ratio"] for n in names],
                  "top-1 agreement": [S[n]["quality"]["top1"] for n in names]},
             f"vs {st['baseline']}", f"quality against {st['baseline']}", "{:.3f}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
    else:
        ax.axis("off")
        ax.text(0.5, 0.5, f"quality skipped:\n{result['quality']['skipped']}", ha="center", va="center")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=100)
    plt.close(fig)


def report(result: dict[str, Any], json_path: str | Path | None = None, plot_path: str | Path | None = None,
           log: Log = log_stderr) -> None:
    """The table on stdout (stderr when the JSON goes to stdout), notes on stderr, files if asked."""
    table = format_table(result)
    to_stdout = str(json_path) != "-"
    print(table, file=sys.stdout if to_stdout else sys.stderr, flush=True)
    for note in result["notes"]:
        log(f"note: {note}")
    if json_path is not None:
        write_json(result, json_path)
        if to_stdout:
            log(f"wrote {json_path}")
    if plot_path is not None:
        write_plot(result, plot_path)
        log(f"wrote {plot_path}")
