"""Human-readable figures for the CLI."""

from __future__ import annotations

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
