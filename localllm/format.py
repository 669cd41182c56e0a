"""Human-readable figures for the CLI: sizes, counts, ages, tables."""

from __future__ import annotations

from datetime import datetime, timezone

_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def human_size(n: int | float) -> str:
    """Bytes as Ollama shows them: 1000-based, whole numbers from 10 up ("98 MB"), one decimal below ("4.7 GB")."""
    if n < 0:
        return "-" + human_size(-n)
    value = float(n)
    for unit in _UNITS:
        if value < 1000 or unit == _UNITS[-1]:
            break
        value /= 1000
    if unit == "B":
        return f"{int(value)} B"
    if value >= 999.5 and unit != _UNITS[-1]:  # would print as "1000 MB"
        value, unit = value / 1000, _UNITS[_UNITS.index(unit) + 1]
    return f"{value:.0f} {unit}" if value >= 9.95 else f"{value:.1f} {unit}"


def human_count(n: int) -> str:
    """A parameter count as model cards write it: 135M, 1.2B, 7.2B, 70B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value >= 10 else f"{value:.1f}{unit}"
    return str(n)


def human_ago(then: datetime, now: datetime | None = None) -> str:
    """How long ago, as Ollama writes it: "Less than a second ago", "About a minute ago", "3 days ago"."""
    seconds = max(0.0, ((now or datetime.now(timezone.utc)) - then).total_seconds())
    if seconds < 1:
        return "Less than a second ago"
    for limit, unit, size in ((60, "second", 1), (3600, "minute", 60), (86400, "hour", 3600), (7 * 86400, "day", 86400),
                              (30 * 86400, "week", 7 * 86400), (365 * 86400, "month", 30 * 86400)):
        if seconds < limit:
            return _ago(int(seconds // size), unit)
    return _ago(int(seconds // (365 * 86400)), "year")


def _ago(n: int, unit: str) -> str:
    if n != 1:
        return f"{n} {unit}s ago"
    if unit in ("minute", "hour"):
        return f"About {'an' if unit == 'hour' else 'a'} {unit} ago"
    return f"1 {unit} ago"


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns three spaces apart, the way ``ollama ls`` prints."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
