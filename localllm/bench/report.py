"""The bench's result as a table (stdout), notes (stderr), a JSON file and a plot."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localllm.bench.plot import write_plot
from localllm.bench.settings import Figures, Log, log_stderr
from localllm.errors import LocalLLMError
from localllm.format import human_size


def _fmt_ms(v: float) -> str:
    return f"{v * 1e3:.1f}"


def _fmt_num(v: float) -> str:
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _cell(value: float | None, fmt: Callable[[float], str], ratio: float | None, show_ratio: bool) -> str:
    if value is None:
        return "-"
    text = fmt(value)
    return f"{text} ({ratio:.2f}x)" if show_ratio and ratio is not None else text


def memory_bound_cell(memory: Figures) -> str:
    """Peak memory over weights + KV cache, and whether it meets the target: ``1.08 ok``, ``1.40 over``."""
    return f"{memory['ratio_to_weights_kv']:.2f} {'ok' if memory['within_bound'] else 'over'}"


def kernels_cell(f: Figures) -> str:
    """The matmul kernels a scheme's layers ran on (attention's left out: every scheme shares it);
    a float model's torch ``nn.Linear`` layers show as ``torch``."""
    names = [k for k in f.get("kernels", {}) if not k.startswith("attention-")]
    return "+".join(names) if names else "torch"


def step_cell(f: Figures) -> str:
    """``compiled``, or ``eager`` with its reason (``eager: --compile not given``)."""
    step = f.get("decode_step") or {}
    kind = step.get("kind", "-")
    return f"{kind}: {step['why']}" if step.get("why") else kind


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
        ("kernels", [kernels_cell(S[n]) for n in names]),
        ("decode step", [step_cell(S[n]) for n in names]),
        row("weights", lambda f: f["weight_bytes"], human_size, lambda f: f["ratios"]["weight_bytes"]),
        row("load s", lambda f: f["load_s"], lambda v: f"{v:.2f}"),
        row("peak memory" + (" (allocated)" if cuda else " (RSS growth)"), lambda f: f["memory"]["peak_bytes"],
            human_size, lambda f: f["ratios"]["peak_bytes"]),
    ]
    if cuda:
        rows.append(row("peak reserved", lambda f: f["memory"]["peak_reserved_bytes"], human_size))
    rows.append(("mem/(w+kv)", [memory_bound_cell(S[n]["memory"]) for n in names]))
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


def report(result: dict[str, Any], json_path: str | Path | None = None, plot_path: str | Path | None = None,
           log: Log = log_stderr, table_of: Callable[[dict[str, Any]], str] = format_table,
           plot: Callable[[dict[str, Any], str | Path], None] = write_plot) -> None:
    """The table on stdout (stderr when the JSON goes to stdout), notes on stderr, files if asked.
    ``table_of``/``plot``: the serving bench passes its own."""
    table = table_of(result)
    to_stdout = str(json_path) != "-"
    print(table, file=sys.stdout if to_stdout else sys.stderr, flush=True)
    for note in result["notes"]:
        log(f"note: {note}")
    if json_path is not None:
        write_json(result, json_path)
        if to_stdout:
            log(f"wrote {json_path}")
    if plot_path is not None:
        plot(result, plot_path)
        log(f"wrote {plot_path}")
