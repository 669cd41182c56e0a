#!/usr/bin/env python
"""Single-stream decode speed against the context already in the KV pool, compiled step vs eager
steps, through the one generation path (the batch engine of one sequence that `run` uses).

    .venv/bin/python scripts/decode_by_context.py [--model smollm2] [--contexts 16,128,512,1024] [--threads 2]
        [--build] [--speculate on|off]

For each prompt length, --tokens greedy tokens after it (end-of-sequence ignored), medians of
--rounds of the request's decode tok/s (after the first token: ``GenerationStats.decode_tps``, what
``run --verbose`` prints as the eval rate), on two engines of ``runtime.engine.sequence_engine``:
``compile="auto"`` (the compiled step when the model's is built: ``localllm compile MODEL``, or
``--build`` to build it now, about a minute once; without one its column says "eager") and
``compile=False``. No prefix cache: every round prefills its whole prompt. A row says when the two
engines' greedy tokens differ. The prompt repeats one sentence, which prompt lookup drafts from, so
speculation is off unless ``--speculate on``: the figures are then the decode step's, one token a step.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from localllm.loaders.load import load_model
from localllm.runtime.batch import BatchEngine
from localllm.runtime.engine import sequence_engine
from localllm.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
TEXT = "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp. " * 60


def engine_row(engine: BatchEngine, prompt: list[int], tokens: int, rounds: int) -> tuple[float, list[int]]:
    speeds, out = [], []
    for _ in range(rounds):
        handle = engine.submit(prompt, GREEDY, tokens)  # no stop ids: always ``tokens`` tokens
        out = handle.result()
        speeds.append(handle.stats.decode_tps)
    return statistics.median(speeds), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", default="16,128,512,1024")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--build", action="store_true", help="build the compiled step now if it is missing")
    ap.add_argument("--speculate", choices=["on", "off"], default="off",
                    help="speculative decoding (off: one token a step; the prompt repeats, so drafts would pay)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    contexts = [int(c) for c in args.contexts.split(",")]
    ids = lm.tokenizer.encode(TEXT)
    ids = (ids * (max(contexts) // len(ids) + 1))[: max(contexts)]
    ctx = max(contexts) + args.tokens + 16
    speculate = args.speculate == "on"
    compiled = sequence_engine(lm.model, ctx, compile=True if args.build else "auto", prefix_cache=False,
                               speculate=speculate)
    eager = sequence_engine(lm.model, ctx, prefix_cache=False, speculate=speculate)
    kind = "aot" if compiled.compiled else "eager"
    if not compiled.compiled:
        print(f"note: no compiled step runs ({compiled.compile_note or 'none built: `localllm compile MODEL`, or --build'})")
    print(f"{args.model}, {lm.model.dtype}, {args.threads} threads; decode tok/s, median of {args.rounds}, "
          f"{args.tokens} tokens after the prompt, speculation {args.speculate}")
    print(f"{'context':>8} {'compiled (' + kind + ')':>18} {'eager':>8}")
    for n in contexts:
        prompt = ids[:n]
        fast, got = engine_row(compiled, prompt, args.tokens, args.rounds)
        slow, want = engine_row(eager, prompt, args.tokens, args.rounds)
        print(f"{n:>8} {fast:18.1f} {slow:8.1f}" + ("" if got == want else "  (greedy tokens differ)"))


if __name__ == "__main__":
    main()
