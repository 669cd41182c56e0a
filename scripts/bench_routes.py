#!/usr/bin/env python
"""Throughput of each chat API's route on the same prompts, next to ``/v1/chat/completions``: their
work is translation, so they should match it.

    .venv/bin/python scripts/bench_routes.py --concurrency 1,8 --rounds 5 --requests 8 --max-tokens 32

Starts ``localllm serve`` (as ``bench_server.py`` does, MODEL preloaded), then for each round, each
concurrency C and each route in turn (interleaved, so that a noisy neighbour hits every route alike):
C clients stream the route (distinct prompts, greedy) until REQUESTS are done; throughput is generated
tokens (the route's own usage) / wall time. Prints, and writes to results/bench_routes.json, each
route's median throughput per concurrency and its ratio to chat's.

Every run's prompts are the same texts behind a tag of the same length that no other run shares
(``[run 002 008 001]``: round, concurrency, route): with identical prompts the route that ran
second would find the first one's prompt blocks in the prefix cache and prefill nothing. The order
of the routes turns by one every round, so that none always runs first after the previous level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import ROOT, prompts, start_server  # noqa: E402


def _chat(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _chat_tokens(event: dict[str, Any]) -> int | None:
    usage = event.get("usage")
    return usage["completion_tokens"] if usage else None


def _messages(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}


def _messages_tokens(event: dict[str, Any]) -> int | None:
    return event["usage"]["output_tokens"] if event.get("type") == "message_delta" else None


def _responses(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "input": prompt, "max_output_tokens": max_tokens, "temperature": 0, "stream": True,
            "store": False}


def _responses_tokens(event: dict[str, Any]) -> int | None:
    if event.get("type") in ("response.completed", "response.incomplete"):
        return int(event["response"]["usage"]["output_tokens"])
    return None


#: route name -> (path, request body, the generated tokens an SSE event reports, if it does)
ROUTES: dict[str, tuple[str, Callable[[str, str, int], dict[str, Any]], Callable[[dict[str, Any]], int | None]]] = {
    "chat": ("/v1/chat/completions", _chat, _chat_tokens),
    "messages": ("/v1/messages", _messages, _messages_tokens),
    "responses": ("/v1/responses", _responses, _responses_tokens),
}


async def one(client: httpx.AsyncClient, route: str, model: str, prompt: str, max_tokens: int) -> int:
    path, body, tokens_of = ROUTES[route]
    tokens = 0
    async with client.stream("POST", path, json=body(model, prompt, max_tokens)) as r:
        if r.status_code != 200:
            raise SystemExit(f"{route}: {r.status_code} {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n = tokens_of(json.loads(line[6:]))
                tokens = n if n is not None else tokens
    return tokens


async def level(url: str, route: str, model: str, concurrency: int, texts: list[str], max_tokens: int) -> float:
    """Generated tokens per second of ``texts`` streamed by ``concurrency`` clients."""
    queue = list(texts)
    total = 0
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def worker() -> None:
            nonlocal total
            while queue:
                tokens = await one(client, route, model, queue.pop(), max_tokens)
                total += tokens  # not `total += await ...`: that reads total before awaiting, losing the others' adds

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--routes", default=",".join(ROUTES), help=f"of {', '.join(ROUTES)}; chat is always run")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8, help="requests per route, concurrency and round")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--serve-args", default="", help="more `localllm serve` flags, e.g. '--quant fp32'")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_routes.json"))
    args = ap.parse_args()
    routes = ["chat", *[r for r in args.routes.split(",") if r and r != "chat"]]
    levels = [int(c) for c in args.concurrency.split(",")]
    proc, url = start_server(args.model, max(levels), 4 * max(levels), args.serve_args.split())
    try:
        texts = prompts(args.requests)
        asyncio.run(level(url, "chat", args.model, 1, texts[:1], args.max_tokens))  # warm-up
        runs: dict[tuple[str, int], list[float]] = {(r, c): [] for r in routes for c in levels}
        for i in range(args.rounds):
            for c in levels:
                for k in range(len(routes)):
                    r = routes[(i + k) % len(routes)]
                    tag = f"[run {i:03d} {c:03d} {routes.index(r):03d}]"
                    tagged = [f"{tag} {t}" for t in texts]
                    runs[(r, c)].append(asyncio.run(level(url, r, args.model, c, tagged, args.max_tokens)))
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    table = []
    for c in levels:
        chat = statistics.median(runs[("chat", c)])
        for r in routes:
            median = statistics.median(runs[(r, c)])
            table.append({"route": r, "concurrency": c, "tokens_per_s_median": round(median, 2),
                          "vs_chat": round(median / chat, 4), "runs": [round(x, 2) for x in runs[(r, c)]]})
            print(f"C={c:<3} {r:<10} {median:8.1f} tok/s  x{median / chat:.3f} of chat")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
