"""What the serving benchmark's workloads are made of, shared by :mod:`localllm.bench.serving` and
:mod:`localllm.bench.speculation`: a workload's requests and settings, the prompt text they are cut
from, the agent workload's conversations, a fresh engine per measurement, and :func:`drive`, which runs
requests on an engine and returns a level's figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.runtime.batch import BatchEngine, RequestHandle
    from localllm.runtime.model import Transformer
    from localllm.runtime.sampling import SamplingParams

MIXED_REQUESTS = 32
MIXED_SHORT, MIXED_LONG = 8, 256
AGENT_TURNS = 6
AGENT_HISTORY = 1000
AGENT_TOOL = 200
AGENT_REPLY = 16


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50 and p99 (nearest rank on the sorted values); None for no values."""
    if not values:
        return {"p50": None, "p99": None}
    v = sorted(values)
    rank = lambda q: v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]  # noqa: E731
    return {"p50": statistics.median(v), "p99": rank(0.99)}


@dataclass
class Request:
    """One request of a workload: its prompt, its token budget, and when it may be submitted."""

    prompt: list[int]
    max_tokens: int
    #: Submitted only once this returns True (None: at once). Agents' later turns wait for earlier ones.
    ready: Callable[[], bool] | None = None
    #: Called with the reply's tokens when it finishes (the agent builds its next turn from it).
    done: Callable[[list[int]], None] | None = None
    handle: RequestHandle | None = None
    tokens: list[int] = field(default_factory=list)


class TextSlicer:
    """Prompt ids cut from the evaluation text's ids, cyclically, at offsets of its own."""

    def __init__(self, ids: Sequence[int]) -> None:
        if len(ids) < 64:
            raise LocalLLMError(f"the text is {len(ids)} tokens long", "give a text of at least 64 tokens")
        self.ids = list(ids)
        self.offset = 0

    def take(self, n: int) -> list[int]:
        L = len(self.ids)
        out = [self.ids[(self.offset + i) % L] for i in range(n)]
        self.offset = (self.offset + n + 7) % L  # the next slice starts elsewhere (+7: never block-aligned)
        return out


