#!/usr/bin/env python
"""Decode with and without the KV cache on one model and prompt; print per-step latency and cache size.

    .venv/bin/python scripts/kv_cache_experiment.py [--model smollm2] [--steps 100] [--quant bf16]
"""

from __future__ import annotations

import argparse

import torch

from localllm.loaders.load import load_model
from localllm.runtime.kvcompare import decode_latencies

REPORT_STEPS = (1, 10, 20, 50, 100)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dtype", default="auto", help="activation dtype")
    ap.add_argument("--quant", default=None, help="weight scheme (default: the model's own)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--prompt", default="The history of the printing press begins")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device, dtype=args.dtype, quant=args.quant)
    prompt = torch.tensor([lm.tokenizer.encode(args.prompt)], device=lm.device)
    decode_latencies(lm.model, prompt, 3, use_cache=True)  # warm-up
    cached = decode_latencies(lm.model, prompt, args.steps, use_cache=True)
    uncached = decode_latencies(lm.model, prompt, args.steps, use_cache=False)

    c = lm.config
    print(f"model {lm.source}  weights {lm.scheme_label}  device {lm.device}  "
          f"threads {torch.get_num_threads()}  prompt {prompt.shape[1]} tokens")
    print(f"{'step':>6} {'seq len':>8} {'no cache (ms)':>14} {'KV cache (ms)':>14} {'speed-up':>9}")
    for s in REPORT_STEPS:
        if s <= args.steps:
            a, b = uncached[s - 1] * 1e3, cached[s - 1] * 1e3
            print(f"{s:>6} {prompt.shape[1] + s:>8} {a:>14.2f} {b:>14.2f} {a / b:>8.1f}x")
    nbytes = torch.empty(0, dtype=lm.dtype).element_size()
    per_token = c.kv_cache_bytes(1, nbytes)
    print(f"KV cache: 2 x {c.n_layers} layers x {c.n_kv_heads} kv heads x {c.head_dim} head dim x {nbytes} bytes"
          f" = {human_bytes(per_token)} per token; {human_bytes(per_token * c.max_seq_len)} for the full"
          f" {c.max_seq_len}-token context")


if __name__ == "__main__":
    main()
