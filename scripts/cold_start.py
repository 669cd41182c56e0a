#!/usr/bin/env python
"""Cold start: process start to first generated token of `localllm run`, from the store vs quantizing at load.

    .venv/bin/python scripts/cold_start.py [--runs 3]

Sets up a throw-away store (LOCALLLM_HOME in a temp folder): SmolLM2 pulled as int4, and the same
model exported as a bf16 Hugging Face folder. Then times, in fresh processes, until the first byte of
generated text reaches stdout: the int4 store entry, the bf16 folder quantized to int4 at load, and
the GGUF file itself. Medians of --runs. No compiled decode step is built in that store (background
builds are off), so the runs decode eagerly; the first token (the prompt's prefill) is the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from localllm.paths import default_model_gguf, kernels_dir


def first_token_s(args: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "run", *args, "Hi", "-n", "2", "--temperature", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    proc.stdout.read(1)
    elapsed = time.perf_counter() - t0
    proc.communicate()
    if proc.returncode:
        raise SystemExit(f"localllm run {' '.join(args)} failed")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    gguf = default_model_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        # a throw-away store, but this machine's built CPU kernels (a one-time build is set-up, not start-up);
        # no background build of the compiled step (pull and a run that finds none would each start one,
        # competing with the timed runs and outliving the temp folder): the first token comes from the
        # prefill, which runs eagerly either way
        env = {**os.environ, "LOCALLLM_HOME": str(Path(tmp) / "home"), "LOCALLLM_KERNELS": str(kernels_dir()),
               "LOCALLLM_BACKGROUND_BUILD": "0"}
        subprocess.run([sys.executable, "-m", "localllm", "pull", str(gguf), "--name", "smol", "--quant", "int4"],
                       check=True, env=env, stderr=subprocess.DEVNULL)
        from localllm.loaders.export_hf import export_hf_folder

        folder = Path(tmp) / "hf-bf16"
        export_hf_folder(str(gguf), folder, "bf16")
        cases = {
            "store int4 (smol:int4)": ["smol:int4"],
            "bf16 HF folder, --quant int4 at load": [str(folder), "--quant", "int4"],
            "GGUF file (Q4_1 blocks imported)": [str(gguf)],
        }
        first_token_s(cases["store int4 (smol:int4)"], env)  # warm the page cache and the first-load hash
        print(f"process start to first token, median of {args.runs} runs:")
        results = {}
        for name, case in cases.items():
            results[name] = statistics.median(first_token_s(case, env) for _ in range(args.runs))
            print(f"  {name:<40} {results[name]:.2f} s")
        base = results["store int4 (smol:int4)"]
        for name, value in results.items():
            print(f"  {name:<40} {value / base:.2f}x the store's time")


if __name__ == "__main__":
    main()
