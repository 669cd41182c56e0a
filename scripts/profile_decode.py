#!/usr/bin/env python
"""Where a decode step's time goes: torch.profiler over cached decode steps of a model.

    .venv/bin/python scripts/profile_decode.py [--model smollm2] [--quant int4] [--quant-head int8]
        [--compile [--torch-compile]] [--prefill]

``--quant file`` keeps the scheme the model's file defines (a GGUF's blocks). ``--prefill`` profiles
the prefill of --context tokens (eager, median of --steps) instead of decode steps.

``--compile`` profiles the AOTInductor step (its kernels show as one call unless inductor's kernel
profile is on: TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 before the first compile); ``--torch-compile``
the ``torch.compile`` one instead. ROWS=40 prints more rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import profile

from localllm.loaders.load import load_model
from localllm.runtime.compile import compiled_decode
from localllm.runtime.generate import decode_one_token, forward_one_token, prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--quant-head", default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--torch-compile", action="store_true", help="with --compile: torch.compile, not AOTInductor")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128, help="tokens already in the cache")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prefill", action="store_true", help="profile the prompt's prefill, not decode steps")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quant = None if args.quant == "file" else args.quant
    lm = load_model(args.model, quant=quant, quantize_head=args.quant_head)
    model = lm.model
    n = args.context
    if args.prefill:
        profile_prefill(lm, n, args.steps)
        return
    cache = model.new_cache(n + 2 * args.steps + 16)
    prefill(model, cache, torch.randint(0, lm.config.vocab_size, (1, n)))
    step = compiled_decode(forward_one_token, lm.device, aot=not args.torch_compile) if args.compile else decode_one_token
    token = torch.tensor([[5]])
    for i in range(5):  # warm-up (and compilation)
        step(model, cache, token, torch.tensor([n + i]), n + i)
    times = []
    for i in range(args.steps):
        pos = n + 5 + i
        t0 = time.perf_counter()
        step(model, cache, token, torch.tensor([pos]), pos)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    kind = getattr(step, "kind", "eager")
    print(f"{lm.scheme_label}, kernels {dict(lm.kernels)}, step {kind}: "
          f"decode step {med * 1e3:.2f} ms median ({1 / med:.1f} tok/s) at context {n}")
    with profile() as prof:
        for i in range(20):
            pos = n + 5 + args.steps + i
            step(model, cache, token, torch.tensor([pos]), pos)
    print("per 20 steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(os.environ.get("ROWS", "12"))))


def profile_prefill(lm, n: int, rounds: int) -> None:  # type: ignore[no-untyped-def]
    """Median time of a prefill of ``n`` random tokens into an empty cache, then its profile."""
    model, ids = lm.model, torch.randint(0, lm.config.vocab_size, (1, n))
    times = []
    for _ in range(rounds):
        cache = model.new_cache(n)
        t0 = time.perf_counter()
        prefill(model, cache, ids)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(f"{lm.scheme_label}, kernels {dict(lm.kernels)}: prefill of {n} tokens {med * 1e3:.1f} ms median "
          f"({n / med:.1f} tok/s, {rounds} rounds)")
    cache = model.new_cache(n)
    with profile() as prof:
        prefill(model, cache, ids)
    print("one prefill:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(os.environ.get("ROWS", "12"))))


if __name__ == "__main__":
    main()
