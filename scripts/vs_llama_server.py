#!/usr/bin/env python
"""`localllm serve` beside llama.cpp's `llama-server` on the same GGUF file: C concurrent streams each.

    .venv/bin/python scripts/vs_llama_server.py FILE.gguf --llama-server PATH/llama-server
        [--concurrency 1,8] [--requests 16] [--max-tokens 32] [--rounds 3] [--threads 2]

Both servers are started once (localllm with ``--parallel`` the largest level, the model preloaded;
llama-server with ``-np`` that level and a context of ``-np`` times each stream's), then every round
runs each level against each server in turn (interleaved, so the machine's drift falls on both alike):
C clients stream ``/v1/chat/completions`` (distinct prompts, greedy) until --requests are done, with
``scripts/bench_server.py``'s client, a connection per request for both. The table shows each row's median over the rounds of generated
tokens a second (from each reply's ``usage``), TTFT p50 and inter-token latency p50. JSON goes to
results/vs_llama_server.json, llama-server's own log beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_server import http_level, prompts, start_server  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_llama_server(binary: str, model: Path, parallel: int, ctx: int, threads: int,
                       log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([binary, "-m", str(model), "--port", str(port), "--host", "127.0.0.1", "-np", str(parallel),
                             "-c", str(ctx * parallel), "-t", str(threads), "-tb", str(threads), "--no-webui"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}")
        time.sleep(0.5)
    raise SystemExit("llama-server did not become healthy")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512, help="llama-server's context of each stream")
    ap.add_argument("--serve-args", default="", help="more `localllm serve` flags")
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "vs_llama_server.json")
    a = ap.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    texts = prompts(a.requests)
    ours, ours_url = start_server(str(a.model.resolve()), max(levels), a.requests, [*a.serve_args.split(),
                                  "--threads", str(a.threads)])
    a.json.parent.mkdir(parents=True, exist_ok=True)
    theirs, theirs_url = start_llama_server(a.llama_server, a.model, max(levels), a.ctx, a.threads,
                                            a.json.with_suffix(".llama-server.log"))
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        servers = [("localllm", ours_url, str(a.model.resolve())), ("llama.cpp", theirs_url, "model")]
        for name, url, model in servers:  # warm-up: first compiled steps, first allocations
            asyncio.run(http_level(url, model, 1, texts[:1], 4, keepalive=False))
        for r in range(a.rounds):
            for c in levels:
                for name, url, model in servers:
                    res = asyncio.run(http_level(url, model, c, texts, a.max_tokens, keepalive=False))
                    rows.setdefault((name, c), []).append(res)
                    print(f"round {r + 1} {name} c={c}: {res['tokens_per_s']:.1f} tok/s ({res['ok']}/{res['requests']} ok)",
                          file=sys.stderr)
    finally:
        for p in (ours, theirs):
            p.terminate()
            p.wait(timeout=30)
    print("| server | streams | tok/s | TTFT p50 ms | ITL p50 ms | x llama.cpp |")
    print("|---|---|---|---|---|---|")
    table = []
    for c in levels:
        base = statistics.median(x["tokens_per_s"] for x in rows[("llama.cpp", c)])
        for name in ("llama.cpp", "localllm"):
            rs = rows[(name, c)]
            med = {k: statistics.median(x[k] for x in rs) for k in ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms")}
            table.append({"server": name, "concurrency": c, **med, "rounds": len(rs)})
            print(f"| {name} | {c} | {med['tokens_per_s']:.1f} | {med['ttft_p50_ms']:.0f} | {med['itl_p50_ms']:.1f} "
                  f"| {med['tokens_per_s'] / base:.2f} |")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"model": str(a.model), "rows": table}, indent=1))


if __name__ == "__main__":
    main()
