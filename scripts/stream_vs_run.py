#!/usr/bin/env python
"""One server stream against `localllm run`: the same prompt and reply length, decode speed side by side.

    .venv/bin/python scripts/stream_vs_run.py [--model smollm2] [--parallel 1,8] [--tokens 128] [--rounds 3]

For each --parallel level a `localllm serve --parallel P --preload MODEL` runs on 127.0.0.1 (a free
port) for the whole benchmark. Each round, interleaved: one greedy raw `/api/generate` stream per level,
then `localllm run MODEL PROMPT --raw -n N --temperature 0 --verbose`. The prompt is a count that the
model carries on for hundreds of tokens, so both produce N tokens (the same ones: greedy on the same
engine). Figures: the server's decode rate from its own statistics ((eval_count - 1) / eval_duration,
as `run` counts: tokens after the first over their time), the client's (chunks after the first over
their arrival times), and `run`'s eval rate. Also the CPU time each streamed token costs outside the
model's step: in the server's event-loop thread (its main thread; Linux's per-thread schedstat) and
in the client (`--client httpx`, the default: Python, one JSON line parsed a token; or `--client
curl`, in C, which shows what the server itself costs). On a machine whose cores the step's threads all use,
that time is taken from the step, which is where a stream's gap to `run` comes from; with `--threads`
below the core count it is not. Medians over the rounds; JSON to
results/stream_vs_run.json (an ignored folder). Everything stops by itself; only loopback is used.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CLI = str(ROOT / ".venv/bin/localllm")
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def start_server(model: str, parallel: int, threads: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([CLI, "serve", "--port", "0", "--parallel", str(parallel), "--preload", model,
                             "--threads", str(threads)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    for line in proc.stderr:  # type: ignore[union-attr]
        m = re.search(r"serving on (http://127\.0\.0\.1:\d+)", line)
        if m:
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit(f"localllm serve --parallel {parallel} did not start")


def thread_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``'s main thread so far (0 where /proc has no schedstat)."""
    try:
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9
    except OSError:
        return 0.0


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def stream_row(url: str, model: str, tokens: int, pid: int, client: str) -> dict[str, float]:
    body = {"model": model, "prompt": PROMPT, "raw": True, "options": {"temperature": 0, "num_predict": tokens}}
    arrivals: list[float] = []
    final: dict[str, float] = {}
    loop0, client0, curl0 = thread_cpu_s(pid), time.thread_time(), children_cpu_s()
    if client == "curl":  # a client in C: what the server costs, without most of a Python client's
        out = subprocess.run(["curl", "-sSN", "--fail", f"{url}/api/generate", "-d", json.dumps(body)],
                             capture_output=True, text=True, check=True).stdout
        final = json.loads(out.strip().splitlines()[-1])
    else:
        with httpx.stream("POST", f"{url}/api/generate", json=body, timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                obj = json.loads(line)
                if obj.get("done"):
                    final = obj
                elif obj.get("response"):
                    arrivals.append(time.perf_counter())
    client_cpu = time.thread_time() - client0 + children_cpu_s() - curl0
    loop_cpu = thread_cpu_s(pid) - loop0
    n, seconds = final["eval_count"], final["eval_duration"] / 1e9
    row = {"tokens": n, "server_tok_s": (n - 1) / seconds if seconds > 0 else 0.0,
           "loop_us_per_token": loop_cpu / n * 1e6, "client_us_per_token": client_cpu / n * 1e6}
    if len(arrivals) > 1:
        row["client_tok_s"] = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    return row


def run_row(model: str, tokens: int, threads: int) -> dict[str, float]:
    out = subprocess.run([CLI, "run", model, PROMPT, "--raw", "-n", str(tokens), "--temperature", "0", "--verbose",
                          "--threads", str(threads)], capture_output=True, text=True, check=True).stderr

    def figure(label: str) -> float:
        m = re.search(rf"^{label}:\s+([\d.]+)", out, re.M)
        if not m:
            raise SystemExit(f"no '{label}' in localllm run's output:\n{out}")
        return float(m.group(1))

    return {"tokens": figure("eval count"), "run_tok_s": figure("eval rate")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--parallel", default="1,8", help="the servers' --parallel levels")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--client", choices=("httpx", "curl"), default="httpx",
                    help="the streaming client: httpx (Python, parses each line) or curl (C; no arrival times)")
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "stream_vs_run.json")
    args = ap.parse_args()
    levels = [int(p) for p in args.parallel.split(",")]
    servers = {p: start_server(args.model, p, args.threads) for p in levels}
    rows: dict[str, list[dict[str, float]]] = {"run": [], **{f"serve --parallel {p}": [] for p in levels}}
    try:
        for p in levels:  # each server's first request's one-time costs
            stream_row(servers[p][1], args.model, 4, servers[p][0].pid, args.client)
        for r in range(args.rounds):
            for p in levels:
                rows[f"serve --parallel {p}"].append(stream_row(servers[p][1], args.model, args.tokens,
                                                                servers[p][0].pid, args.client))
            rows["run"].append(run_row(args.model, args.tokens, args.threads))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    run_rate = statistics.median(row["run_tok_s"] for row in rows["run"])
    print(f"{args.model}, {args.threads} threads, one greedy stream of {args.tokens} tokens ({args.client}), "
          f"medians of {args.rounds} interleaved rounds")
    print(f"{'':22} {'tokens':>7} {'decode tok/s':>13} {'client tok/s':>13} {'x run':>6} "
          f"{'loop us/tok':>12} {'client us/tok':>14}")
    medians: dict[str, dict[str, float]] = {}
    for name, found in rows.items():
        key = "run_tok_s" if name == "run" else "server_tok_s"
        m = {"tokens": statistics.median(row["tokens"] for row in found),
             "decode_tok_s": statistics.median(row[key] for row in found)}
        extra = ""
        if name != "run":
            for k in ("client_tok_s", "loop_us_per_token", "client_us_per_token"):
                if all(k in row for row in found):
                    m[k] = statistics.median(row[k] for row in found)
            extra = f" {m['loop_us_per_token']:12.0f} {m['client_us_per_token']:14.0f}"
        medians[name] = m
        client = f"{m['client_tok_s']:13.1f}" if "client_tok_s" in m else f"{'':13}"
        print(f"{name:22} {m['tokens']:7.0f} {m['decode_tok_s']:13.1f} {client} {m['decode_tok_s'] / run_rate:6.2f}"
              + extra)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": args.model, "tokens": args.tokens, "threads": args.threads,
                                     "client": args.client,
                                     "rounds": rows, "medians": medians}, indent=2))
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
