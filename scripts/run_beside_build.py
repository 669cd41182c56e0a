#!/usr/bin/env python
"""Does a background build of a compiled decode step slow a user's run? `localllm run` alone against
the same run while a build runs, in interleaved rounds.

    .venv/bin/python scripts/run_beside_build.py [--model smollm2] [--tokens 128] [--rounds 3] [--lead 20]

Each round: the run alone; then a background build as runs start it (`localllm compile MODEL
--if-idle` under localllm.yielding's keeper, in a fresh home of its own so that it really builds),
given --lead seconds to get into its compile, and the same run beside it; then the build is stopped.
With --unkept, also a build without the keeper (only its lowest CPU priority), beside the same run. The measured runs are eager
(`--no-compile`) and greedy on a raw prompt the model continues for hundreds of tokens, so both arms
compute the same tokens; the figure is `run --verbose`'s eval rate. Medians; JSON to
results/run_beside_build.json (an ignored folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "localllm"]
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def eval_rate(model: str, tokens: int) -> float:
    done = subprocess.run([*CLI, "run", model, PROMPT, "--raw", "--no-compile", "--temperature", "0", "-n",
                           str(tokens), "--verbose"], capture_output=True, text=True, timeout=600)
    m = re.search(r"^eval rate:\s+([\d.]+) tokens/s", done.stderr, re.M)
    if done.returncode != 0 or m is None:
        raise SystemExit(f"localllm run failed: {done.stderr[-500:]}")
    return float(m.group(1))


def beside_build(args: argparse.Namespace, keeper: list[str], r: int) -> float:
    """The run's eval rate beside a fresh build (started ``--lead`` seconds before it)."""
    with tempfile.TemporaryDirectory(prefix="build-home-") as build_home:
        env = {**os.environ, "LOCALLLM_HOME": build_home}
        with open(Path(build_home) / "build.log", "w") as log:
            build = subprocess.Popen([*keeper, *CLI, "compile", args.model, "--if-idle"], env=env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            try:
                time.sleep(args.lead)
                still = build.poll() is None
                rate = eval_rate(args.model, args.tokens)
                if not still:
                    said = (Path(build_home) / "build.log").read_text()[-300:]
                    print(f"round {r}: the build ended before the run started ({said.strip()})")
            finally:
                if build.poll() is None:
                    os.killpg(build.pid, 15)
                build.wait(timeout=60)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lead", type=float, default=20.0, help="seconds the build runs before the run starts")
    ap.add_argument("--unkept", action="store_true", help="also measure a build without the keeper")
    args = ap.parse_args()
    arms = {"alone": [], "kept": [], **({"unkept": []} if args.unkept else {})}
    eval_rate(args.model, 8)  # warm the page cache and the kernels
    for r in range(args.rounds):
        arms["alone"].append(eval_rate(args.model, args.tokens))
        for arm in [a for a in arms if a != "alone"]:
            keeper = [sys.executable, "-m", "localllm.yielding"] if arm == "kept" else []
            arms[arm].append(beside_build(args, keeper, r))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in arms.items()), flush=True)
    medians = {k: statistics.median(v) for k, v in arms.items()}
    print("median: " + ", ".join(f"{k} {v:.1f} tok/s ({v / medians['alone']:.2f}x)" for k, v in medians.items()))
    out = ROOT / "results" / "run_beside_build.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "tokens": args.tokens, "rounds": arms, "medians": medians},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
