#!/usr/bin/env python
"""Each of localllm's weight schemes next to llama.cpp's nearest type, made from one float model, on the
CPU, in interleaved rounds.

    .venv/bin/python scripts/vs_llamacpp_schemes.py --llama-bench PATH/llama-bench --model FOLDER_OR_GGUF \\
        --pair fp16=F16.gguf --pair bf16=BF16.gguf --pair int8=Q8_0.gguf --pair int4=Q4_0.gguf [--rounds 3]

MODEL is the float model localllm makes each scheme from (`run MODEL --quant SCHEME`: a folder of
float safetensors, or a float GGUF); each pair names the GGUF llama.cpp's own tools made of the same
model in its nearest type (`convert_hf_to_gguf.py --outtype f16|bf16|q8_0`, `llama-quantize ... Q4_0`;
from a quantized GGUF, `llama-quantize --allow-requantize FILE F16` first). A round runs, for each
pair, llama-bench on its file, then `localllm run MODEL --quant SCHEME --compile --speculate off`
(scripts/vs_llamacpp.py's rows: the same prompt of exactly --prompt-tokens tokens, --tokens generated);
the table shows each row's median over the rounds, the ratio to llama.cpp, the weights localllm held
and the weight bytes its decode read a second (weights x decode tok/s, the figure a scheme's kernels
are judged by), and the kernels `run --verbose` named. Each scheme's compiled step is built by a
warm-up run before the first round (not timed). JSON: results/vs_llamacpp_schemes.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from vs_llamacpp import exact_prompt, hold_libraries_to_capability, llama_row, localllm_row  # noqa: E402

UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9}


def size_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench binary")
    ap.add_argument("--model", required=True, help="the float model localllm quantizes (folder or GGUF)")
    ap.add_argument("--pair", action="append", required=True, metavar="SCHEME=FILE.gguf",
                    help="a localllm scheme and llama.cpp's file of the nearest type (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "vs_llamacpp_schemes.json")
    args = ap.parse_args()
    pairs: dict[str, str] = {}
    for item in args.pair:
        scheme, sep, gguf = item.partition("=")
        if not sep or not Path(gguf).is_file():
            ap.error(f"--pair {item!r}: write it as SCHEME=FILE.gguf, with a file that exists")
        pairs[scheme] = gguf
    hold_libraries_to_capability()
    prompt = exact_prompt(args.model, args.prompt_tokens)
    flags = {s: ["--quant", s, "--compile", "--speculate", "off"] for s in pairs}
    for scheme in pairs:  # builds each scheme's compiled step: not a round's figure
        localllm_row(args.model, prompt, 4, args.threads, flags[scheme])
    rounds: dict[str, list[dict]] = {f"{s} / llama.cpp": [] for s in pairs} | {s: [] for s in pairs}
    for r in range(args.rounds):
        for scheme, gguf in pairs.items():
            rounds[f"{scheme} / llama.cpp"].append(llama_row(args.llama_bench, gguf, args.prompt_tokens,
                                                             args.tokens, args.threads))
            rounds[scheme].append(localllm_row(args.model, prompt, args.tokens, args.threads, flags[scheme]))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    def median(rows: list[dict], key: str) -> float:
        return statistics.median(float(row[key]) for row in rows)

    print(f"{Path(args.model).name}, {args.threads} threads, {args.prompt_tokens}-token prompt, {args.tokens} "
          f"generated tokens, medians of {args.rounds} interleaved rounds")
    print(f"{'scheme (llama.cpp file)':34} {'weights':>8} {'prefill tok/s':>22} {'decode tok/s':>22} {'GB/s':>5}  kernels")
    table = {}
    for scheme, gguf in pairs.items():
        ours, theirs = rounds[scheme], rounds[f"{scheme} / llama.cpp"]
        row = {k: median(ours, k) for k in ("prefill_tok_s", "decode_tok_s")}
        base = {k: median(theirs, k) for k in ("prefill_tok_s", "decode_tok_s")}
        weights = ours[0]["weights"]
        rate = size_bytes(weights) * row["decode_tok_s"] / 1e9 if weights != "?" else float("nan")
        table[scheme] = {"localllm": row, "llama.cpp": base, "weights": weights, "gb_s": rate,
                         "kernels": ours[0]["kernels"], "step": ours[0]["step"], "gguf": gguf}
        pre = f"{row['prefill_tok_s']:.1f} / {base['prefill_tok_s']:.1f} ({row['prefill_tok_s'] / base['prefill_tok_s']:.2f}x)"
        dec = f"{row['decode_tok_s']:.1f} / {base['decode_tok_s']:.1f} ({row['decode_tok_s'] / base['decode_tok_s']:.2f}x)"
        print(f"{scheme + ' (' + Path(gguf).name + ')':34} {weights:>8} {pre:>22} {dec:>22} {rate:5.1f}  "
              f"{ours[0]['kernels']} [{ours[0]['step']}]")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": args.model, "threads": args.threads, "tokens": args.tokens,
                                     "prompt_tokens": args.prompt_tokens, "rounds": rounds, "table": table},
                                    indent=2))
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
