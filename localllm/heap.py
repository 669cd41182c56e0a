"""Handing the C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op elsewhere).

Loading frees many tensors of a few MB (a reader's metadata, conversion temporaries) between the
ones it keeps. glibc raises its mmap threshold after the first large free, so later ones come from
the heap, and the free gaps between kept tensors stay resident until trimmed: for a model quantized
as it loads, the load's peak resident set would grow with the model's layer count.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _find_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None


_TRIM = _find_trim()


def trim_heap() -> None:
    """Return the heap's free pages to the system now (milliseconds; safe to call often)."""
    if _TRIM is not None:
        _TRIM(0)
