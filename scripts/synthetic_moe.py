#!/usr/bin/env python
"""A random-weight Qwen3-MoE as an HF folder, and (optionally) its GGUF files made by llama.cpp's own
tools, so that localllm and llama.cpp run the very same synthetic model.

    .venv/bin/python scripts/synthetic_moe.py OUT_FOLDER --tokenizer FOLDER [--layers 12 --dim 1024
        --experts 64 --active 8 --expert-size 384] [--llama-cpp PATH/llama.cpp [--types Q4_K_M,...]]

A real 30B MoE cannot be downloaded everywhere; this one has the shape family of Qwen3-30B-A3B (the
defaults: ~1.07B parameters, ~0.18B active a token). The tokenizer (``tokenizer.json`` and its config)
is copied from --tokenizer, e.g. ``localllm export smollm2 FOLDER``'s output, whose pre-tokenizer
llama.cpp's converter knows. With --llama-cpp (a llama.cpp source tree with ``build/bin/llama-quantize``
built), ``convert_hf_to_gguf.py`` writes OUT_FOLDER.bf16.gguf and ``llama-quantize`` each of --types
beside it (OUT_FOLDER.q4_k_m.gguf, ...). The converter needs the ``gguf-py`` of that tree, which this
script puts on its path, and ``sentencepiece`` importable (``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path


def write_folder(out: Path, tokenizer: Path, layers: int, dim: int, experts: int, active: int,
                 expert_size: int) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok_files = [p for p in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
                 if (tokenizer / p).exists()]
    import json

    vocab = json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
    config = Qwen3MoeConfig(
        vocab_size=len(vocab), hidden_size=dim, num_hidden_layers=layers, num_attention_heads=dim // 64,
        num_key_value_heads=max(1, dim // 256), head_dim=64, intermediate_size=4 * expert_size,
        moe_intermediate_size=expert_size, num_experts=experts, num_experts_per_tok=active,
        decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=8192, rope_theta=1e6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    # transformers' init leaves the norms at 1 and projections at std 0.02: a model whose activations
    # stay in range through many layers, which is all a speed comparison needs.
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for p in tok_files:
        shutil.copy2(tokenizer / p, out / p)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e9:.2f}B parameters", file=sys.stderr)


def convert(out: Path, llama_cpp: Path, types: list[str]) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(llama_cpp / "gguf-py"), env.get("PYTHONPATH")]))
    base = out.with_name(out.name + ".bf16.gguf")
    subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(out), "--outtype", "bf16",
                    "--outfile", str(base)], check=True, env=env)
    for t in types:
        dst = out.with_name(f"{out.name}.{t.lower()}.gguf")
        subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(base), str(dst), t], check=True)
        print(f"wrote {dst}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--active", type=int, default=8)
    ap.add_argument("--expert-size", type=int, default=384)
    ap.add_argument("--llama-cpp", type=Path)
    ap.add_argument("--types", default="Q4_K_M")
    a = ap.parse_args(argv)
    if not (a.out / "config.json").exists():
        write_folder(a.out, a.tokenizer, a.layers, a.dim, a.experts, a.active, a.expert_size)
    if a.llama_cpp is not None:
        convert(a.out, a.llama_cpp, [t for t in a.types.split(",") if t])


if __name__ == "__main__":
    main()
