"""The bench's bar charts (``--plot FILE.png``; matplotlib is an optional dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError


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
