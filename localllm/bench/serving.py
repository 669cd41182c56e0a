"""Serving benchmark: many concurrent streams on one :class:`runtime.batch.BatchEngine`.

``localllm bench MODEL --concurrency 1,2,4,8,16 --workload uniform|mixed|agent`` drives the engine
from this thread (submit, :meth:`BatchEngine.step`, poll every handle) and reports, per concurrency
level, the four serving figures: time to first token (p50, p99, from submission), inter-token
latency (p50, p99: the gaps between a request's consecutive tokens), total throughput (generated
tokens over the level's wall time, all streams together) and the concurrency itself, plus prompt
tokens prefilled and served by the prefix cache, the KV pool's peak use, and where the step time
went (the median decode-only step; the time of steps that carried prompt tokens).

Workloads (prompts are slices of the evaluation text at different offsets, so that no two share a
first block unless the workload means them to; end-of-sequence is ignored, every request runs to its
token budget):

* ``uniform``: ``level`` requests at once, each ``prompt_tokens`` long and generating ``gen_tokens``.
  Then, at the highest level, the same again while a long prompt (``long_prompt_tokens``) arrives
  after the streams' first tokens: the inter-token latency that chunked prefill protects.
* ``mixed``: 32 requests, half generating 8 tokens and half 256, over ``level`` slots: continuous
  batching (a finished sequence's slot is taken at the next step) against static batching (the next
  ``level`` requests start only when the whole batch is done).
* ``agent``: ``level`` agents at once, each ``AGENT_TURNS`` turns; a turn sends the agent's history
  (a ``AGENT_HISTORY``-token start, then every earlier reply and a ``AGENT_TOOL``-token tool result
  per turn) and asks for ``AGENT_REPLY`` tokens; with the prefix cache and without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from localllm.bench import speculation
from localllm.bench.settings import Log, log_stderr, read_text
from localllm.bench.workloads import (
    AGENT_HISTORY,
    AGENT_REPLY,
    AGENT_TOOL,
    AGENT_TURNS,
    MIXED_LONG,
    MIXED_REQUESTS,
    MIXED_SHORT,
    Request,
    ServingSettings,
    TextSlicer,
    agent_requests,
    drive,
    greedy,
    kv_bytes,
    make_engine,
    percentiles,
)
from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.runtime.model import Transformer
    from localllm.runtime.tokenizer import Tokenizer

__all__ = ["AGENT_REPLY", "AGENT_TURNS", "MIXED_LONG", "MIXED_REQUESTS", "MIXED_SHORT", "SCHEMA", "ServingSettings",
           "bench_serving", "check_serving", "ideal_batching", "parse_levels", "percentiles", "run_serving"]

SCHEMA = "localllm.bench.serving/1"
WORKLOADS = ("uniform", "mixed", "agent", "edit", "summarize", "open")
DEFAULT_LEVELS = {"uniform": (1, 2, 4, 8, 16), "mixed": (8,), "agent": (4,), "edit": (1, 8), "summarize": (1, 8),
                  "open": (1, 8)}


def check_serving(s: ServingSettings) -> None:
    if s.workload not in WORKLOADS:
        raise LocalLLMError(f"unknown workload '{s.workload}'", f"use one of {', '.join(WORKLOADS)}")
    if not s.levels or any(n < 1 for n in s.levels):
        raise LocalLLMError(f"--concurrency {','.join(map(str, s.levels))} needs positive levels",
                            "give a comma-separated list such as 1,2,4,8,16")
    if s.prompt_tokens < 1 or s.gen_tokens < 2:
        raise LocalLLMError("--prompt-tokens must be at least 1 and --gen-tokens at least 2",
                            "give larger values")


def parse_levels(text: str | None, workload: str) -> list[int]:
    if text is None:
        return list(DEFAULT_LEVELS.get(workload, (1,)))
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LocalLLMError(f"--concurrency '{text}' is not a list of numbers",
                            "give a comma-separated list such as 1,2,4,8,16") from None
    return list(dict.fromkeys(levels))


def warm_up(model: Transformer, s: ServingSettings, text: TextSlicer) -> None:
    """One short batched run, so that no level pays for first-call set-up (kernels, allocator)."""
    engine = make_engine(model, s, 2)
    drive(engine, [Request(text.take(min(32, s.prompt_tokens)), 4) for _ in range(2)])


def uniform(model: Transformer, s: ServingSettings, text: TextSlicer, log: Log) -> dict[str, Any]:
    rows = []
    for level in s.levels:
        engine = make_engine(model, s, level)
        figures = drive(engine, [Request(text.take(s.prompt_tokens), s.gen_tokens) for _ in range(level)])
        rows.append({"level": level, **figures})
        log(f"  uniform c={level}: {figures['throughput_tok_s']:.1f} tok/s, TTFT p50 "
            f"{figures['ttft_ms']['p50']:.0f} ms, ITL p50 {figures['itl_ms']['p50']:.1f} ms")
    # The highest level again, with a long prompt arriving once every stream has its first tokens.
    level = max(s.levels)
    engine = make_engine(model, s, level + 1)
    streams = [Request(text.take(s.prompt_tokens), s.gen_tokens) for _ in range(level)]
    long = Request(text.take(min(s.long_prompt_tokens, engine.max_seq_len - 3)), 2)  # a model's context caps it
    arrived: list[bool] = []

    def inject(step: int) -> None:
        if not arrived and all(len(r.tokens) >= 4 for r in streams):
            long.handle = engine.submit(long.prompt, greedy(), max_tokens=long.max_tokens, stop_ids=())
            arrived.append(True)

    figures = drive(engine, streams, on_step=inject)
    if long.handle is not None:
        long.handle.result()  # its prefill may outlast the streams: finished here, for its TTFT
    with_long = {"level": level, "long_prompt_tokens": len(long.prompt),
                 "long_prompt_ttft_ms": long.handle.stats.ttft_s * 1e3 if long.handle else None,
                 "itl_ms": figures["itl_ms"], "throughput_tok_s": figures["throughput_tok_s"]}
    return {"concurrency": rows, "comparison": compare_levels(rows, with_long)}


def compare_levels(rows: list[dict[str, Any]], with_long: dict[str, Any]) -> dict[str, Any]:
    """The uniform workload's ratios: 8 streams against 1, and 8 streams beside a long prompt's prefill
    against 1 alone."""
    base = next((r for r in rows if r["level"] == 1), None)
    at8 = next((r for r in rows if r["level"] == 8), None)
    return {
        # A lone stream's ITL p50 is 0 where most of its tokens come in verify steps (several a step):
        # a ratio over a zero or missing figure is None.
        "throughput_c8_over_c1": _over(at8 and at8["throughput_tok_s"], base and base["throughput_tok_s"]),
        "decode_step_c8_over_c1": _ratio(at8, base, lambda r: r["decode_step_ms"]["p50"]) if at8 and base else None,
        "throughput_c8_over_c1_if_c8_steps_cost_c1": ideal_batching(at8, base) if at8 and base else None,
        "itl_p99_c8_over_p50_c1": _over(at8 and at8["itl_ms"]["p99"], base and base["itl_ms"]["p50"]),
        "itl_p99_with_long_prompt_over_p50_c1": _over(with_long["itl_ms"]["p99"], base and base["itl_ms"]["p50"]),
        "with_long_prompt": with_long,
    }


def _over(x: float | None, y: float | None) -> float | None:
    """``x / y``; None where either is missing or ``y`` is 0."""
    return x / y if x is not None and y else None


def _ratio(a: dict[str, Any], b: dict[str, Any], get: Callable[[dict[str, Any]], float | None]) -> float | None:
    return _over(get(a), get(b))


def ideal_batching(row: dict[str, Any], base: dict[str, Any]) -> float | None:
    """``row``'s throughput over ``base``'s had each of ``row``'s decode-only steps cost what one of
    ``base``'s did, its steps with prompt tokens as measured: the most that batching decode steps can
    give while prefill counts in the wall time, as the throughput figure counts it. Both throughputs
    are over step time alone (no time between steps), so the ratio compares like with like."""
    s1 = base["decode_step_ms"]["p50"]
    base_s = base["prefill_steps_s"] + base["decode_steps_s"]
    if s1 is None or base_s <= 0:
        return None
    ideal_s = row["prefill_steps_s"] + row["decode_steps"] * s1 / 1e3
    if ideal_s <= 0 or not base["generated_tokens"]:
        return None
    return (row["generated_tokens"] / ideal_s) / (base["generated_tokens"] / base_s)


def mixed(model: Transformer, s: ServingSettings, text: TextSlicer, log: Log) -> dict[str, Any]:
    rows = []
    for level in s.levels:
        prompts = [text.take(s.prompt_tokens) for _ in range(MIXED_REQUESTS)]
        budgets = [MIXED_SHORT if i % 2 == 0 else MIXED_LONG for i in range(MIXED_REQUESTS)]
        runs = {}
        for kind in ("continuous", "static"):
            engine = make_engine(model, s, level)
            reqs = [Request(list(p), n) for p, n in zip(prompts, budgets)]
            runs[kind] = drive(engine, reqs, max_in_flight=level, static=kind == "static")
            log(f"  mixed {kind} slots={level}: {runs[kind]['throughput_tok_s']:.1f} tok/s")
        rows.append({"level": level, **runs["continuous"], "static": runs["static"],
                     "continuous_over_static": runs["continuous"]["throughput_tok_s"]
                     / runs["static"]["throughput_tok_s"],
                     # static batching's steps are mostly half-full: had continuous batching's fuller
                     # decode steps cost what static's did, the ratio would be this
                     "continuous_over_static_if_steps_cost_static": ideal_batching(runs["continuous"], runs["static"])})
    return {"concurrency": rows, "comparison": {
        "continuous_over_static": {str(r["level"]): r["continuous_over_static"] for r in rows},
        "continuous_over_static_if_steps_cost_static":
            {str(r["level"]): r["continuous_over_static_if_steps_cost_static"] for r in rows}}}


def agent(model: Transformer, s: ServingSettings, text: TextSlicer, log: Log) -> dict[str, Any]:
    longest = AGENT_HISTORY + AGENT_TURNS * AGENT_TOOL + AGENT_TURNS * AGENT_REPLY
    if longest > model.config.max_seq_len:
        raise LocalLLMError(f"the agent workload's last turn is {longest} tokens, beyond the model's context of "
                            f"{model.config.max_seq_len}", "use the uniform or mixed workload with this model")
    rows = []
    for level in s.levels:
        runs = {}
        # Unless the settings give a budget, a pool that holds every agent's whole conversation (and a
        # turn's new tokens on top): what a server for N agents is given, so that the figures measure the
        # prefix cache, not evictions from a pool too small for the workload.
        sized = s if s.kv_budget_bytes else replace(
            s, kv_budget_bytes=kv_bytes(model, level * (longest + AGENT_TOOL), s.kv_dtype))
        for kind in ("cache", "no_cache"):
            start = text.offset
            engine = make_engine(model, sized, level, prefix_cache=kind == "cache")
            runs[kind] = drive(engine, agent_requests(text, level))
            text.offset = start  # the same conversations both ways
            log(f"  agent {kind} agents={level}: prefilled {runs[kind]['prefill_tokens']} of "
                f"{runs[kind]['prompt_tokens']} prompt tokens, mean TTFT {runs[kind]['ttft_mean_ms']:.0f} ms")
        c, n = runs["cache"], runs["no_cache"]
        rows.append({"level": level, **c, "no_cache": n,
                     "prefill_fraction": c["prefill_tokens"] / n["prefill_tokens"],
                     "ttft_mean_speedup": n["ttft_mean_ms"] / c["ttft_mean_ms"]})
    return {"concurrency": rows, "comparison": {
        "prefill_fraction": {str(r["level"]): r["prefill_fraction"] for r in rows},
        "ttft_mean_speedup": {str(r["level"]): r["ttft_mean_speedup"] for r in rows}}}


RUNNERS = {"uniform": uniform, "mixed": mixed, "agent": agent}


def run_serving(model: Transformer, tokenizer: Tokenizer | None, ids: Sequence[int], s: ServingSettings,
                log: Log) -> dict[str, Any]:
    """The workload's figures (the JSON's ``concurrency`` list and ``comparison``). ``tokenizer``: the
    edit and summarize workloads' (None: the other workloads, which send token ids only)."""
    check_serving(s)
    text = TextSlicer(ids)
    warm_up(model, s, text)
    if s.workload in speculation.SPEC_WORKLOADS:
        return speculation.speculative(model, tokenizer, s, text, log)
    if s.speculate == "compare":
        if s.workload != "agent":
            raise LocalLLMError(f"--speculate compare is for the agent, edit, summarize and open workloads, not "
                                f"{s.workload}", "use --workload agent, edit, summarize or open")
        return speculation.agent_compare(model, s, text, log)
    return RUNNERS[s.workload](model, s, text, log)


