"""A MoE on a GPU with its experts placed three ways (scripts/gpu_checks.sh's MoE row): all on the GPU,
the first half of the layers' experts in CPU RAM (``--n-cpu-moe``), all of them there (``--cpu-moe``).

A random-weight Qwen3-MoE of a small 30B-A3B shape (transformers, bf16 safetensors) is loaded as int4
each way; per placement: load time, where the experts went, prefill tok/s of a 128-token prompt and
decode tok/s of 64 greedy tokens (medians of interleaved rounds). Figures to stdout and $OUT/moe.json.

    python scripts/moe_gpu.py --out results/gpu [--layers 8 --experts 64 --active 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_folder(folder: Path, layers: int, experts: int, active: int, dim: int, expert_size: int) -> Path:
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=32000, hidden_size=dim, intermediate_size=4 * dim,
                                      moe_intermediate_size=expert_size, num_hidden_layers=layers,
                                      num_attention_heads=16, num_key_value_heads=4, head_dim=dim // 16,
                                      num_experts=experts, num_experts_per_tok=active, norm_topk_prob=True,
                                      max_position_embeddings=4096, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer with no merges: the folder is complete (the prompts are token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def measure(engine, prompt: list[int], new: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(prefill tok/s, decode tok/s) of one greedy request on ``engine``."""
    from localllm.runtime.sampling import SamplingParams

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    handle = engine.submit(prompt, SamplingParams(temperature=0), max_tokens=new)
    while engine.step():
        pass
    s = handle.stats
    prefill = len(prompt) / (s.first_token_at - s.submitted_at)
    decode = (len(s.token_times) - 1) / (s.token_times[-1] - s.token_times[0])
    return prefill, decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/gpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--active", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--expert-size", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (placement does nothing there)")
    args = ap.parse_args()
    from localllm.loaders.load import load_model
    from localllm.runtime.batch import BatchEngine

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = {"all on GPU": {"n_cpu_moe": 0}, f"--n-cpu-moe {args.layers // 2}": {"n_cpu_moe": args.layers // 2},
             "--cpu-moe": {"cpu_moe": True}}
    prompt = [(i * 7919) % 31000 + 100 for i in range(128)]
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = make_folder(Path(tmp), args.layers, args.experts, args.active, args.dim, args.expert_size)
        print(f"random Qwen3-MoE ({args.layers} layers, {args.experts} experts, {args.active} active, dim {args.dim}) "
              f"made in {time.perf_counter() - t0:.0f} s", flush=True)
        engines = {}
        for name, options in cases.items():
            lm = load_model(str(folder), device=args.device, quant="int4", **options)
            engine = BatchEngine(lm.model, kv_budget_bytes=256 << 20, max_running=1)
            measure(engine, prompt[:16], 4)  # warm-up (Triton compiles)
            engines[name] = (lm, engine)
            figures[name] = {"load_s": round(lm.load_s, 2), "placement": lm.placement.describe() if lm.placement else None,
                             "kernels": dict(lm.kernels), "prefill": [], "decode": []}
            print(f"{name}: loaded in {lm.load_s:.1f} s; " + " | ".join(figures[name]["placement"] or []), flush=True)
        for _ in range(args.rounds):  # interleaved rounds
            for name, (lm, engine) in engines.items():
                p, d = measure(engine, prompt, 64)
                figures[name]["prefill"].append(p)
                figures[name]["decode"].append(d)
    print(f"{'placement':<16} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, f in figures.items():
        f["prefill_median"], f["decode_median"] = statistics.median(f["prefill"]), statistics.median(f["decode"])
        print(f"{name:<16} {f['prefill_median']:>14.1f} {f['decode_median']:>13.1f}")
    (out / "moe.json").write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu", **figures}, indent=1))


if __name__ == "__main__":
    main()
