#!/usr/bin/env python
"""The bench on a random-weight model of Llama-2-7B's shapes, made directly on the GPU (no download).

    .venv/bin/python scripts/bench_gpu.py [--quant fp16,int8,int4,nf4] [--runs 5] [--out results/bench-gpu]
    .venv/bin/python scripts/bench_gpu.py --device cpu --shape tiny     # the same logic, small, on the CPU

Each scheme's model is built on ``meta`` and every tensor is created on the device and quantized
there, one at a time (localllm.bench.random_model); the measurements are those of ``localllm bench``
(localllm.bench.run_bench): load, peak memory, TTFT, prefill and decode speed, decode bandwidth as a
fraction of the bandwidth measured in the same run. Quality is skipped: on random weights
perplexity means nothing. Writes bench.json (localllm.bench's schema plus elapsed_s), bench.png
(when matplotlib is installed) and table.txt into --out; the table also goes to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from localllm import bench
from localllm.errors import LocalLLMError
from localllm.loaders.load import resolve_device
from localllm.runtime.config import ModelConfig
from localllm.runtime.kv_pool import cache_bytes

SHAPES = {
    # Llama-2-7B: 4096 hidden, 32 layers, 32 heads (no GQA), 11008 MLP, 32000 vocab, untied head.
    "7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008,
               max_seq_len=4096),
    # The same structure, small enough for a CPU test in seconds.
    "tiny": dict(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_size=512,
                 max_seq_len=1024),
}
SKIPPED = "random weights: perplexity is meaningless"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (with --shape tiny)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--quant", default="fp16,int8,int4,nf4", help="comma-separated schemes")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--compile", action="store_true",
                    help="time the compiled decode step (runtime.compiled_step: CPU only, so on CUDA the steps "
                         "run eagerly and the table's notes say 'eager')")
    ap.add_argument("--serving", default="", metavar="LEVELS",
                    help="also the serving bench (uniform workload: 128-token prompts, 128 tokens, then a "
                         "2,000-token prompt beside the most streams) at these concurrency levels, e.g. 1,8,16")
    ap.add_argument("--serving-quant", default="int4", help="the scheme the serving bench runs (default int4)")
    ap.add_argument("--out", type=Path, help="results folder (default: results/bench-gpu/<shape>-<time>)")
    return ap.parse_args(argv)


def random_prompt(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (n,), generator=g).tolist()


def run(args: argparse.Namespace) -> Path:
    if args.device.startswith("cuda") and not torch.cuda.is_available():  # fail at once, before anything is built
        raise LocalLLMError("no CUDA GPU is visible, and this script measures the 7B shapes on one",
                            "run it on a CUDA machine, or check its logic here with --device cpu --shape tiny")
    device = resolve_device(args.device)
    if device.type != "cuda" and args.shape != "tiny":
        raise LocalLLMError(f"the {args.shape} shape is meant for a GPU (about 13 GB of fp16 weights)",
                            "use --device cuda, or --shape tiny to check the logic on the CPU")
    bench.set_threads(args.threads)
    config = ModelConfig(arch="llama", **SHAPES[args.shape])
    name = "random llama-2-7b shapes" if args.shape == "7b" else f"random {args.shape} llama"
    s = bench.Settings(bench.parse_schemes(args.quant, device), device, args.prompt_tokens, args.gen_tokens,
                       None, args.runs, quality=False, compile=args.compile,
                       notes=[f"{name}: {config.num_parameters() / 1e6:,.1f}M parameters, made on {device} "
                              "tensor by tensor (no download)"])
    bench.check_settings(s)
    plot = True
    try:
        bench.require_matplotlib()
    except LocalLLMError as e:
        plot = False
        print(f"warning: no PNG: {e.one_line()}", file=sys.stderr)
    out = args.out or Path("results") / "bench-gpu" / f"{args.shape}-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"{name}: quality skipped ({SKIPPED}); results to {out}", file=sys.stderr)

    def load(scheme: str):  # type: ignore[no-untyped-def]
        return bench.random_model(config, scheme, device, name)

    prompt = random_prompt(config.vocab_size, args.prompt_tokens)
    t0 = time.perf_counter()
    result = bench.run_bench(load, name, prompt, None, s, "random token ids", len(prompt), quality_skipped=SKIPPED)
    result["elapsed_s"] = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    table = bench.format_table(result)
    if args.serving:
        result["serving"] = serving(config, device, args, name)
        table += "\n\n" + format_serving(result["serving"])
    bench.report(result, out / "bench.json", out / "bench.png" if plot else None)
    (out / "table.txt").write_text(table + "\n")
    print(f"done in {result['elapsed_s']:.0f} s; wrote {out}/table.txt", file=sys.stderr)
    return out


def serving(config: ModelConfig, device: torch.device, args: argparse.Namespace, name: str) -> dict:
    """The serving bench's uniform workload on the random model in ``--serving-quant``: a stream's rate
    against 8 and 16 streams' throughput (on a GPU decode steps read the weights once for the batch)."""
    from localllm.bench import serving as sv

    levels = sv.parse_levels(args.serving, "uniform")
    lm = bench.random_model(config, args.serving_quant, device, name)
    # every stream's 256 positions and the long prompt at once, with a block's slack each
    budget = (cache_bytes(config, 256 + 32, lm.model.dtype, batch=max(levels) + 1)
              + cache_bytes(config, 2048 + 32, lm.model.dtype))
    s = sv.ServingSettings("uniform", levels, prompt_tokens=128, gen_tokens=128, long_prompt_tokens=2000,
                           kv_budget_bytes=budget, speculate="off")
    t0 = time.perf_counter()
    figures = sv.run_serving(lm.model, None, random_prompt(config.vocab_size, 8192, seed=1), s,
                             lambda line: print(line, file=sys.stderr))
    return {"workload": "uniform", "model": name, "scheme": args.serving_quant, "kv_budget_bytes": budget,
            "elapsed_s": time.perf_counter() - t0, **figures}


def format_serving(result: dict) -> str:
    rows = {r["level"]: r for r in result["concurrency"]}
    lines = [f"serving ({result['scheme']}, uniform: 128-token prompts, 128 tokens each):"]
    for level, r in rows.items():
        ratio = f" ({r['throughput_tok_s'] / rows[1]['throughput_tok_s']:.2f}x one stream)" if 1 in rows else ""
        lines.append(f"  {level:>2} streams: {r['throughput_tok_s']:8.1f} tok/s{ratio}, TTFT p50 "
                     f"{r['ttft_ms']['p50']:.0f} ms, ITL p50 {r['itl_ms']['p50']:.1f} ms, decode step "
                     f"{r['decode_step_ms']['p50']:.2f} ms")
    long = result["comparison"]["with_long_prompt"]
    if long["long_prompt_ttft_ms"] is not None:
        lines.append(f"  a {long['long_prompt_tokens']}-token prompt beside {long['level']} streams: TTFT "
                     f"{long['long_prompt_ttft_ms']:.0f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(argv))
    except LocalLLMError as e:
        print(f"Error: {e.one_line()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
