#!/usr/bin/env python
"""Where a batch-engine decode step's time goes, at several batch sizes: torch.profiler over steps in
which every sequence decodes one token (no prefill), grouped into matmuls, attention, and the rest.

    .venv/bin/python scripts/profile_batch.py [--model smollm2] [--batch 1,8,16] [--context 128] [--threads 2]
        [--kernel int4-q8-cpu] [--compiled] [--prefill]

Each batch size gets a fresh engine: that many sequences of --context prompt tokens are prefilled
first (not profiled), then --steps decode steps are timed (median step time) and profiled. Prints,
per batch size, the step time, the time per generated token and the self time of each group of ops.
``--batch 1`` is a single stream's decode step: what ``run`` does after the prompt.
--compiled times the compiled step (``localllm compile``; built if missing), whose ops the profiler
cannot see inside: its step time only. --prefill profiles prefill steps instead: each step prefills
that many new prompts of --context tokens (``--batch 1``: what ``run`` does with its prompt), each
prompt unlike every earlier one, so the prefix cache serves none of it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import profile

from localllm.loaders.load import load_model
from localllm.runtime.batch import BatchEngine
from localllm.runtime.sampling import SamplingParams

GROUPS = (("matmul (quantized linears)", ("_mm", "aten::mm", "_gemm", "linear", "addmm", "matmul", "int4pack")),
          ("attention", ("attention",)),
          ("KV writes", ("index_put", "index_copy")),
          ("sampling", ("argmax", "topk", "multinomial", "softmax", "sort")))


def group_of(name: str) -> str:
    for label, needles in GROUPS:
        if any(n in name for n in needles):
            return label
    return "other ops (norms, RoPE, activations, views, copies)"


def report(prof: profile, steps: int) -> None:
    """The profiled self times by group of ops, per step."""
    groups: dict[str, float] = defaultdict(float)
    total = 0.0
    for e in prof.key_averages():
        groups[group_of(e.key)] += e.self_cpu_time_total
        total += e.self_cpu_time_total
    print("  profiled self times:")
    for label, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {label:52} {us / steps / 1e3:7.2f} ms a step  {100 * us / total:5.1f}%")


def prefill_step(engine: BatchEngine, batch: int, context: int, vocab: int, seed: int) -> float:
    """The time of one step that prefills ``batch`` new prompts of ``context`` tokens (their first
    tokens unlike any earlier prompt's); their requests are then cancelled and retired."""
    handles = [engine.submit([(7 * (seed * batch + b) + 11 * i + 1) % vocab for i in range(context)],
                             SamplingParams(temperature=0), max_tokens=4) for b in range(batch)]
    t0 = time.perf_counter()
    engine.step()
    took = time.perf_counter() - t0
    for h in handles:
        h.cancel()
    while engine.has_work:
        engine.step()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--batch", default="1,8,16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel", default=None, help="force a matmul kernel, as run --kernel")
    ap.add_argument("--compiled", action="store_true", help="time the compiled step (no profile)")
    ap.add_argument("--prefill", action="store_true", help="profile prefill steps, not decode steps")
    ap.add_argument("--kv-cache", default="16bit", choices=["16bit", "fp16", "int8"], help="the pool's dtype, as --kv-cache")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, quant=args.quant, kernel=args.kernel)
    print(f"kernels: {dict(lm.kernels)}")
    vocab = lm.config.vocab_size
    print(f"{args.model}: {lm.model.dtype} activations, {args.threads} threads, {args.context}-token prompts")
    for batch in [int(b) for b in args.batch.split(",")]:
        engine = BatchEngine(lm.model, kv_budget_bytes=1 << 30, max_running=batch, chunk_tokens=4096,
                             max_seq_len=args.context + 2 * args.steps + 16, compile=args.compiled,
                             kv_dtype=args.kv_cache, speculate=False)  # one token a step: drafts would
        # add verify rows, and a sequence that drafts well would finish before its steps are profiled
        if args.prefill:
            step = statistics.median(prefill_step(engine, batch, args.context, vocab, s) for s in range(args.steps))
            print(f"\nbatch {batch}: prefill step {step * 1e3:.1f} ms, {batch * args.context / step:.0f} prompt "
                  f"tok/s (median of {args.steps} steps)")
            with profile() as prof:
                for s in range(args.steps, 2 * args.steps):
                    prefill_step(engine, batch, args.context, vocab, s)
            report(prof, args.steps)
            continue
        handles = [engine.submit([(7 * b + 11 * i) % vocab for i in range(args.context)], SamplingParams(temperature=0),
                                 max_tokens=2 * args.steps + 8) for b in range(batch)]
        while any(h.stats.first_token_at is None for h in handles):  # prefill (and the first tokens)
            engine.step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        print(f"\nbatch {batch}: step {step * 1e3:.1f} ms, {step * 1e3 / batch:.2f} ms a token, "
              f"{batch / step:.0f} tok/s (median of {args.steps} steps{'; compiled' if args.compiled else ''})")
        if args.compiled:
            for h in handles:
                h.cancel()
            continue
        with profile() as prof:
            for _ in range(args.steps):
                engine.step()
        report(prof, args.steps)
        for h in handles:
            h.cancel()


if __name__ == "__main__":
    main()