def bench_serving(ref: str, s: ServingSettings, quant: str | None = None, device: str = "auto",
                  threads: int | None = None, text: str | None = None, log: Log = log_stderr,
                  kernel: str | None = None, cpu_moe: bool = False, n_cpu_moe: int | None = None,
                  gpu_layers: int | None = None) -> dict[str, Any]:
    """``localllm bench MODEL --concurrency ... --workload ...``: the JSON-ready result. ``cpu_moe``,
    ``n_cpu_moe``, ``gpu_layers``: where the model's parts live on a GPU (:class:`loaders.spec.LoadSpec`'s)."""
    from localllm.bench.machine import busy_warning, describe_machine, machine_info
    from localllm.loaders.load import load_model, resolve_device
    from localllm.loaders.spec import LoadSpec
    from localllm.report import placement_lines
    from localllm.threads import set_threads

    check_serving(s)
    dev = resolve_device(device)
    set_threads(threads)
    machine = machine_info(dev)
    log(describe_machine(machine))
    busy = busy_warning(machine)
    if busy:
        log(f"warning: {busy}")
    source, body = read_text(text)
    lm = load_model(LoadSpec(ref, str(dev), quant=quant, kernel=kernel, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe,
                             gpu_layers=gpu_layers))
    ids = lm.tokenizer.encode(body)
    log(f"{lm.source}: {lm.scheme_label} ({', '.join(sorted(lm.kernels))}); workload {s.workload}, concurrency {','.join(map(str, s.levels))}")
    placement = placement_lines(lm)  # on a GPU: where its experts and blocks live, as run --verbose says
    for line in placement:
        log(f"placement: {line}")
    figures = run_serving(lm.model, lm.tokenizer, ids, s, log)
    import torch

    return {
        "schema": SCHEMA,
        "model": lm.source,
        "scheme": lm.scheme_label,
        "kernels": dict(sorted(lm.kernels.items())),
        "device": str(dev),
        "placement": placement or None,
        "workload": s.workload,
        "settings": {"levels": s.levels, "prompt_tokens": s.prompt_tokens, "gen_tokens": s.gen_tokens,
                     "long_prompt_tokens": s.long_prompt_tokens, "chunk_tokens": s.chunk_tokens,
                     "kv_budget_bytes": s.kv_budget_bytes, "kv_dtype": s.kv_dtype, "threads": torch.get_num_threads(),
                     "text": source, "speculate": s.speculate},
        "machine": machine,
        **figures,
        "notes": [
            "TTFT from submission (queueing included); ITL = gaps between a request's consecutive tokens; "
            "throughput = generated tokens of all streams / the level's wall time",
            "greedy, end-of-sequence ignored; prompts are slices of the text at distinct offsets",
            f"workload: {_workload_note(s)}",
            *([f"warning: {busy}"] if busy else []),
        ],
    }


def _workload_note(s: ServingSettings) -> str:
    if s.workload in speculation.SPEC_WORKLOADS or s.speculate == "compare":
        return f"{speculation.NOTES[s.workload]}; speculation off and on, {speculation.ROUNDS} interleaved rounds"
    return WORKLOAD_NOTES[s.workload]


WORKLOAD_NOTES = {
    "uniform": "N requests at once, same prompt and reply lengths; then the highest N again while a long "
               "prompt is prefilled in chunks",
    "mixed": f"{MIXED_REQUESTS} requests, half {MIXED_SHORT} and half {MIXED_LONG} tokens, over N slots: "
             "continuous vs static batching",
    "agent": f"N agents x {AGENT_TURNS} turns: a {AGENT_HISTORY}-token start, +{AGENT_TOOL}-token tool result "
             f"and the {AGENT_REPLY}-token reply per turn; with and without the prefix cache",
}
