#!/usr/bin/env python
"""HTTP load test of ``localllm serve`` next to the batch engine's own figures, on loopback only.

    .venv/bin/python scripts/bench_server.py --concurrency 1,4,16 --requests 16 --max-tokens 32

1. starts ``localllm serve`` (a subprocess, a free port on 127.0.0.1), MODEL preloaded;
2. for each concurrency C: C clients stream ``/v1/completions`` (distinct prompts, greedy) until
   REQUESTS requests are done: TTFT p50/p99 (request sent -> first token), inter-token latency
   p50/p99 (between SSE chunks), throughput (generated tokens / wall time);
3. the same prompts straight on a BatchEngine in this process (no HTTP): its TTFT, ITL, throughput;
4. each kind of bad request, and what it got back;
5. the server's RSS before and after CANCELLED streams that disconnect after their first token.

Everything is bounded and stops by itself; figures are printed and written to results/bench_server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def prompts(n: int) -> list[str]:
    topics = ["the sea", "a mountain", "a city at night", "an old library", "a robot", "the desert", "a forest",
              "a train journey", "a lighthouse", "winter", "a market", "the moon", "a garden", "a storm", "a bridge",
              "a violin"]
    return [f"Write a short paragraph about {topics[i % len(topics)]} (number {i})." for i in range(n)]


# --------------------------------------------------------------------------- server side
def start_server(model: str, parallel: int, queue: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "localllm", "serve", "--port", "0", "--parallel", str(parallel), "--queue",
           str(queue), "--preload", model, *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # type: ignore[union-attr]
        m = re.search(r"serving on (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
            return proc, m.group(1)
    raise SystemExit(f"the server did not start ({proc.wait()})")


async def one_stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict[str, object]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    return {"status": 200, "ttft": stamps[0] - t0 if stamps else None,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": usage["completion_tokens"] if usage else 0}


async def http_level(url: str, model: str, concurrency: int, texts: list[str], max_tokens: int,
                     keepalive: bool = True) -> dict[str, float]:
    """``keepalive=False``: a connection per request (a server that closes kept-alive connections
    after a few requests, as llama-server's HTTP library does, would otherwise drop a reused one)."""
    queue = list(texts)
    results: list[dict[str, object]] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=None if keepalive else 0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker() -> None:
            while queue:
                results.append(await one_stream(client, model, queue.pop(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    ttft = [float(r["ttft"]) for r in ok if r["ttft"] is not None]  # type: ignore[arg-type]
    itl = [x for r in ok for x in r["itl"]]  # type: ignore[union-attr]
    tokens = sum(int(r["tokens"]) for r in ok)  # type: ignore[arg-type]
    return {"concurrency": concurrency, "requests": len(results), "ok": len(ok), "ttft_p50_ms": pct(ttft, 50) * 1e3,
            "ttft_p99_ms": pct(ttft, 99) * 1e3, "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


BAD_REQUESTS = [
    ("malformed JSON", "POST", "/v1/chat/completions", b"{not json"),
    ("wrong type", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
    ("n = 2", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ("unknown model (OpenAI)", "POST", "/v1/chat/completions",
     {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
    ("unknown model (Ollama)", "POST", "/api/generate", {"model": "no-such-model", "prompt": "hi"}),
    ("prompt longer than the context", "POST", "/v1/completions", {"model": "MODEL", "prompt": "word " * 9000}),
    ("prompt longer than num_ctx", "POST", "/api/generate",
     {"model": "MODEL", "prompt": "word " * 100, "options": {"num_ctx": 64}, "stream": False}),
    ("bad option type (Ollama)", "POST", "/api/chat", {"model": "MODEL", "messages": [], "options": {"top_k": "x"}}),
    ("body over the limit", "POST", "/api/generate", b'{"prompt": "' + b"a" * (9 << 20) + b'"}'),
    ("not UTF-8", "POST", "/api/generate", b"\xff\xfe\xfd"),
    ("wrong method", "GET", "/v1/completions", None),
]


def bad_requests(url: str, model: str) -> list[dict[str, object]]:
    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for what, method, path, body in BAD_REQUESTS:
            if isinstance(body, dict):
                body = json.dumps(body).replace('"MODEL"', json.dumps(model)).encode()
            r = client.request(method, path, content=body)
            text = r.text if len(r.text) < 300 else r.text[:300] + "..."
            out.append({"request": what, "status": r.status_code, "body": text})
    return out


def cancelled_streams(url: str, model: str, n: int, server_pid: int) -> dict[str, float]:
    proc = psutil.Process(server_pid)

    async def burst(count: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            sem = asyncio.Semaphore(8)

            async def one(i: int) -> None:
                async with sem:
                    body = {"model": model, "prompt": f"{i}: 1, 2, 3, 4,", "max_tokens": 64, "stream": True,
                            "temperature": 0}
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                break  # leave after the first token: the server cancels the sequence

            await asyncio.gather(*(one(i) for i in range(count)))

    asyncio.run(burst(50))
    time.sleep(1)
    baseline = proc.memory_info().rss
    t0 = time.perf_counter()
    asyncio.run(burst(n))
    took = time.perf_counter() - t0
    time.sleep(1)
    after = proc.memory_info().rss
    metrics = httpx.get(f"{url}/metrics").text
    used = sum(float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("localllm_kv_blocks{") and 'state="used"' in l)
    return {"streams": n, "seconds": took, "rss_baseline_mb": baseline / 1e6, "rss_after_mb": after / 1e6,
            "rss_growth_mb": (after - baseline) / 1e6, "kv_blocks_used_after": used}


# --------------------------------------------------------------------------- engine side
def engine_level(lm, concurrency: int, texts: list[str], max_tokens: int, parallel: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from localllm.runtime.batch import BatchEngine
    from localllm.runtime.chat import encode_chat
    from localllm.runtime.sampling import SamplingParams

    engine = BatchEngine(lm.model, max_running=parallel, max_waiting=len(texts))
    stop = list(dict.fromkeys([*lm.tokenizer.eos_ids, *lm.config.eos_token_ids]))
    ids = [encode_chat(lm.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    pending = list(ids)
    engine.start()
    t0 = time.perf_counter()
    lock = threading.Lock()

    def worker() -> None:
        nonlocal tokens
        while True:
            with lock:
                if not pending:
                    return
                prompt = pending.pop()
            handle = engine.submit(prompt, SamplingParams(temperature=0), max_tokens, stop)
            stamps = []
            for _ in handle:
                stamps.append(time.perf_counter())
            with lock:
                if handle.stats.ttft_s is not None:
                    ttft.append(handle.stats.ttft_s)
                itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
                tokens += handle.stats.generated_tokens

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    engine.stop()
    return {"concurrency": concurrency, "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
            "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cancelled", type=int, default=1000, help="streams cancelled after their first token")
    ap.add_argument("--serve-args", default="", help="more `localllm serve` flags, e.g. '--quant fp32'")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_server.json"))
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    parallel = max(levels)
    texts = prompts(args.requests)
    report: dict[str, object] = {"model": args.model, "max_tokens": args.max_tokens, "requests": args.requests,
                                 "cpu_count": os.cpu_count()}

    proc, url = start_server(args.model, parallel, 4 * parallel, args.serve_args.split())
    try:
        print(f"server at {url}", file=sys.stderr)
        asyncio.run(http_level(url, args.model, 1, prompts(2), 4))  # warm-up
        report["http"] = [asyncio.run(http_level(url, args.model, c, texts, args.max_tokens)) for c in levels]
        report["bad_requests"] = bad_requests(url, args.model)
        if args.cancelled:
            report["cancelled_streams"] = cancelled_streams(url, args.model, args.cancelled, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        report["server_exit_code"] = proc.wait(timeout=60)

    from localllm.loaders.load import load_model

    extra = args.serve_args.split()
    quant = extra[extra.index("--quant") + 1] if "--quant" in extra else None
    lm = load_model(args.model, device="cpu", quant=quant)
    report["engine"] = [engine_level(lm, c, texts, args.max_tokens, parallel) for c in levels]

    print(f"\nmodel {args.model}, {args.requests} requests per level, {args.max_tokens} tokens each, "
          f"{os.cpu_count()} CPUs")
    print(f"{'':8}{'C':>4}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'tok/s':>8}")
    for kind in ("http", "engine"):
        for row in report[kind]:  # type: ignore[union-attr]
            print(f"{kind:8}{row['concurrency']:>4}{row['ttft_p50_ms']:>10.0f}{row['ttft_p99_ms']:>8.0f}"
                  f"{row['itl_p50_ms']:>9.1f}{row['itl_p99_ms']:>8.1f}{row['tokens_per_s']:>8.1f}")
    print("\nbad requests:")
    for row in report["bad_requests"]:  # type: ignore[union-attr]
        print(f"  {row['request']:<32} {row['status']}  {row['body']}")
    if "cancelled_streams" in report:
        c = report["cancelled_streams"]
        print(f"\n{c['streams']} cancelled streams in {c['seconds']:.1f} s: RSS {c['rss_baseline_mb']:.0f} MB -> "  # type: ignore[index]
              f"{c['rss_after_mb']:.0f} MB ({c['rss_growth_mb']:+.1f} MB), KV blocks in use after: "  # type: ignore[index]
              f"{c['kv_blocks_used_after']:.0f}")  # type: ignore[index]
    print(f"server exit code after SIGTERM: {report['server_exit_code']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
