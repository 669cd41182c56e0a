#!/usr/bin/env python
"""The compiled decode steps next to eager decode on one model: step time (interleaved) and logit drift.

    .venv/bin/python scripts/compiled_vs_eager.py [--model smollm2] [--quant int4] [--quant-head int8|none]

Times eager decode and the AOTInductor package (what ``--compile`` runs on the CPU), each with localllm's
CPU attention kernel and with SDPA, and ``torch.compile``'s step with inductor's C++ wrapper and with
its Python wrapper, in ``--rounds`` rounds of ``--steps``
steps each, taken in turn so that the machine's drift falls on all alike; prints the median of the
rounds' median step times. Then feeds the same random tokens to eager and to each compiled step and
prints how far the logits move (see runtime.compile.decode_drift).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localllm.loaders.load import load_model
from localllm.runtime.compile import DecodeFn, compiled_decode, decode_drift
from localllm.runtime.generate import decode_one_token, forward_one_token, prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--quant-head", default=None, help="default: the model's own (a GGUF's Q8_0 head as it is)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache before the timed steps")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, quant=args.quant, quantize_head=False if args.quant_head == "none" else args.quant_head)
    model, n = lm.model, args.context
    cache = model.new_cache(max(n + args.steps + 16, 256))  # once: a compiled step is tied to its cache's shape
    prefill(model, cache, torch.randint(0, lm.config.vocab_size, (1, n)))
    def with_sdpa(step: DecodeFn) -> DecodeFn:
        def run(*a):  # type: ignore[no-untyped-def]
            with model.decode_attention(None):
                return step(*a)
        return run

    steps = {
        "eager": decode_one_token,
        "eager, SDPA": with_sdpa(decode_one_token),
        "AOTInductor package": compiled_decode(forward_one_token, lm.device),
        "AOTInductor, SDPA": with_sdpa(compiled_decode(forward_one_token, lm.device)),
        "torch.compile, C++ wrapper": compiled_decode(forward_one_token, lm.device, aot=False),
        "torch.compile, Py wrapper": compiled_decode(forward_one_token, lm.device, cpp_wrapper=False, aot=False),
    }
    token = torch.tensor([[5]])
    for step in steps.values():  # compile, warm up
        for i in range(3):
            step(model, cache, token, torch.tensor([n + i]), n + i)
    rounds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times = []
            for i in range(args.steps):
                pos = n + i
                t0 = time.perf_counter()
                step(model, cache, token, torch.tensor([pos]), pos)
                times.append(time.perf_counter() - t0)
            rounds[name].append(statistics.median(times))
    print(f"{lm.scheme_label}, kernels {dict(lm.kernels)}, {args.threads} threads, context {n}: "
          f"median of {args.rounds} interleaved rounds")
    for name, r in rounds.items():
        print(f"  {name:<27} {statistics.median(r) * 1e3:6.2f} ms/step  (rounds {min(r) * 1e3:.2f}-{max(r) * 1e3:.2f})")

    fed = torch.randint(0, lm.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    for name in ("AOTInductor package", "torch.compile, C++ wrapper"):
        d = decode_drift(model, cache, lm.tokenizer.encode("The history of bridges begins"), fed, steps[name])
        print(f"{name} drift over {d.steps} teacher-forced steps: first {d.identical} identical; |logit diff| "
              f"mean {d.mean_abs:.3f}, worst {d.max_abs:.3f}; argmax agrees on {d.top1}/{d.steps}")


if __name__ == "__main__":
    main()
