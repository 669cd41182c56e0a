"""Failed builds of the compiled decode step: the mark beside each package a build could not make
(:class:`FailedBuild`: the reason, when, how often, and the versions it failed with), the back-off
before runs start that build again, and the build log that keeps a failure's full output.

A failure that a busy machine caused clears soon, so a run tries again after a short wait; one that
the model or the compiler causes should cost little, so the wait grows with each failure in a row;
a new localllm, torch or compiler may fix it, so a change of any of them makes the retry due at once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from localllm import __version__, native
from localllm.paths import build_log

#: How long after its n-th failure in a row (n = 1, 2, 3, 4 and more) a package's build is started
#: again by a run or a server: 10 minutes, an hour, 6 hours, then once a day. A failure that a busy
#: machine caused clears soon; one that the model or the compiler causes costs a background build a
#: day at most. ``localllm compile`` always tries at once.
RETRY_AFTER_S = (600, 3600, 6 * 3600, 24 * 3600)


def failure_marker(package: Path) -> Path:
    """The file that records a failed build of ``package`` (:class:`FailedBuild`, as JSON)."""
    return package.with_suffix(".failed")


def package_batch(package: Path) -> tuple[int, int]:
    """The (smallest, largest) batch a package's name says it covers (:func:`package_paths`)."""
    m = re.search(r"-b(\d+)-(\d+)(\.pt2|\.failed)$", package.name)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@functools.cache
def _compiler_version() -> str | None:
    cxx = native.compiler()
    if cxx is None:
        return None
    try:
        out = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return " ".join(cxx)
    return f"{' '.join(cxx)}: {out.splitlines()[0] if out else '?'}"


def build_versions() -> dict[str, str | None]:
    """What decides whether a failed build may succeed now, beyond the package's key (which covers the
    model's shapes and torch's version): localllm's version, torch's and the C++ compiler's."""
    return {"localllm": __version__, "torch": torch.__version__, "compiler": _compiler_version()}


def config_digest(config: Any) -> str:
    """A model config's short hash: how ``show`` finds the failed builds of a model it has not loaded."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FailedBuild:
    """A failed build of one package, as its mark (:func:`failure_marker`) records it."""

    package: Path
    reason: str  # one line; the full output is in the build log
    failed_at: float  # the last failure, seconds since the epoch
    failures: int  # failures in a row, with these versions
    versions: dict[str, str | None]  # :func:`build_versions` when it failed
    config: str = ""  # :func:`config_digest` of the model

    @property
    def retry_at(self) -> float:
        """When runs start the build again (:data:`RETRY_AFTER_S`), the versions being the same."""
        return self.failed_at + RETRY_AFTER_S[min(max(self.failures, 1), len(RETRY_AFTER_S)) - 1]

    def retry_due(self, now: float | None = None) -> bool:
        """Whether a run should start the build again: the back-off is over, or localllm, torch or the
        compiler is not the one it failed with."""
        return self.versions != build_versions() or (time.time() if now is None else now) >= self.retry_at

    def describe(self, now: float | None = None) -> str:
        """One line: the rows whose steps run eagerly, why, and when a build is tried again."""
        lo, hi = package_batch(self.package)
        rows = "1 row" if lo == hi == 1 else f"{lo}-{hi} rows"
        times = "once" if self.failures == 1 else f"{self.failures} times"
        when = ("a new build is due" if self.retry_due(now) else
                f"tried again after {time.strftime('%Y-%m-%d %H:%M', time.localtime(self.retry_at))}")
        return (f"decode steps of {rows} run eagerly: their build failed {times} ({self.reason}); {when}, "
                f"or now by `localllm compile --batch {lo}`")

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "failed_at": self.failed_at, "failures": self.failures,
                "versions": self.versions, "config": self.config, "batch": list(package_batch(self.package))}


def read_failure(package: Path) -> FailedBuild | None:
    """The mark of a failed build of ``package``, or None. A mark that cannot be read (written by an
    older localllm as one line of text, or damaged) counts as one failure with unknown versions: due
    for a retry at once."""
    mark = failure_marker(package)
    try:
        text = mark.read_text()
        when = mark.stat().st_mtime
    except OSError:
        return None
    try:
        d = json.loads(text)
        return FailedBuild(package, str(d["reason"]), float(d["failed_at"]), int(d["failures"]),
                           dict(d["versions"]), str(d.get("config", "")))
    except (ValueError, KeyError, TypeError):
        first = text.strip().splitlines()[0] if text.strip() else "unknown"
        return FailedBuild(package, first[:300], when, 1, {})


def record_failure(packages: list[Path], reason: str, config: str) -> None:
    """Mark each of ``packages`` as failed now for ``reason`` (one line), counting the failures in a
    row with the same versions; each mark is written whole (temporary file, then renamed)."""
    versions, now = build_versions(), time.time()
    for package in packages:
        old = read_failure(package)
        count = old.failures + 1 if old is not None and old.versions == versions else 1
        mark = failure_marker(package)
        data = FailedBuild(package, reason, now, count, versions, config).to_json()
        tmp = mark.with_name(f".{mark.name}.{uuid.uuid4().hex}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1) + "\n")
            os.replace(tmp, mark)
        except OSError:  # a mark that cannot be written: runs try the build again
            tmp.unlink(missing_ok=True)


def eager_note(missing: list[Path], now: float | None = None) -> tuple[bool, str | None]:
    """For packages an engine wants that are not built: whether a build should start now (one of them
    was never tried, or is due for a retry), and which decode steps run eagerly after a failed build,
    why and until when (None: none failed)."""
    marks = [(p, read_failure(p)) for p in missing]
    needs = any(m is None or m.retry_due(now) for _, m in marks)
    failed = [m.describe(now) for _, m in marks if m is not None]
    return needs, "; ".join(failed) or None


def log_failure(packages: list[Path], detail: str) -> bool:
    """Append a failed build's full output to the build log (the marks keep one line of it); False
    when the log cannot be written."""
    log = build_log()
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} building {', '.join(p.name for p in packages)} "
                    f"failed (localllm {__version__}, torch {torch.__version__}):\n{detail.rstrip()}\n")
    except OSError:  # the marks still say why
        return False
    return True
