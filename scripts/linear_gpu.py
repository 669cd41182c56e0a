#!/usr/bin/env python
"""Each quantized-matmul kernel of a device on Llama-2-7B's layer shapes, side by side with the 16-bit
``F.linear`` of the same shape: what decides which kernel a scheme takes by default.

    .venv/bin/python scripts/linear_gpu.py [--rows 1,16,128,2000] [--out results/gpu]
    .venv/bin/python scripts/linear_gpu.py --device cpu --shape tiny --rows 1,8   # the logic, on the CPU

For every layer shape (q/k/v fused, o, gate/up fused, down), scheme (int4 group 32, int8 per channel)
and kernel that can run it here (``int4-triton-cuda`` and ``int4-tinygemm-cuda``, ``int8-triton-cuda``
and ``int8-weight-only`` on a GPU), each kernel checked against the reference first: the median time
of a call over interleaved rounds (each round times every kernel once at every row count, so a
drifting clock moves them all), timed with CUDA events. With one row the line also gives the weight
bytes read over the time, as a share of the device's read bandwidth measured in the same run. One
JSON (linears.json) and the table (linears.txt) in --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from localllm.bench.machine import measure_bandwidth, time_op
from localllm.quant import kernels
from localllm.quant.formats import parse_scheme, quantize
from localllm.quant.linear import QuantLinear
from localllm.quant.target import Target

#: (name, out, in) of one block's linears as the runtime fuses them.
SHAPES = {
    "7b": [("qkv", 3 * 4096, 4096), ("o", 4096, 4096), ("gate_up", 2 * 11008, 4096), ("down", 4096, 11008)],
    "tiny": [("qkv", 768, 256), ("down", 256, 512)],
}
SCHEMES = ("int4", "int8")


def quant_layer(scheme_name: str, w: torch.Tensor, kernel: str, act: torch.dtype) -> QuantLinear:
    """``w`` quantized and prepared on ``kernel`` (checked against the reference), on w's device."""
    scheme = parse_scheme(scheme_name)
    with torch.device("meta"):
        layer = QuantLinear(w.shape[1], w.shape[0], scheme)
    for name, t in quantize(w, scheme).items():
        setattr(layer, name, t)
    got = layer.prepare(act, kernel)
    if got != kernel:
        raise RuntimeError(f"{kernel} fails its check against the reference here (the layer took {got})")
    return layer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--rows", default="1,16,128,2000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10, help="calls timed together in a round (their mean)")
    ap.add_argument("--out", type=Path, default=Path("results/gpu"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("Error: no CUDA GPU is visible; try --device cpu --shape tiny to check the logic", file=sys.stderr)
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    act = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = Target.of(device)
    read_bps = measure_bandwidth(device)["read_bytes_per_s"]
    print(f"{target.describe()}: read bandwidth {read_bps / 1e9:.0f} GB/s; activations {act}; "
          f"µs a call, median of {args.rounds} interleaved rounds", file=sys.stderr)

    cases = []  # (layer shape, scheme or "16-bit", kernel name, module)
    g = torch.Generator(device=device).manual_seed(0)
    for name, out, inp in SHAPES[args.shape]:
        w = torch.randn(out, inp, generator=g, device=device, dtype=act) * 0.02
        cases.append((name, "16-bit", "F.linear", w))
        for scheme in SCHEMES:
            with torch.device("meta"):
                probe = QuantLinear(inp, out, parse_scheme(scheme))
            for k in kernels.KERNELS:
                if k is kernels.Reference or k.opt_in or k.scheme != scheme or not k.supports(probe, target, act):
                    continue
                try:
                    cases.append((name, scheme, k.name, quant_layer(scheme, w, k.name, act)))
                except RuntimeError as e:
                    print(f"skipped {k.name} on {name}: {e}", file=sys.stderr)
        del w
    xs = {m: torch.randn(m, max(inp for _, _, inp in SHAPES[args.shape]), device=device, dtype=act) for m in rows}

    def call(module, m: int):  # type: ignore[no-untyped-def]
        x = xs[m][:, : (module.shape[1] if isinstance(module, torch.Tensor) else module.in_features)]
        if isinstance(module, torch.Tensor):
            return lambda: [F.linear(x, module) for _ in range(args.calls)]
        return lambda: [module(x) for _ in range(args.calls)]

    times: dict[tuple[int, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for i, (_, _, _, module) in enumerate(cases):
                for m in rows:
                    times.setdefault((i, m), []).append(time_op(call(module, m), device, 1, warmup=1) / args.calls)
    results = []
    lines = [f"{'layer':8} {'scheme':7} {'kernel':20} " + " ".join(f"{m:>9}" for m in rows)
             + ("   at 1 row: MB read, share of bandwidth" if 1 in rows else "")]
    for i, (name, scheme, kernel, module) in enumerate(cases):
        med = {m: sorted(times[(i, m)])[len(times[(i, m)]) // 2] * 1e6 for m in rows}
        tensors = [module] if isinstance(module, torch.Tensor) else list(module.buffers())
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        line = f"{name:8} {scheme:7} {kernel:20} " + " ".join(f"{med[m]:9.1f}" for m in rows)
        share = None
        if 1 in rows:
            share = nbytes / (med[1] / 1e6) / read_bps
            line += f"   {nbytes / 1e6:8.1f} MB {share:5.0%}"
        lines.append(line)
        results.append({"layer": name, "scheme": scheme, "kernel": kernel, "bytes": nbytes,
                        "us_by_rows": {str(m): med[m] for m in rows}, "bandwidth_share_1_row": share})
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linears.txt").write_text(table + "\n")
    (args.out / "linears.json").write_text(json.dumps({
        "device": target.describe(), "read_bytes_per_s": read_bps, "activations": str(act), "rounds": args.rounds,
        "calls": args.calls, "rows": rows, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
