"""The one user-facing error type.

Every error a user can cause (bad path, unknown model, prompt too long, no network...) is raised as
:class:`LocalLLMError` with a message that names the problem and a hint that names the fix.  The CLI
turns it into a one-line message and a non-zero exit; ``LOCALLLM_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager


class LocalLLMError(Exception):
    """A problem the user can fix; ``str()`` gives the one-line message (problem, then fix)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = self.message.rstrip(". ")
        if self.hint:
            text += "; " + self.hint
        return " ".join(text.split())  # one line, whatever the parts held


class StorageError(LocalLLMError):
    """Writing failed because of the disk (full, read-only, no permission), not the request: the server
    answers 507, the CLI one line."""


#: The errors of a disk, not of a program or network, with what they mean in a message.
_DISK_ERRNOS = {
    errno.ENOSPC: "no space is left on the disk",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file grew past the size this process may write",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.ENAMETOOLONG: "the path is too long",
}
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@contextmanager
def disk_errors(doing: str, elsewhere: str) -> Iterator[None]:
    """Turn a disk's OSError inside the block into one :class:`StorageError` line: what was being done
    (``doing``), why the disk refused, the file, and the fix (``elsewhere``: where else to write, e.g.
    "set LOCALLLM_HOME to a folder on a larger disk"). Other OSErrors pass through unchanged."""
    try:
        yield
    except OSError as e:
        why = _DISK_ERRNOS.get(e.errno or 0)
        if why is None:
            raise
        where = f" ({e.filename})" if e.filename else ""
        fix = f"free some space, or {elsewhere}" if e.errno in _NO_ROOM else elsewhere
        raise StorageError(f"cannot {doing}: {why}{where}", fix) from None
