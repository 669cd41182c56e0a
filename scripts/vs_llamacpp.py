#!/usr/bin/env python
"""localllm's `run` next to llama.cpp on the same GGUF file, on the CPU, in one run.

    .venv/bin/python scripts/vs_llamacpp.py --llama-bench PATH/llama-bench [--model FILE.gguf] [--threads 2]

llama.cpp is not a dependency: build its `llama-bench` yourself (its source ships in the
`llama-cpp-python` sdist, under vendor/llama.cpp: `cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON`,
then `cmake --build build -j --target llama-bench`), or leave --llama-bench out for localllm's rows only.

Rounds are interleaved (llama-bench once, then each localllm variant), so that the machine's drift
falls on all alike; the table shows each row's median over the rounds. localllm's rows are the CLI
itself (`localllm run FILE PROMPT --raw -n N --temperature 0 --verbose`, its own figures): the default
(what a user gets: the compiled step when one is built, which `localllm compile` or set-up does),
`--no-compile` (eager) and `--compile`. The prompt is a text of exactly --prompt-tokens tokens.
llama-bench's pp/tg tests: prefill of that many tokens into an empty context; generation of --tokens
tokens after a context of --prompt-tokens (its -d), as localllm's follow their prompt.

`--also LABEL=COMMAND` (repeatable) adds a row that runs COMMAND in place of this checkout's CLI, with
the first --variants row's flags (so `--variants default-nospec,...` compares speculation off on both
sides; `--also-variant default` for a checkout that has no `--speculate`), in the same interleaved rounds: a before/after of two checkouts, e.g.
`--also "before=env PYTHONPATH=/tmp/oldpkg LOCALLLM_HOME=/tmp/home-old python -m localllm"`, where
/tmp/oldpkg holds the other checkout as an importable `localllm` (its compiled steps built in
its own LOCALLLM_HOME). Every row runs from the filesystem's root, so that `python -m localllm`
imports what PYTHONPATH names, never the current folder's package.

Under `ATEN_CPU_CAPABILITY=avx2` (or `default`), the machine a user without AVX-512 has is played in
full: torch's own kernels and localllm's take the narrower path by that variable, and this script
holds MKL and oneDNN (which torch calls for SDPA's and fp32 linears' GEMMs, and which read only their
own variables) to the same instructions with MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA, unless
they are set already. Build llama-bench for that capability too (-DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_AVX512=OFF for avx2).

The JSON goes to results/vs_llamacpp.json (an ignored folder) unless --json says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a notebook and "
        "a flask of tea. From the gallery he could see the harbour, the fishing boats coming home, the gulls "
        "circling the breakwater and, far out, the grey line where the sea met the sky. He wrote down the wind, "
        "the swell, the ships that passed and anything else that seemed worth remembering. ") * 40
VARIANTS = {"default": [], "--no-compile": ["--no-compile"], "--compile": ["--compile"],
            "q8": ["--kernel", "int4-q8-cpu"],
            # speculation off: llama-bench's tg does not speculate, and this script's prompt repeats one
            # paragraph, which prompt lookup drafts from; these rows compare the kernels alone
            "default-nospec": ["--speculate", "off"], "q8-nospec": ["--kernel", "int4-q8-cpu", "--speculate", "off"]}


def exact_prompt(model: str, n: int) -> str:
    """A text that `run --raw` turns into exactly ``n`` prompt tokens (start-of-text token included)."""
    from localllm.loaders.load import load_model

    tok = load_model(model, device="cpu").tokenizer
    overhead = len(tok.encode(""))
    ids = tok.encode(TEXT)[overhead:]
    for extra in range(0, 8):  # decoding and encoding again may merge a token at the cut
        text = tok.decode(ids[: n - overhead + extra])
        if len(tok.encode(text)) == n:
            return text
    raise SystemExit(f"could not make a prompt of exactly {n} tokens")


def localllm_row(model: str, prompt: str, tokens: int, threads: int, flags: list[str],
                 cli: list[str] | None = None) -> dict[str, float | str]:
    cmd = [*(cli or [str(ROOT / ".venv/bin/localllm")]), "run", model, prompt, "--raw", "-n", str(tokens),
           "--temperature", "0", "--verbose", "--threads", str(threads), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd="/").stderr

    def figure(label: str) -> float:
        m = re.search(rf"^{label}:\s+([\d.]+)", out, re.M)
        if not m:
            raise SystemExit(f"no '{label}' in localllm's output:\n{out}")
        return float(m.group(1))

    step = re.search(r"^decode step: (\S+)", out, re.M)
    weights = re.search(r"^weights: .*?, ([\d.]+ [KMG]B) in memory; kernels: (.*)$", out, re.M)
    return {"prefill_tok_s": figure("prompt eval rate"), "decode_tok_s": figure("eval rate"),
            "prompt_tokens": figure("prompt eval count"), "tokens": figure("eval count"),
            "step": step.group(1) if step else "?", "weights": weights.group(1) if weights else "?",
            "kernels": weights.group(2) if weights else "?"}


#: What MKL and oneDNN are held to under each narrower ATEN_CPU_CAPABILITY (their own ISA names).
LIBRARY_ISA = {"avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
               "default": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}}


def hold_libraries_to_capability() -> dict[str, str]:
    """Set (in this process's environment, which every row inherits) the MKL and oneDNN variables that
    match ATEN_CPU_CAPABILITY, where the caller has not; returns what was set."""
    wanted = LIBRARY_ISA.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower(), {})
    chosen = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(chosen)
    return chosen


def llama_row(bench: str, model: str, prompt_tokens: int, tokens: int, threads: int) -> dict[str, float | str]:
    out = subprocess.run([bench, "-m", model, "-t", str(threads), "-p", str(prompt_tokens), "-n", str(tokens),
                          "-d", f"0,{prompt_tokens}", "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    pp = next(r for r in rows if r["n_prompt"] and not r["n_gen"] and not r.get("n_depth"))
    tg = next(r for r in rows if r["n_gen"] and not r["n_prompt"] and r.get("n_depth", prompt_tokens) == prompt_tokens)
    return {"prefill_tok_s": pp["avg_ts"], "decode_tok_s": tg["avg_ts"], "step": f"llama.cpp {rows[0]['build_commit']}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", help="path of llama.cpp's llama-bench binary")
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"localllm rows, of {', '.join(VARIANTS)}")
    ap.add_argument("--also", action="append", default=[], metavar="LABEL=COMMAND",
                    help="a row running COMMAND (another checkout's CLI) with the first variant's flags")
    ap.add_argument("--also-variant", metavar="VARIANT",
                    help="the --also rows' flags instead (e.g. default for a checkout without --speculate)")
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "vs_llamacpp.json")
    args = ap.parse_args()
    also: dict[str, list[str]] = {}
    for item in args.also:
        label, sep, command = item.partition("=")
        if not sep or not label.strip() or not command.strip():
            ap.error(f"--also {item!r}: write it as LABEL=COMMAND")
        also[label.strip()] = shlex.split(command)
    if args.model is None:
        from localllm.paths import default_model_gguf

        args.model = str(default_model_gguf())
    held = hold_libraries_to_capability()
    if held:
        print("as ATEN_CPU_CAPABILITY says: " + " ".join(f"{k}={v}" for k, v in held.items()), file=sys.stderr)
    prompt = exact_prompt(args.model, args.prompt_tokens)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: no variant {', '.join(unknown)} (of {', '.join(VARIANTS)})")
    if args.also_variant is not None and args.also_variant not in VARIANTS:
        ap.error(f"--also-variant: no variant {args.also_variant} (of {', '.join(VARIANTS)})")
    also_flags = VARIANTS[args.also_variant or (variants[0] if variants else "default")]
    rounds: dict[str, list[dict[str, float | str]]] = {"llama.cpp": [], **{v: [] for v in [*variants, *also]}}
    if not args.llama_bench:
        del rounds["llama.cpp"]
    if "--compile" in variants:  # its one-time build is not a round's figure
        localllm_row(args.model, prompt, 4, args.threads, VARIANTS["--compile"])
    for r in range(args.rounds):
        if args.llama_bench:
            rounds["llama.cpp"].append(llama_row(args.llama_bench, args.model, args.prompt_tokens, args.tokens,
                                                 args.threads))
        for v in variants:
            rounds[v].append(localllm_row(args.model, prompt, args.tokens, args.threads, VARIANTS[v]))
        for label, cli in also.items():
            rounds[label].append(localllm_row(args.model, prompt, args.tokens, args.threads, also_flags, cli))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    table = {}
    for name, rows in rounds.items():
        table[name] = {key: statistics.median(float(row[key]) for row in rows) for key in ("prefill_tok_s", "decode_tok_s")}
        table[name]["step"] = rows[0]["step"]
    base = table.get("llama.cpp")
    print(f"{Path(args.model).name}, {args.threads} threads, {args.prompt_tokens}-token prompt, {args.tokens} "
          f"generated tokens, medians of {args.rounds} interleaved rounds")
    print(f"{'':14} {'prefill tok/s':>14} {'decode tok/s':>13}" + ("   x llama.cpp (prefill, decode)" if base else ""))
    for name, row in table.items():
        ratio = (f"   {row['prefill_tok_s'] / base['prefill_tok_s']:.2f}x, {row['decode_tok_s'] / base['decode_tok_s']:.2f}x"
                 if base else "")
        print(f"{name:14} {row['prefill_tok_s']:14.1f} {row['decode_tok_s']:13.1f}{ratio}   ({row['step']})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    isa = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", *LIBRARY_ISA["avx2"]) if k in os.environ}
    args.json.write_text(json.dumps({"model": args.model, "threads": args.threads, "tokens": args.tokens,
                                     "prompt_tokens": args.prompt_tokens, "isa": isa, "rounds": rounds,
                                     "medians": table},
                                    indent=2))
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
