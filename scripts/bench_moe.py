#!/usr/bin/env python
"""Decode and prefill of a synthetic Qwen3-MoE on the CPU through the batch engine, as `localllm run`
drives it, with the expert kernel of each kind side by side in interleaved rounds.

    .venv/bin/python scripts/bench_moe.py [--layers 12 --dim 1024 --experts 64 --active 8 --expert-size 256]
        [--prompt-tokens 128 --tokens 32 --rounds 3] [--kernels moe-blocks-cpu[,reference]] [--compile]
        [--file results/moe-q4km.gguf] [--llama-bench PATH/llama-bench]

The model is a random-weight transformers Qwen3-MoE (the defaults: 12 layers, dim 1024, 64 experts of
256, 8 active: ~0.7B parameters, ~0.1B active), written as a GGUF laid out as llama.cpp's converter
writes it (tests/test_gguf_moe.py's writer) in a Q4_K_M-like mix: experts' gate and up, attention's
q, k and o and the embedding in Q4_K, the experts' down, attention's v and the head in Q6_K (quantized
here by round-to-nearest K-quant quantizers: llama-quantize's search is not needed for speed).

Each round runs, for each expert kernel named (``--kernels``, each MoE layer prepared for it;
``reference``, the torch loop over experts, takes minutes a round at these sizes), one
generation of --tokens tokens after a prompt of --prompt-tokens random tokens (full prefill, greedy, no
speculation, no prefix cache: `run`'s engine); rows show the medians over the rounds of prefill tok/s,
decode tok/s, and the weight bytes a decode step reads a second (the dense weights, and the active
experts' only: ``--active`` of ``--experts`` a layer). With --llama-bench, llama.cpp's pp/tg on the same
file in the same rounds. Output: a table on stdout, JSON to results/bench_moe.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.test_gguf_moe's writer


def q4_k(x: np.ndarray) -> np.ndarray:
    """(rows, in) float32 -> Q4_K blocks (rows, in/256 * 144) uint8, round to nearest: per 32 columns
    a 6-bit scale and min of an fp16 super-block scale d and dmin (ggml's layout)."""
    rows, k = x.shape
    v = x.reshape(rows, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(v.min(-1), 0.0)
    scale, mins = (v.max(-1) - lo) / 15.0, -lo  # (r, nb, 8), both >= 0
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    eff, off = (df * sc)[..., None], (dminf * mn)[..., None]
    q = np.clip(np.round(np.divide(v + off, eff, out=np.zeros_like(v), where=eff > 0)), 0, 15).astype(np.uint8)
    q = q.reshape(rows, k // 256, 4, 2, 32)  # (chunk c, half, l): weight c*64 + half*32 + l
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, k // 256, 128)
    s = np.zeros((rows, k // 256, 12), np.uint8)
    s[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    s[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    out = np.concatenate([d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2), s, qs], -1)
    return out.reshape(rows, -1)


def q6_k(x: np.ndarray) -> np.ndarray:
    """(rows, in) float32 -> Q6_K blocks (rows, in/256 * 210) uint8, round to nearest: per 16 columns an
    int8 scale of an fp16 super-block scale d, codes q - 32 in -32..31 (ggml's layout)."""
    rows, k = x.shape
    v = x.reshape(rows, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(v).max(-1) / 31.0  # (r, nb, 16)
    d = (scale.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127).astype(np.int8)
    eff = (df * sc)[..., None]
    q = (np.clip(np.round(np.divide(v, eff, out=np.zeros_like(v), where=eff != 0)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, k // 256, 2, 4, 32)  # (h, s, l): weight h*128 + s*32 + l
    low, high = q & 0x0F, q >> 4
    ql = np.zeros((rows, k // 256, 2, 2, 32), np.uint8)  # (h, s % 2, l)
    qh = np.zeros((rows, k // 256, 2, 32), np.uint8)
    for s in range(4):
        ql[:, :, :, s % 2] |= low[:, :, :, s] << (4 * (s // 2))
        qh |= high[:, :, :, s] << (2 * s)
    out = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
                          d.view(np.uint8).reshape(rows, -1, 2)], -1)
    return out.reshape(rows, -1)


def kquant(type_name: str):
    """A writer entry (tests/test_gguf_moe.py): a tensor of any rank -> (type, its blocks)."""
    fn = {"Q4_K": q4_k, "Q6_K": q6_k}[type_name]

    def make(value: np.ndarray) -> tuple[str, np.ndarray]:
        flat = value.reshape(-1, value.shape[-1])
        return type_name, fn(flat).reshape(*value.shape[:-1], -1)

    return make


#: The Q4_K_M-like mix, by GGUF name suffix (first match wins).
Q4_K_M = {"ffn_down_exps.weight": "Q6_K", "_exps.weight": "Q4_K", "attn_v.weight": "Q6_K", "output.weight": "Q6_K",
          "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_output.weight": "Q4_K", "token_embd.weight": "Q4_K"}


def make_file(path: Path, a: argparse.Namespace) -> Path:
    import gguf
    import transformers

    from tests.test_gguf_moe import write_moe_gguf

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=4 * a.dim, num_hidden_layers=a.layers,
        num_attention_heads=a.dim // 64, num_key_value_heads=max(1, a.dim // 256), head_dim=64,
        num_experts=a.experts, num_experts_per_tok=a.active, moe_intermediate_size=a.expert_size,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    types = {k: kquant(v) for k, v in Q4_K_M.items()}
    write_moe_gguf(model, path, types)
    # the quantizers' blocks decode as gguf does: a spot check of one expert tensor
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    got = gguf.quants.dequantize(t.data[0], t.tensor_type)
    want = model.model.layers[0].mlp.experts.gate_up_proj[0, : a.expert_size].detach().numpy()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB), Q4_K relative error {err:.3f}", file=sys.stderr)
    if not err < 0.2:
        raise SystemExit("the Q4_K quantizer's blocks do not decode to the weights")
    return path


def read_bytes_per_token(model: torch.nn.Module, active: int) -> int:
    """Weight bytes a one-row decode step reads: every dense weight, the active experts' share of the
    expert weights, one embedding row."""
    from localllm.bench.runs import decode_read_bytes
    from localllm.quant.experts import QuantExperts

    total = decode_read_bytes(model)
    for m in model.modules():
        if isinstance(m, QuantExperts):
            b = sum(t.numel() * t.element_size() for t in m._buffers.values() if t is not None)
            total -= b - b * active // m.n_experts
    return total


def llama_bench(exe: str, path: Path, a: argparse.Namespace) -> dict[str, float]:
    out = subprocess.run([exe, "-m", str(path), "-p", str(a.prompt_tokens), "-n", str(a.tokens), "-t", str(a.threads),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    return {"prefill_tps": pp, "decode_tps": tg}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--active", type=int, default=8)
    p.add_argument("--expert-size", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--kernels", default="moe-blocks-cpu")
    p.add_argument("--compile", action="store_true", help="decode through the compiled step (built first)")
    p.add_argument("--file", type=Path, default=ROOT / "results" / "moe-q4km.gguf")
    p.add_argument("--llama-bench", default=None)
    p.add_argument("--json", type=Path, default=ROOT / "results" / "bench_moe.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from localllm.loaders.load import load_model
    from localllm.runtime.engine import sequence_engine
    from localllm.runtime.moe import Experts
    from localllm.runtime.sampling import SamplingParams

    path = a.file if a.file.exists() else make_file(a.file, a)
    kernels = a.kernels.split(",")
    engines, per_token = {}, {}
    for k in kernels:
        lm = load_model(str(path))
        for m in lm.model.modules():
            if isinstance(m, Experts):
                m.down.kernel = None  # prepared at load by the engine's choice: redo it with the one named
                m.prepare(lm.model.dtype, kernel=k, check=False)
        used = {m.down.kernel.name for m in lm.model.modules() if isinstance(m, Experts)}
        engines[k] = sequence_engine(lm.model, a.prompt_tokens + a.tokens + 16, compile=a.compile,
                                     prefix_cache=False, speculate=False)
        per_token[k] = read_bytes_per_token(lm.model, a.active)
        print(f"{k}: experts run by {', '.join(sorted(used))}; compiled step: {bool(engines[k].compiled)}",
              file=sys.stderr)
    rng = np.random.default_rng(0)
    prompt = rng.integers(300, a.vocab, a.prompt_tokens).tolist()
    greedy = SamplingParams(temperature=0)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kernels}
    if a.llama_bench:
        runs["llama.cpp"] = []
    for r in range(a.rounds + 1):  # round 0 warms up
        for k, engine in engines.items():
            h = engine.submit(prompt, greedy, max_tokens=a.tokens)  # no stop ids: all --tokens
            if len(h.result()) != a.tokens:
                raise SystemExit(f"{k}: generated {len(h.result())} tokens, not {a.tokens}")
            st = h.stats
            if r:
                runs[k].append({"prefill_tps": st.prompt_tps, "decode_tps": st.decode_tps})
        if a.llama_bench and r:
            runs["llama.cpp"].append(llama_bench(a.llama_bench, path, a))
    rows = {}
    for k, rs in runs.items():
        pre = statistics.median(x["prefill_tps"] for x in rs)
        dec = statistics.median(x["decode_tps"] for x in rs)
        rows[k] = {"prefill_tps": pre, "decode_tps": dec,
                   "read_gb_s": dec * per_token[k] / 1e9 if k in per_token else None, "rounds": rs}
    print(f"synthetic Qwen3-MoE: {a.layers} layers, dim {a.dim}, {a.experts} experts of {a.expert_size}, "
          f"{a.active} active; {path.name}; prompt {a.prompt_tokens}, {a.tokens} tokens, {a.threads} threads, "
          f"medians of {a.rounds} rounds")
    print(f"{'kernel':<16} {'prefill tok/s':>14} {'decode tok/s':>13} {'read GB/s':>10}")
    for k, row in rows.items():
        gb = f"{row['read_gb_s']:.1f}" if row["read_gb_s"] is not None else "-"
        print(f"{k:<16} {row['prefill_tps']:>14.1f} {row['decode_tps']:>13.1f} {gb:>10}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows,
                                  "date": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    main()
