"""One-token forward steps (a decode step's matmuls, no context) of SmolLM2 imported from Hub formats
against the same model in localllm's own int4, in one process, interleaved rounds, medians.

Needs the folders scripts/hub_formats_speed.py writes (results/hub_formats_speed/). For a loaded
machine, where ``localllm bench``'s separate processes take minutes each:

    .venv/bin/python scripts/hub_formats_step.py [--rounds 30] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--dtype", default="fp32")
    args = ap.parse_args()
    from localllm.loaders.load import load_model

    out = ROOT / "results" / "hub_formats_speed"
    specs = {"own int4 g32 (RTN)": (out / "smollm2-fp32", {"quant": "int4", "calibration": "none"}),
             "GPTQ sym g32": (out / "smollm2-gptq", {}),
             "GPTQ sym g32 act order": (out / "smollm2-gptq-act", {}),
             "AWQ g32 (int4z)": (out / "smollm2-awq", {})}
    models = {}
    for label, (folder, extra) in specs.items():
        try:
            loaded = load_model(str(folder), device="cpu", dtype=args.dtype, **extra)
        except TypeError:  # a localllm without --calibration
            extra.pop("calibration", None)
            loaded = load_model(str(folder), device="cpu", dtype=args.dtype, **extra)
        models[label] = loaded
        print(f"{label:<24} {loaded.scheme_label}; kernels {dict(loaded.kernels)}")
    ids = torch.tensor([[42]])
    times: dict[str, list[float]] = {k: [] for k in models}
    with torch.no_grad():
        for m in models.values():
            m.model(ids)  # warm-up
        for _ in range(args.rounds):
            for label, m in models.items():
                t0 = time.perf_counter()
                m.model(ids)
                times[label].append(time.perf_counter() - t0)
    base = statistics.median(times["own int4 g32 (RTN)"])
    for label, t in times.items():
        med = statistics.median(t)
        print(f"{label:<24} {1e3 * med:7.2f} ms a step (min {1e3 * min(t):.2f})  x{med / base:.2f} of own int4")


if __name__ == "__main__":
    main()
