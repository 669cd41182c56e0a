#!/usr/bin/env python
"""How far each matmul kernel moves a model's predictions from the file's own weights in fp32:
teacher-forced over the same tokens (``runtime.quality.compare``: mean KL divergence, top-1 agreement,
perplexity), with at most two models in memory. What an opt-in lossy kernel (``--kernel
int4-q8-cpu``) costs, beside the default's, which should stay within fp32 rounding.

    .venv/bin/python scripts/kernel_quality.py [--model smollm2] [--kernels default,int4-q8-cpu]
                                               [--tokens 256] [--text FILE]
"""

from __future__ import annotations

import argparse

from localllm.bench.settings import read_text
from localllm.loaders.load import load_model
from localllm.runtime.quality import compare


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kernels", default="default,int4-q8-cpu", help="comma-separated; default = the automatic choice")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--text", default=None, help="a UTF-8 file (default: the bench's evaluation text)")
    args = ap.parse_args(argv)
    reference = load_model(args.model, device="cpu", quant="fp32")  # every tensor as the file defines it
    ids = reference.tokenizer.encode(read_text(args.text)[1])[: args.tokens + 1]
    print(f"{args.model}: {len(ids) - 1} predicted tokens against the file's weights in fp32")
    print(f"{'kernel':<16} {'KL divergence':>14} {'top-1':>7} {'ppl ratio':>10}   kernels used")
    for name in args.kernels.split(","):
        lm = load_model(args.model, device="cpu", kernel=None if name == "default" else name)
        q = compare(reference.model, {name: lm.model}, ids, window=len(ids))[name]
        used = ", ".join(f"{k} x{n}" for k, n in sorted(lm.kernels.items()))
        print(f"{name:<16} {q.kld:>14.3g} {q.top1:>7.3f} {q.ppl_ratio:>10.4f}   {used}", flush=True)
        del lm


if __name__ == "__main__":
    main()
