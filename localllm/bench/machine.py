"""The machine a bench runs on: what it is, whether it is busy, and its memory bandwidth (the roofline's
denominator), measured in the same process and with the same threads as the decode."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from localllm import __version__
from localllm.bench.meters import release_memory
from localllm.format import human_size


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict[str, Any]:
    gpu = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if gpu else None
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu_name": props.name if props else None,
        "gpu_capability": f"{props.major}.{props.minor}" if props else None,
        "gpu_memory_bytes": props.total_memory if props else None,
        "torch_version": torch.__version__,
        "localllm_version": __version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def busy_warning(m: dict[str, Any]) -> str | None:
    """A warning when other work competes for the CPUs the bench uses (timings then swing widely:
    a CPU thread that loses its core stalls the others at every parallel region)."""
    load = m["load_average"]
    spare = (m["cpu_count"] or 1) - m["threads"]
    if load is None or load[0] <= spare + 0.5:
        return None
    return (f"the machine was busy when the bench started (load average {load[0]:.1f} over the last minute, "
            f"{m['cpu_count']} CPUs, {m['threads']} threads used here): timings are unreliable; "
            "compare the min-max spreads, or rerun on an idle machine")


def describe_machine(m: dict[str, Any]) -> str:
    gpu = f"; GPU {m['gpu_name']} (sm {m['gpu_capability']}, {human_size(m['gpu_memory_bytes'])})" if m["gpu_name"] else ""
    return (f"machine: {m['cpu_model']}, {m['threads']} torch threads of {m['cpu_count']} CPUs{gpu}; "
            f"torch {m['torch_version']}, localllm {m['localllm_version']}, Python {m['python_version']}")


def time_op(op: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``op`` (CUDA: timed with events, so launch latency does not count)."""
    for _ in range(warmup):
        op()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 9) -> dict[str, Any]:
    """The machine's memory bandwidth as this process sees it (same threads as the decode).

    A tensor far larger than any cache (512 MiB on the CPU, 2 GiB on a GPU) is read (``t.sum()``)
    and copied into another (read + write counted); the median of ``repeats`` after two warm-ups.
    """
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 512 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # written, so its pages are resident
    dst = torch.zeros_like(src)
    read_s = time_op(lambda: src.sum(), device, repeats)
    copy_s = time_op(lambda: dst.copy_(src), device, repeats)
    del src, dst
    release_memory(device)
    read_bps, copy_bps = nbytes / read_s, 2 * nbytes / copy_s
    return {
        "method": f"median of {repeats}: t.sum() of a {nbytes >> 20} MiB fp32 tensor (read), and a copy into "
                  "another (read + write counted); the larger is the machine's bandwidth",
        "tensor_bytes": nbytes,
        "repeats": repeats,
        "read_bytes_per_s": read_bps,
        "copy_bytes_per_s": copy_bps,
        "bytes_per_s": max(read_bps, copy_bps),
    }


