#!/usr/bin/env python
"""What a JSON schema costs a decode step: constrained and free batches side by side.

    .venv/bin/python scripts/constrained_overhead.py [--model PATH] [--batch 1,8] [--tokens 96] [--rounds 3]

For each batch size, rounds alternate a free batch (end tokens ignored, so every sequence runs the
whole length) and a batch held to a schema that forces a long reply (an array of at least 60 strings).
Each arm's figure is the median time of its decode-only steps with every sequence running; the mask's
own time (the grammar's bitmask for each row and its application to the logits) is measured inside
the step. Also the schema's compile time: first (which builds the vocabulary's index too), then from
the cache. JSON to results/constrained_overhead.json (an ignored folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from localllm.loaders.load import load_model
from localllm.paths import default_model_gguf
from localllm.runtime.batch import BatchEngine
from localllm.runtime.chat import encode_chat
from localllm.runtime.constrain import Constraints, json_schema
from localllm.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"animals": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                       "minItems": 60}},
          "required": ["animals"], "additionalProperties": False}
ASK = "List sixty different animals as a JSON object with the key 'animals'. Start with the letter {}."


class MaskClock:
    """Time spent on masks (the grammar's bits, their application), summed per step."""

    def __init__(self) -> None:
        self.pending = 0.0
        self.per_step: list[float] = []

    def wrap(self, fn):  # type: ignore[no-untyped-def]
        def timed(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = fn(*a, **k)
            self.pending += time.perf_counter() - t
            return out

        return timed

    def step_done(self, counted: bool) -> None:
        if counted and self.pending:
            self.per_step.append(self.pending)
        self.pending = 0.0


def run_arm(engine: BatchEngine, prompts: list[list[int]], tokens: int, constraints: Constraints | None,
            clock: MaskClock) -> list[float]:
    """Submit one batch, step it to the end; the times of its decode-only steps with all running."""
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, seed=1)
    grammar = json_schema(SCHEMA)
    for p in prompts:
        c = None if constraints is None else constraints.start(grammar)
        engine.submit(p, params, tokens, stop_ids=(), constraint=c)
    times = []
    while True:
        if not engine.step():
            break
        counted = engine.last_step_prefill_tokens == 0 and len(engine.scheduler.running) == len(prompts)
        if counted:
            times.append(engine.last_step_s)
        clock.step_done(counted)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_gguf()))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lm = load_model(args.model)
    stop = list(dict.fromkeys([*lm.tokenizer.eos_ids, *lm.config.eos_token_ids]))
    constraints = Constraints(lm.tokenizer, stop)
    t0 = time.perf_counter()
    constraints.start(json_schema(SCHEMA))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    constraints.start(json_schema(SCHEMA))
    cached = time.perf_counter() - t0
    # The masks' own time, inside the engine's step.
    import localllm.runtime.batch as batch_module

    clock = MaskClock()
    BatchEngine._grammar_bits = staticmethod(clock.wrap(BatchEngine._grammar_bits))  # type: ignore[method-assign]
    batch_module.apply_masks = clock.wrap(batch_module.apply_masks)  # type: ignore[attr-defined]
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        engine = BatchEngine(lm.model, kv_budget_bytes=256 << 20, max_running=batch, compile="auto", speculate=False)
        prompts = [encode_chat(lm.tokenizer, [{"role": "user", "content": ASK.format("ABCDEFGHIJKLMNOP"[i])}])
                   for i in range(batch)]
        free: list[float] = []
        held: list[float] = []
        clock.per_step.clear()
        for _ in range(args.rounds):
            free += run_arm(engine, prompts, args.tokens, None, clock)
            held += run_arm(engine, prompts, args.tokens, constraints, clock)
        f, h = statistics.median(free), statistics.median(held)
        m = statistics.median(clock.per_step) if clock.per_step else 0.0
        rows.append({"batch": batch, "free_step_ms": f * 1e3, "schema_step_ms": h * 1e3, "ratio": h / f,
                     "mask_ms": m * 1e3, "mask_share": m / f, "steps": [len(free), len(held)],
                     "compiled": engine.compiled})
    print(f"schema compile: first {first * 1e3:.1f} ms (the vocabulary's index included), cached {cached * 1e3:.2f} ms")
    print(f"{'batch':>5} {'free step ms':>13} {'schema step ms':>15} {'ratio':>6} {'mask ms':>8} {'mask share':>11}")
    for r in rows:
        print(f"{r['batch']:>5} {r['free_step_ms']:>13.2f} {r['schema_step_ms']:>15.2f} {r['ratio']:>6.3f} "
              f"{r['mask_ms']:>8.3f} {r['mask_share']:>10.1%}")
    out = ROOT / "results" / "constrained_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "compile_first_s": first, "compile_cached_s": cached,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
