#!/usr/bin/env python
"""The compiled decode step next to eager decode on one model: step time (interleaved) and logit drift.

    .venv/bin/python scripts/compiled_vs_eager.py [--model smollm2] [--quant int4] [--quant-head int8|none]
        [--build]

Three one-sequence batch engines (``runtime.engine.sequence_engine``, what ``run`` uses) on the same
model: eager steps with localllm's paged CPU attention kernel, eager steps with SDPA over the
gathered blocks (``attention="sdpa"``), and the compiled step (the AOTInductor package of
``runtime.compiled_step``, what ``run`` takes once it is built; ``compile="auto"``, or with
``--build`` built now if missing: about a minute once). Without a built package the compiled engine
runs eagerly; its row then says "eager".

Step time: in each of ``--rounds`` rounds every engine in turn takes a prompt of ``--context``
random tokens (after the first round its blocks come from the prefix cache) and times ``--steps``
``engine.step()`` calls, each decoding one token (the positions context .. context + steps - 1
every round), so that the machine's drift falls on all alike; prints the median of the rounds'
median step times. Drift: the same random tokens fed to every engine after the same prompt
(``BatchEngine.forced_logits``): how far each one's logits move from the eager kernel engine's, over
the teacher-forced decode steps (the prefill's logits are eager in all of them and are left out).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localllm.loaders.load import load_model
from localllm.runtime.batch import BatchEngine
from localllm.runtime.engine import sequence_engine
from localllm.runtime.kv_pool import layer_groups, sequence_pool_bytes
from localllm.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
DRIFT_PROMPT = "The history of bridges begins"


def engine(model, ctx: int, compile: bool | str = False, attention: str = "auto") -> BatchEngine:  # type: ignore[no-untyped-def]
    """``sequence_engine(model, ctx, compile)``, with ``attention`` ("sdpa": no paged kernel)."""
    if attention == "auto":
        return sequence_engine(model, ctx, compile)
    chunk = min([ctx, *(g.window for g in layer_groups(model.config) if g.window is not None)])
    budget = sequence_pool_bytes(model.config, model.dtype, ctx, chunk_tokens=chunk)
    return BatchEngine(model, kv_budget_bytes=budget, max_seq_len=ctx,
                       chunk_tokens=chunk, max_running=1, max_waiting=1, attention=attention, compile=compile)


def step_times(eng: BatchEngine, prompt: list[int], steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps after ``prompt`` (its prefill not timed)."""
    handle = eng.submit(prompt, GREEDY, max_tokens=steps + 1)  # no stop ids: every step decodes
    while handle.stats.first_token_at is None:  # prefill, and the first token
        eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    assert handle.stats.finish_reason == "length" and len(handle.take()) == steps + 1, handle.stats.stop_reason
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--quant-head", default=None, help="default: the model's own (a GGUF's Q8_0 head as it is)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128, help="tokens in the pool before the timed steps")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fed", type=int, default=64, help="teacher-forced tokens of the drift check")
    ap.add_argument("--build", action="store_true", help="build the compiled step now if it is missing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, quant=args.quant, quantize_head=False if args.quant_head == "none" else args.quant_head)
    model, n = lm.model, args.context
    drift_prompt = lm.tokenizer.encode(DRIFT_PROMPT)
    ctx = max(n + args.steps + 16, len(drift_prompt) + args.fed + 16)
    compiled = engine(model, ctx, compile=True if args.build else "auto")
    engines = {"eager": engine(model, ctx), "eager, SDPA": engine(model, ctx, attention="sdpa"),
               f"compiled ({'aot' if compiled.compiled else 'eager'})": compiled}
    if not compiled.compiled:
        why = compiled.compile_note or ("no package built for this model: `localllm compile MODEL`, or --build"
                                        if compiled.needs_build else "no package, and an earlier build failed")
        print(f"note: the compiled engine runs eagerly ({why})")
    prompt = torch.randint(0, lm.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    for eng in engines.values():  # warm up (and fill each prefix cache)
        step_times(eng, prompt, 3)
    rounds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, eng in engines.items():
            rounds[name].append(statistics.median(step_times(eng, prompt, args.steps)))
    print(f"{lm.scheme_label}, kernels {dict(lm.kernels)}, {args.threads} threads, context {n}: "
          f"median of {args.rounds} interleaved rounds of {args.steps} engine steps")
    for name, r in rounds.items():
        print(f"  {name:<27} {statistics.median(r) * 1e3:6.2f} ms/step  (rounds {min(r) * 1e3:.2f}-{max(r) * 1e3:.2f})")

    fed = torch.randint(0, lm.config.vocab_size, (args.fed,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {name: eng.forced_logits(drift_prompt, fed) for name, eng in engines.items()}
    ref = logits["eager"][1:]  # the rows after each fed token: decode steps (row 0 is the prefill's)
    for name, got in logits.items():
        if name == "eager":
            continue
        got = got[1:]
        same = (got == ref).all(-1).tolist()
        identical = same.index(False) if False in same else len(same)
        diff = (got - ref).abs()
        top1 = int((got.argmax(-1) == ref.argmax(-1)).sum())
        print(f"{name} drift over {len(fed)} teacher-forced steps: first {identical} identical; |logit diff| "
              f"mean {diff.mean():.3g}, worst {diff.max():.3g}; argmax agrees on {top1}/{len(fed)}")


if __name__ == "__main__":
    main()
