"""Memory meters: the peak growth of the resident set (CPU) or of CUDA's allocations over a baseline,
and handing freed memory back between schemes so the next baseline does not hide a growth."""

from __future__ import annotations

import gc
import threading
from typing import Any

import torch

from localllm.heap import trim_heap


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Return freed memory to the system, so the next scheme's baseline does not hide its growth."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trim_heap()  # glibc keeps freed heap pages otherwise


def rss_bytes() -> int:
    """The resident set size now (VmRSS of /proc/self/status; psutil where there is no /proc)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss


class RSSMeter:
    """Peak growth of the resident set over its size at :meth:`start`, sampled in a background thread."""

    method = "cpu: peak growth of the process's resident set (VmRSS) over its size before the load, " \
             "sampled every 10 ms during load and runs"

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.baseline = self.peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())

    def now(self) -> int:
        current = rss_bytes()
        self.peak = max(self.peak, current)
        return current - self.baseline

    def stop(self) -> dict[str, Any]:
        self.now()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return {"method": self.method, "peak_bytes": self.peak - self.baseline, "peak_reserved_bytes": None}


class CudaMeter:
    """Peak of ``max_memory_allocated`` (and reserved) over what was allocated before the load."""

    method = "cuda: torch.cuda.max_memory_allocated (and max_memory_reserved) during load and runs, " \
             "minus what was allocated before the load; peak statistics reset per scheme"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.allocated = self.reserved = 0

    def start(self) -> None:
        sync(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.allocated = torch.cuda.memory_allocated(self.device)
        self.reserved = torch.cuda.memory_reserved(self.device)

    def now(self) -> int:
        sync(self.device)
        return torch.cuda.memory_allocated(self.device) - self.allocated

    def stop(self) -> dict[str, Any]:
        sync(self.device)
        return {"method": self.method,
                "peak_bytes": torch.cuda.max_memory_allocated(self.device) - self.allocated,
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device) - self.reserved}


def memory_meter(device: torch.device) -> RSSMeter | CudaMeter:
    return CudaMeter(device) if device.type == "cuda" else RSSMeter()

