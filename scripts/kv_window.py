#!/usr/bin/env python
"""KV memory a batch engine holds for long conversations of a sliding-window model (Gemma 3), against
the same pool with no window groups (every layer keeping every position).

    .venv/bin/python scripts/kv_window.py --model PATH [--prompt 3000] [--tokens 32] [--sequences 2]

Runs --sequences requests of --prompt tokens (random ids) and --tokens generated ones at once through
a :class:`runtime.batch.BatchEngine` and prints the most KV bytes its block tables held at any step,
beside the bytes those positions take when every layer holds them all (what a pool without window
groups holds: one block of every layer per 16 positions). Greedy; the time per step is printed too,
since giving blocks back must not slow the steps.
"""

from __future__ import annotations

import argparse
import time

import torch

from localllm.format import human_size
from localllm.loaders.load import load_model
from localllm.runtime.batch import BatchEngine
from localllm.runtime.kv_pool import block_bytes
from localllm.runtime.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, device="cpu")
    config = lm.model.config
    positions = args.prompt + args.tokens
    flat = args.sequences * -(-positions // 16) * block_bytes(config, 16, lm.model.dtype)
    eng = BatchEngine(lm.model, kv_budget_bytes=flat, max_seq_len=positions + 1, chunk_tokens=256)
    print(eng.plan.describe())
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.sequences):
        eng.submit(torch.randint(10, config.vocab_size - 10, (args.prompt,), generator=gen).tolist(),
                   SamplingParams(temperature=0), args.tokens)
    most, steps, t0 = 0, 0, time.perf_counter()
    while eng.step():
        most = max(most, eng.usage()["blocks_used"])
        steps += 1
    took = time.perf_counter() - t0
    held = most * eng.plan.bytes_per_block
    print(f"{args.sequences} sequence{'s' if args.sequences > 1 else ''} of {args.prompt} + {args.tokens} positions: at most {most} blocks held, "
          f"{human_size(held)}; every layer holding every position: {human_size(flat)} "
          f"({flat / held:.2f}x); {steps} steps, {1000 * took / steps:.1f} ms a step")


if __name__ == "__main__":
    main()
