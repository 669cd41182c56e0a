#!/usr/bin/env python
"""Cost per activation row of a model's quantized linears (layer 0, and the head) against the number of
rows: what a batched decode step pays per sequence, and where the row kernels (decode in registers)
and the panel GEMM (csrc/panel_gemm.h) cross over.

    .venv/bin/python scripts/linear_rows.py [--model smollm2] [--rows 1,4,8,16,32,64,128,256] [--threads 2]
                                            [--kernel int4-q8-cpu]

For each linear and row count: median µs per call over --calls calls, and µs per row: on the path
the kernel picks (its GEMV_ROWS threshold), with the row kernel forced for every count, and with the
panel GEMM forced. `--kernel` loads the model with that kernel, as `run --kernel` does (the
int8-activation kernels have one path for every row count, so their three tables agree); under
`ATEN_CPU_CAPABILITY=avx2` every kernel takes its AVX2 path.

With one row among --rows, each line ends with the bytes the layer reads (its weight buffers as the
kernel holds them) over the one-row time, and that as a share of the machine's read bandwidth
(measured first, as `localllm bench` does): how far a decode step's kernel is from memory-bound.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localllm.bench.machine import measure_bandwidth
from localllm.loaders.load import load_model
from localllm.quant import kernels


def median_us(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,256")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel", help="a matmul kernel to load the model with, as run's --kernel")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    read_bps = measure_bandwidth(torch.device("cpu"))["read_bytes_per_s"] if 1 in rows else None
    if read_bps:
        print(f"machine read bandwidth, {args.threads} threads: {read_bps / 1e9:.1f} GB/s")
    lm = load_model(args.model, device="cpu", kernel=args.kernel)
    linears = [(n, m) for n, m in lm.model.named_modules()
               if type(m).__name__ == "QuantLinear" and ("layers.0." in n or "layers." not in n)]
    kinds = [kernels.Int4GroupCPU, kernels.Int8GroupCPU, kernels.GGUFBlocksCPU]
    saved = {k: k.GEMV_ROWS for k in kinds}
    for label, limit in (("as picked", None), ("row kernel forced", 1 << 20), ("panel GEMM forced", 0)):
        for k in kinds:
            k.GEMV_ROWS = saved[k] if limit is None else limit
        print(f"\n{label} (GEMV_ROWS {', '.join(f'{k.__name__} {k.GEMV_ROWS}' for k in kinds)}); µs a call (µs a row)")
        for name, layer in linears:
            cells = []
            one_row_us = None
            with torch.inference_mode():
                for m in rows:
                    x = torch.randn(m, layer.in_features, dtype=lm.model.dtype)
                    us = median_us(lambda: layer(x), args.calls)
                    cells.append(f"{us:7.0f} ({us / m:5.1f})")
                    one_row_us = us if m == 1 else one_row_us
            if read_bps and one_row_us:
                nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
                gbps = nbytes / one_row_us / 1e3
                cells.append(f" {nbytes / 1e6:7.2f} MB {gbps:5.1f} GB/s ({gbps * 1e9 / read_bps:4.0%})")
            print(f"{name:28} {layer.in_features}x{layer.out_features:<5} " + " ".join(cells))
        print(f"{'rows:':40} " + " ".join(f"{m:>15}" for m in rows)
              + ("   weights, read at 1 row (share of the bandwidth)" if read_bps else ""))
    for k in kinds:
        k.GEMV_ROWS = saved[k]


if __name__ == "__main__":
    main()
