"""Streaming text filters."""

from __future__ import annotations

from collections.abc import Iterable


class StopStringFilter:
    """Cut a text stream at the first stop string, without ever printing part of one.

    Feed the pieces as they are decoded; each :meth:`feed` returns what is safe to print now.  A tail
    that could be the start of a stop string is held back until the next piece settles it.  Once a
    stop string appears, the text before it is returned (the last text of the stream) and
    :attr:`stopped` becomes true; later calls return ''.  :meth:`flush` returns a held-back tail
    at the end of the stream.  Empty stop strings are ignored.
    """

    def __init__(self, stop: Iterable[str]) -> None:
        self._stops = sorted({s for s in stop if s}, key=len)
        self._held = ""
        self.stopped = False
        #: The stop string that ended the stream, if any.
        self.hit: str | None = None

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        # Earliest stop string wins; on a tie at one position the shortest (first in self._stops).
        found = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            index, self.hit = min(found, key=lambda f: f[0])
            self.stopped = True
            self._held = ""
            return text[:index]
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back tail: at the end of the stream it is plain text."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self._stops), default=0)
        for size in range(min(len(text), longest - 1), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0
