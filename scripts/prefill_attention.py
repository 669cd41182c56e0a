#!/usr/bin/env python
"""A prefill chunk's attention on the CPU: localllm's chunk kernel (reading the paged pool in place)
beside what the engine ran before it (the chunk's history gathered out of its blocks, then torch's
SDPA), at a model's attention shapes and a few chunk lengths.

    .venv/bin/python scripts/prefill_attention.py [--shapes smollm2,gemma3] [--chunks 128,512,1500,200@1000]
                                                  [--threads 2] [--rounds 15]

A chunk ``N@P`` is N query rows after P cached positions (``N`` alone: from position 0), over a
shuffled block table of 16-token blocks. Rounds alternate the two (interleaved, so that the machine's
drift falls on both); the table gives each one's median time, its GFLOP/s (causal: only the scores a
row sees) and the ratio. Under ATEN_CPU_CAPABILITY=avx2 set MKL_ENABLE_INSTRUCTIONS=AVX2 as well, or
SDPA's GEMMs still take MKL's widest code.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from localllm.runtime import cpu_attention
from localllm.runtime.kv_pool import gather

#: kv heads, query heads per kv head, head dim.
SHAPES = {"smollm2": (3, 3, 64), "gemma3": (1, 4, 256), "llama-7b": (32, 1, 128), "qwen2-0.5b": (2, 7, 64)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="smollm2,gemma3", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--chunks", default="128,512,1500,200@1000")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, medians of "
          f"{args.rounds} interleaved rounds")
    print(f"{'shape':10} {'chunk':>10} {'gather+SDPA':>18} {'chunk kernel':>18} {'ratio':>6}")
    for name in args.shapes.split(","):
        kv, g, hd = SHAPES[name]
        if cpu_attention.chunk_kernel(hd) is None:
            raise SystemExit(f"no chunk kernel for head_dim {hd} here")
        for spec in args.chunks.split(","):
            n, _, at = spec.partition("@")
            n, q_pos = int(n), int(at or 0)
            ctx, bs = q_pos + n, 16
            nb = -(-ctx // bs)
            k_pool, v_pool = torch.randn(nb + 8, kv, bs, hd), torch.randn(nb + 8, kv, bs, hd)
            blocks = torch.randperm(nb + 8)[:nb]
            q = torch.randn(n, kv, g, hd)
            scale = hd ** -0.5
            mask = None if q_pos == 0 else torch.arange(ctx)[None, :] <= torch.arange(q_pos, ctx)[:, None]

            def before() -> torch.Tensor:
                ks, vs = gather(k_pool, v_pool, blocks, ctx)
                qq = q.permute(1, 2, 0, 3).reshape(1, kv * g, n, hd)
                return F.scaled_dot_product_attention(qq, ks, vs, attn_mask=mask, is_causal=mask is None,
                                                      scale=scale, enable_gqa=g > 1)

            def kernel() -> torch.Tensor:
                return cpu_attention.paged_chunk_attention(q, k_pool, v_pool, blocks, 0, q_pos, None, scale)

            times: dict[str, list[float]] = {"before": [], "kernel": []}
            for r in range(args.rounds + 2):
                for label, fn in (("before", before), ("kernel", kernel)):
                    t0 = time.perf_counter()
                    fn()
                    if r >= 2:  # two warm-up rounds
                        times[label].append(time.perf_counter() - t0)
            flops = kv * g * hd * 2 * 2 * (n * q_pos + n * (n + 1) / 2)
            t_b, t_k = statistics.median(times["before"]), statistics.median(times["kernel"])
            print(f"{name:10} {spec:>10} {t_b * 1e3:8.2f} ms {flops / t_b / 1e9:4.0f} GF/s "
                  f"{t_k * 1e3:8.2f} ms {flops / t_k / 1e9:4.0f} GF/s {t_b / t_k:5.2f}x")


if __name__ == "__main__":
    main()
