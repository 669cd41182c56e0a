"""A background build gives way to generation (localllm.yielding): the kept command is stopped while
an engine holds the generating lock, goes on when it is released, and ends when its keeper is told to."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localllm.yielding import Generating, generating

TICKER = "import time, sys\nwhile True:\n    open(sys.argv[1], 'a').write('.')\n    time.sleep(0.02)\n"


def ticks(path: Path) -> int:
    return len(path.read_text()) if path.exists() else 0


def test_the_kept_command_stops_while_an_engine_generates(tmp_path: Path) -> None:
    if generating():  # the lock is this user's on this machine: another localllm is generating now
        pytest.skip("a localllm engine of this user is generating on this machine")
    out = tmp_path / "ticks"
    keeper = subprocess.Popen([sys.executable, "-m", "localllm.yielding", sys.executable, "-c", TICKER, str(out)],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while ticks(out) < 5 and time.monotonic() < deadline:  # it runs while nothing generates
            time.sleep(0.05)
        assert ticks(out) >= 5 and not generating()
        busy = Generating()
        busy.hold()
        assert generating()
        time.sleep(0.5)  # the keeper has looked (every 50 ms) and stopped it
        held = ticks(out)
        time.sleep(0.5)
        assert ticks(out) == held  # stopped: not one tick while the engine generates
        busy.release()
        time.sleep(0.5)
        assert ticks(out) > held + 5 and not generating()  # continued
    finally:
        os.killpg(keeper.pid, signal.SIGTERM)  # the keeper ends its command too
        assert keeper.wait(timeout=10) != 0
    after = ticks(out)
    time.sleep(0.3)
    assert ticks(out) == after  # the command is gone
