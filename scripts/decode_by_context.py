#!/usr/bin/env python
"""Single-stream decode speed against the context already in the cache, and the single-stream paths
side by side: the Generator's compiled step (what `run` uses once built), its eager step, and the
batch engine with one sequence.

    .venv/bin/python scripts/decode_by_context.py [--model smollm2] [--contexts 16,128,512,1024] [--threads 2]
        [--batch-engine] [--static-package]

For each prompt length, --tokens greedy tokens after it, medians of --rounds (tok/s after the first
token, the Generator's own figure). The compiled rows need the model's step built (`localllm compile
MODEL`); without one they say "eager". --batch-engine adds the batch engine's one-sequence row and
checks that its greedy tokens are the Generator's. --static-package times the compiled step over a
package built for one cache length (the pre-length-generic design) beside the length-generic one,
interleaved, in one process (it builds that package first: about a minute).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localllm.loaders.load import load_model
from localllm.runtime.batch import BatchEngine
from localllm.runtime.generate import Generator, forward_one_token, prefill
from localllm.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
TEXT = "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp. " * 60


def generator_row(gen: Generator, prompt: list[int], tokens: int, rounds: int) -> tuple[float, list[int]]:
    speeds, out = [], []
    for _ in range(rounds):
        gen.reset()
        out = list(gen.generate(prompt, GREEDY, tokens))
        speeds.append(gen.stats.decode_tps)
    return statistics.median(speeds), out


def engine_row(model, prompt: list[int], tokens: int, rounds: int) -> tuple[float, list[int]]:  # type: ignore[no-untyped-def]
    speeds, out = [], []
    for _ in range(rounds):
        engine = BatchEngine(model, kv_budget_bytes=256 << 20, max_seq_len=len(prompt) + tokens + 16)
        handle = engine.submit(prompt, GREEDY, tokens)
        out = handle.result()
        speeds.append(handle.stats.decode_tps)
    return statistics.median(speeds), out


def static_vs_generic(model, steps: int, rounds: int) -> None:  # type: ignore[no-untyped-def]
    """The compiled step over a static-length package and over the length-generic one, interleaved."""
    import localllm.runtime.aot as aot
    from localllm.paths import home
    from localllm.runtime.compile import compiled_decode

    folder = home() / "inductor"
    generic = compiled_decode(forward_one_token, model.device, folder)
    static = compiled_decode(forward_one_token, model.device, folder)
    caches = {"length-generic": model.new_cache(4096), "static": model.new_cache(4096)}
    steps_of = {"length-generic": generic, "static": static}
    real = aot.length_generic
    ids = torch.tensor([list(range(100, 140))])
    token = torch.tensor([[5]])
    for name, step in steps_of.items():  # binds each step to its package (built if missing)
        aot.length_generic = real if name == "length-generic" else (lambda *a: False)
        prefill(model, caches[name], ids)
        step(model, caches[name], token, torch.tensor([40]), 40)
    aot.length_generic = real
    speeds: dict[str, list[float]] = {name: [] for name in steps_of}
    for _ in range(rounds):
        for name, step in steps_of.items():
            t0 = time.perf_counter()
            for pos in range(41, 41 + steps):
                step(model, caches[name], token, torch.tensor([pos]), pos)
            speeds[name].append(steps / (time.perf_counter() - t0))
    for name, values in speeds.items():
        print(f"{name:15} package: {statistics.median(values):6.1f} tok/s (median of {rounds} x {steps} steps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", default="16,128,512,1024")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-engine", action="store_true")
    ap.add_argument("--static-package", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    ids = lm.tokenizer.encode(TEXT)
    compiled = Generator(lm.model, 4096, compile="auto")
    eager = Generator(lm.model, 4096)
    print(f"{args.model}, {lm.model.dtype}, {args.threads} threads; decode tok/s, median of {args.rounds}")
    print(f"{'context':>8} {'compiled (' + compiled.step_kind + ')':>18} {'eager':>8}"
          + (f" {'batch engine, 1 seq':>20}" if args.batch_engine else ""))
    for n in (int(c) for c in args.contexts.split(",")):
        prompt = ids[:n]
        fast, _ = generator_row(compiled, prompt, args.tokens, args.rounds)
        slow, want = generator_row(eager, prompt, args.tokens, args.rounds)
        line = f"{n:>8} {fast:18.1f} {slow:8.1f}"
        if args.batch_engine:
            paged, got = engine_row(lm.model, prompt, args.tokens, args.rounds)
            line += f" {paged:20.1f}" + ("" if got == want else "  (tokens differ from the Generator's)")
        print(line)
    if args.static_package:
        static_vs_generic(lm.model, 128, 5)


if __name__ == "__main__":
    main()
