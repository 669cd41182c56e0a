"""Background builds that give way to generation: a command run only while no localllm engine on this
machine (of this user) is generating, stopped (SIGSTOP, its whole process group: the compiler's
processes too) the moment one starts and continued when none is left.

Why not just the lowest CPU priority: even under Linux's SCHED_IDLE a build slows a run that shares
the machine with it several times over (a run timed alone and beside a build, in turns): the compiler
takes the cores whenever the run's threads wait between layers, and brings its own working set into
the caches and the memory bus every time. A stopped build takes nothing.

An engine with work holds a shared lock on :func:`running_lock` (:class:`Generating`); the keeper
polls for it with an exclusive, non-blocking attempt. The lock is the kernel's: a crashed engine's is
released with its process. A leaf of the base layer (no torch): the keeper starts in a moment.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: How often the keeper looks (seconds): a run's first tokens wait at most this long for the build to stop.
POLL_S = 0.05


def running_lock() -> Path:
    """One per user and machine, not per home: a build competes for the cores with every run here."""
    return Path(tempfile.gettempdir()) / f"localllm-{os.getuid()}-generating.lock"


class Generating:
    """Held while an engine has work (:meth:`hold` / :meth:`release`, cheap when already so)."""

    def __init__(self) -> None:
        self._fd: int | None = None

    def hold(self) -> None:
        if self._fd is None:
            try:
                fd = os.open(running_lock(), os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                return  # a home that cannot be written: nothing to tell a build
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the lock
            self._fd = None


def generating() -> bool:
    """Whether some engine holds the lock now."""
    try:
        fd = os.open(running_lock(), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def keep(argv: list[str]) -> int:
    """Run ``argv`` in a process group of its own, stopped whenever an engine generates; its exit code.
    A SIGTERM to the keeper ends the command too."""
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)

    def end(*_: object) -> None:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, end)
    stopped = False
    while child.poll() is None:
        busy = generating()
        if busy != stopped:
            try:
                os.killpg(child.pid, signal.SIGSTOP if busy else signal.SIGCONT)
            except ProcessLookupError:
                break
            stopped = busy
        time.sleep(POLL_S)
    if stopped:
        end()
    return child.wait()


if __name__ == "__main__":
    sys.exit(keep(sys.argv[1:]))