def drive(engine: BatchEngine, requests: list[Request], max_in_flight: int | None = None,
          static: bool = False, on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run ``requests`` on ``engine`` until every one is done; the level's figures.

    ``max_in_flight``: requests submitted at once at most (None: all that are ready). ``static``: a new
    batch of ``max_in_flight`` starts only when the previous one has finished entirely.
    ``on_step(step_index)``: called after each step (to inject a request mid-run).
    """
    pending = list(requests)
    active: list[Request] = []
    finished: list[Request] = []
    peak_blocks = 0
    steps: list[StepTime] = []
    t0 = time.perf_counter()
    step = 0
    while pending or active:
        room = (max_in_flight or len(requests)) - len(active)
        if static and active:
            room = 0
        for r in [r for r in pending if r.ready is None or r.ready()][: max(0, room)]:
            r.handle = engine.submit(r.prompt, greedy(), max_tokens=r.max_tokens, stop_ids=())
            pending.remove(r)
            active.append(r)
        if not active:
            raise RuntimeError("no request can start: a workload's turns wait on each other")
        if engine.step():
            steps.append(StepTime(engine.last_step_s, engine.last_step_prefill_tokens))
        step += 1
        peak_blocks = max(peak_blocks, engine.usage()["blocks_used"])
        for r in list(active):
            r.tokens += r.handle.take()
            if r.handle.stats.finish_reason is not None:
                r.tokens += r.handle.take()
                active.remove(r)
                finished.append(r)
                if r.done is not None:
                    r.done(r.tokens)
        if on_step is not None:
            on_step(step)
    wall = time.perf_counter() - t0
    return summarize(finished, wall, peak_blocks, engine, steps)


@dataclass(frozen=True)
class StepTime:
    """One engine step: its forward and sampling time, and the prompt tokens it computed (0: decode only)."""

    seconds: float
    prefill_tokens: int


def step_figures(steps: Sequence[StepTime]) -> dict[str, Any]:
    """Where a level's step time went: steps that carried prompt tokens against decode-only ones.

    The decode-only steps' median is the batched step's cost at that level, free of prefill; the
    uniform workload's comparison uses it to say what batching alone would give (see ``uniform``)."""
    decode = [s.seconds for s in steps if s.prefill_tokens == 0]
    return {
        "steps": len(steps),
        "decode_steps": len(decode),
        "decode_step_ms": {k: (v * 1e3 if v is not None else None) for k, v in percentiles(decode).items()},
        "decode_steps_s": sum(decode),
        "prefill_steps_s": sum(s.seconds for s in steps if s.prefill_tokens > 0),
    }


def summarize(finished: list[Request], wall_s: float, peak_blocks: int, engine: BatchEngine,
              steps: Sequence[StepTime] = ()) -> dict[str, Any]:
    stats = [r.handle.stats for r in finished]
    for st in stats:
        if st.finish_reason not in ("length", "stop"):
            raise RuntimeError(f"a request ended with '{st.finish_reason}'")
    generated = sum(st.generated_tokens for st in stats)
    gaps = [b - a for st in stats for a, b in zip(st.token_times, st.token_times[1:])]
    prompt = sum(st.prompt_tokens for st in stats)
    cached = sum(st.cached_tokens for st in stats)
    ttfts = [st.ttft_s for st in stats if st.ttft_s is not None]
    return {
        "requests": len(stats),
        "wall_s": wall_s,
        "generated_tokens": generated,
        "throughput_tok_s": generated / wall_s if wall_s > 0 else None,
        "ttft_ms": {k: (v * 1e3 if v is not None else None) for k, v in percentiles(ttfts).items()},
        "ttft_mean_ms": statistics.fmean(ttfts) * 1e3 if ttfts else None,
        "itl_ms": {k: (v * 1e3 if v is not None else None) for k, v in percentiles(gaps).items()},
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "prefill_tokens": prompt - cached,
        "preemptions": sum(st.preemptions for st in stats),
        "kv_blocks_peak": peak_blocks,
        "kv_blocks": engine.usage()["blocks"],
        # each stream's tokens after its first over the time they took (prefill left out), median of streams
        "stream_decode_tok_s": statistics.median(st.decode_tps for st in stats) if stats else None,
        "drafted_tokens": sum(st.drafted_tokens for st in stats),
        "accepted_tokens": sum(st.accepted_tokens for st in stats),
        "draft_steps": sum(st.draft_steps for st in stats),
        # decode-only steps (no prompt chunk) by their query rows, as the engine measured them
        "step_ms_by_rows": {str(r): t * 1e3 for r, t in engine.costs.table().items()},
        **step_figures(steps),
    }


def greedy() -> SamplingParams:
    from localllm.runtime.sampling import SamplingParams

    return SamplingParams(temperature=0)


@dataclass
class ServingSettings:
    workload: str
    levels: list[int]
    prompt_tokens: int = 128
    gen_tokens: int = 128
    long_prompt_tokens: int = 2000
    kv_budget_bytes: int | None = None
    chunk_tokens: int = 256
    kv_dtype: str = "16bit"  # the engine's KV pool: "16bit" (the activations' dtype) or "int8"
    #: "on", "off", or "compare" (each level with speculation off and on, side by side; the edit,
    #: summarize and open workloads always compare).
    speculate: str | bool = "on"


def make_engine(model: Transformer, s: ServingSettings, slots: int, prefix_cache: bool = True) -> BatchEngine:
    """A fresh engine per measurement: nothing cached from the previous one."""
    from localllm.runtime.batch import DEFAULT_KV_BUDGET, BatchEngine

    return BatchEngine(model, kv_budget_bytes=s.kv_budget_bytes or DEFAULT_KV_BUDGET, max_running=slots,
                       max_waiting=max(64, 2 * MIXED_REQUESTS), chunk_tokens=s.chunk_tokens,
                       prefix_cache=prefix_cache, kv_dtype=s.kv_dtype, compile="auto",
                       speculate=s.speculate is True or s.speculate == "on")


def agent_requests(text: TextSlicer, agents: int) -> list[Request]:
    """``agents`` conversations of AGENT_TURNS turns; a turn is submitted once the previous one has
    replied, with the previous prompt, the reply and a new tool result as its prompt."""
    requests: list[Request] = []
    for _ in range(agents):
        history = text.take(AGENT_HISTORY)
        tools = [text.take(AGENT_TOOL) for _ in range(AGENT_TURNS)]
        turns = [Request([], AGENT_REPLY) for _ in range(AGENT_TURNS)]
        turns[0].prompt = history + tools[0]
        for t, turn in enumerate(turns):
            turn.ready = partial(_has_prompt, turn)
            if t + 1 < AGENT_TURNS:
                turn.done = partial(_next_turn, turn, turns[t + 1], tools[t + 1])
        requests += turns
    return requests


def _has_prompt(r: Request) -> bool:
    return bool(r.prompt)


def _next_turn(turn: Request, following: Request, tool: list[int], reply: list[int]) -> None:
    following.prompt = turn.prompt + reply + tool


def kv_bytes(model: Transformer, tokens: int, kv_dtype: str) -> int:
    """Bytes of a pool holding ``tokens`` tokens of ``model``'s keys and values (whole blocks)."""
    from localllm.runtime.kv_pool import DEFAULT_BLOCK_SIZE, cache_bytes

    blocks = -(-tokens // DEFAULT_BLOCK_SIZE)
    return cache_bytes(model.config, blocks * DEFAULT_BLOCK_SIZE, model.dtype, kv_dtype)
