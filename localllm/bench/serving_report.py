"""The serving benchmark's table (stdout) and its throughput-and-latency curve (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localllm.bench.plot import require_matplotlib


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_serving(result: dict[str, Any]) -> str:
    """One row per concurrency level; the workload's comparison below it. ``step``: the median
    decode-only step; ``prefill s``: the time of the steps that carried prompt tokens."""
    head = (f"{'level':>5}  {'tok/s':>7}  {'TTFT p50':>8}  {'TTFT p99':>8}  {'ITL p50':>7}  {'ITL p99':>7}  "
            f"{'prompt':>6}  {'cached':>6}  {'KV blocks':>9}  {'step':>5}  {'prefill s':>9}")
    lines = [f"{result['workload']} workload, {result['model']} ({result['scheme']}), ms unless stated", head]
    for r in result["concurrency"]:
        lines.append(
            f"{r['level']:>5}  {r['throughput_tok_s']:>7.1f}  {_ms(r['ttft_ms']['p50']):>8}  "
            f"{_ms(r['ttft_ms']['p99']):>8}  {_ms(r['itl_ms']['p50']):>7}  {_ms(r['itl_ms']['p99']):>7}  "
            f"{r['prompt_tokens']:>6}  {r['cached_prompt_tokens']:>6}  {r['kv_blocks_peak']:>4}/{r['kv_blocks']:<4}  "
            f"{_ms(r['decode_step_ms']['p50']):>5}  {r['prefill_steps_s']:>9.2f}")
    c = result["comparison"]
    if all("speculation" in r for r in result["concurrency"]):
        lines += ["speculative decoding, medians of rounds run side by side (step ms by query rows, as measured):"]
        for r in result["concurrency"]:
            sp = r["speculation"]
            rate = "-" if sp["acceptance"] is None else f"{sp['acceptance']:.0%}"
            mean = "-" if sp["mean_accepted"] is None else f"{sp['mean_accepted']:.2f}"
            steps = ", ".join(f"{k}: {_ms(v)}" for k, v in list(sp["step_ms_by_rows_on"].items())[:8])
            lines.append(f"level {r['level']}: off {sp['off_tok_s']:.1f} tok/s, on {sp['on_tok_s']:.1f} tok/s "
                         f"({_x(sp['on_over_off'])}); a stream decodes {sp['off_stream_decode_tok_s']:.1f} -> "
                         f"{sp['on_stream_decode_tok_s']:.1f} tok/s ({_x(sp['stream_decode_on_over_off'])}); {sp['accepted_tokens']} of {sp['drafted_tokens']} drafted tokens "
                         f"accepted ({rate}), {mean} per verify step; step ms by rows {{{steps}}}; the best "
                         f"lookup: {sp['lookup_tokens_per_step']:.2f} tokens a decode step, throughput at most "
                         f"{_x(sp['lookup_throughput_bound'])}")
    elif result["workload"] == "uniform":
        w = c["with_long_prompt"]
        lines += [f"throughput c8 / c1: {_x(c['throughput_c8_over_c1'])}; ITL p99 at c8 / p50 at c1: "
                  f"{_x(c['itl_p99_c8_over_p50_c1'])}",
                  f"decode-only step c8 / c1: {_x(c['decode_step_c8_over_c1'])}; throughput c8 / c1 had a c8 "
                  f"decode step cost a c1 one (prefill as measured): {_x(c['throughput_c8_over_c1_if_c8_steps_cost_c1'])}",
                  f"c{w['level']} while a {w['long_prompt_tokens']}-token prompt is prefilled: ITL p50 "
                  f"{_ms(w['itl_ms']['p50'])}, p99 {_ms(w['itl_ms']['p99'])} ({_x(c['itl_p99_with_long_prompt_over_p50_c1'])}"
                  f" the p50 at c1); the long prompt's TTFT {_ms(w['long_prompt_ttft_ms'])}"]
    elif result["workload"] == "mixed":
        for r in result["concurrency"]:
            st = r["static"]
            lines.append(f"slots {r['level']}: continuous {r['throughput_tok_s']:.1f} tok/s, static "
                         f"{st['throughput_tok_s']:.1f} tok/s: {_x(r['continuous_over_static'])}; steps with prompt "
                         f"tokens {r['prefill_steps_s']:.2f} s of {r['wall_s']:.2f} s and {st['prefill_steps_s']:.2f} s "
                         f"of {st['wall_s']:.2f} s; {_x(r['continuous_over_static_if_steps_cost_static'])} had continuous batching's "
                         f"decode steps cost static's")
    else:
        for r in result["concurrency"]:
            n = r["no_cache"]
            lines.append(f"agents {r['level']}: prefilled {r['prefill_tokens']} tokens with the prefix cache, "
                         f"{n['prefill_tokens']} without ({r['prefill_fraction']:.0%}); mean TTFT "
                         f"{_ms(r['ttft_mean_ms'])} vs {_ms(n['ttft_mean_ms'])} ({_x(r['ttft_mean_speedup'])} lower)")
    return "\n".join(lines)


def write_serving_plot(result: dict[str, Any], path: str | Path) -> None:
    """Throughput and latency (TTFT, ITL: p50 and p99) against concurrency."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["concurrency"]
    x = [r["level"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    fig.suptitle(f"{Path(result['model']).name} ({result['scheme']}), {result['workload']} workload, "
                 f"{result['settings']['threads']} threads", fontsize=10)
    a.plot(x, [r["throughput_tok_s"] for r in rows], marker="o", label="throughput")
    if result["workload"] == "mixed":
        a.plot(x, [r["static"]["throughput_tok_s"] for r in rows], marker="s", label="static batching")
    a.set_xlabel("concurrency")
    a.set_ylabel("generated tok/s (all streams)")
    a.legend()
    a.grid(alpha=0.3)
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")):
        for q, style in (("p50", "-"), ("p99", "--")):
            b.plot(x, [r[key][q] for r in rows], style, marker="o", label=f"{label} {q}")
    b.set_yscale("log")
    b.set_xlabel("concurrency")
    b.set_ylabel("ms")
    b.legend()
    b.grid(alpha=0.3)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
