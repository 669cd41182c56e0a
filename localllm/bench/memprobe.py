"""One scheme's memory, measured in a fresh process.

Measured in the bench's own process, a scheme's peak depends on what ran before it: the allocator
keeps pages of the previous scheme (freed but not returned, fragmented), so the same int8 load peaks
tens of MB higher after fp32 than alone, and the column's figure says more about the order of
``--quant`` than about the scheme. Here each scheme gets a new interpreter:

1. import torch, localllm and the libraries the scheme's kernels need (bitsandbytes for nf4),
   and build localllm's CPU kernels: fixed per-process costs, the same for any model;
2. take the resident set as the baseline;
3. load the model, prefill ``prompt_tokens`` tokens and generate ``gen_tokens`` greedily in a
   KV cache of ``ctx`` positions, sampling VmRSS every few milliseconds;
4. print the figures as one JSON line on stdout.

``python -m localllm.bench.memprobe REF --quant SCHEME --prompt-tokens N --gen-tokens N --ctx N
[--device cpu] [--quant-head SCHEME|none] [--threads N]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from localllm.errors import LocalLLMError


def probe_command(ref: str, scheme: str, prompt_tokens: int, gen_tokens: int, ctx: int, device: str,
                  quant_head: str | bool | None, threads: int | None, kv_dtype: str = "16bit") -> list[str]:
    cmd = [sys.executable, "-m", "localllm.bench.memprobe", ref, "--quant", scheme,
           "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens), "--ctx", str(ctx),
           "--device", device]
    if quant_head is not None:
        cmd += ["--quant-head", quant_head or "none"]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    if kv_dtype != "16bit":
        cmd += ["--kv-cache", kv_dtype]
    return cmd


def probe_memory(ref: str, scheme: str, prompt_tokens: int, gen_tokens: int, ctx: int, device: str = "cpu",
                 quant_head: str | bool | None = None, threads: int | None = None,
                 kv_dtype: str = "16bit") -> dict[str, Any]:
    """The figures of :func:`measure` for one scheme, from a child process (see the module's docstring)."""
    cmd = probe_command(ref, scheme, prompt_tokens, gen_tokens, ctx, device, quant_head, threads, kv_dtype)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LocalLLMError(f"the memory probe for {scheme} failed: {last}",
                            "run it alone to see why: " + " ".join(cmd[1:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def _prepare(scheme: str) -> dict[str, int]:
    """Import what the scheme's kernels need and build localllm's CPU kernels; the RSS each took
    (``library_bytes`` of the memory figures: reported, not counted in the peak)."""
    from localllm import native
    from localllm.bench.meters import rss_bytes
    from localllm.quant.kernels import LIBRARY as INT8
    from localllm.runtime.cpu_attention import LIBRARY as ATTENTION

    start = rss_bytes()
    for lib in (ATTENTION, INT8):
        native.available(lib)
    costs = {"kernels": rss_bytes() - start}
    if scheme == "nf4":
        from localllm.quant.formats import quiet_bitsandbytes

        import torch

        before = rss_bytes()
        with quiet_bitsandbytes():  # its import and first calls (lazy set-up) are nf4's fixed cost
            import bitsandbytes
            import bitsandbytes.functional as bnbf

            w = torch.randn(64, 64, dtype=torch.bfloat16)
            q, state = bnbf.quantize_4bit(w, quant_type="nf4")
            for rows in (1, 16):
                bitsandbytes.matmul_4bit(torch.randn(rows, 64, dtype=torch.bfloat16), q.t(), quant_state=state)
        costs["bitsandbytes"] = rss_bytes() - before
    return costs


def measure(ref: str, scheme: str, prompt_tokens: int, gen_tokens: int, ctx: int, device: str,
            quant_head: str | bool | None, kv_dtype: str = "16bit") -> dict[str, Any]:
    """Peak RSS growth of loading ``ref`` as ``scheme`` and generating, over the prepared baseline."""
    import torch

    from localllm.bench.meters import RSSMeter, release_memory
    from localllm.bench.runs import kv_cache_figures, memory_figures
    from localllm.bench.settings import read_text
    from localllm.loaders.load import load_model, load_tokenizer, open_checkpoint
    from localllm.loaders.spec import LoadSpec
    from localllm.quant.formats import QUANT_SCHEMES
    from localllm.runtime.engine import sequence_engine
    from localllm.runtime.sampling import SamplingParams

    ckpt = open_checkpoint(ref)
    _, body = read_text(None)
    prompt = load_tokenizer(ckpt).encode(body)[:prompt_tokens]
    del ckpt
    fixed = _prepare(scheme)
    release_memory(torch.device(device))
    meter = RSSMeter()
    meter.start()
    head = quant_head if scheme in QUANT_SCHEMES else None
    lm = load_model(LoadSpec(ref, device, quant=scheme, quantize_head=head, kv_dtype=kv_dtype))
    after_load = meter.now()
    engine = sequence_engine(lm.model, ctx, kv_dtype=kv_dtype)
    n = len(engine.submit(prompt, SamplingParams(temperature=0), max_tokens=gen_tokens).result())
    if n != gen_tokens:
        raise LocalLLMError(f"generated {n} tokens, expected {gen_tokens}", "report this as a bug")
    memory = {**meter.stop(), "after_load_bytes": after_load, "process": "fresh", "library_bytes": fixed}
    memory["method"] += "; in a fresh process per scheme, after imports and kernel builds"
    kv = kv_cache_figures(lm.config, lm.model.dtype, ctx, kv_dtype)
    return memory_figures(memory, lm.weight_bytes, kv["ctx_bytes"])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m localllm.bench.memprobe", description=__doc__.splitlines()[0])
    p.add_argument("ref")
    p.add_argument("--quant", required=True)
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--gen-tokens", type=int, required=True)
    p.add_argument("--ctx", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quant-head", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache", default="16bit")
    a = p.parse_args(argv)
    from localllm.threads import set_threads

    set_threads(a.threads)
    head: str | bool | None = None if a.quant_head is None else (False if a.quant_head == "none" else a.quant_head)
    try:
        figures = measure(a.ref, a.quant, a.prompt_tokens, a.gen_tokens, a.ctx, a.device, head, a.kv_cache)
    except LocalLLMError as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
