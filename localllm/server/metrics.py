"""Counters the server keeps, and ``GET /metrics`` in Prometheus' text format (version 0.0.4)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from localllm.server.generation import Outcome

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """Totals since start; safe to update from any thread (the generations' pump threads do)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, status) -> count
        self.finished: Counter[str] = Counter()  # finish reason -> generations
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.queue_rejections = 0
        self.models_loaded_total = 0
        self.models_unloaded_total = 0

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def outcome(self, o: Outcome) -> None:
        with self._lock:
            self.finished[o.finish_reason] += 1
            self.generated_tokens += o.completion_tokens
            self.prompt_tokens += o.prompt_tokens
            self.cached_prompt_tokens += o.cached_tokens

    def rejected(self) -> None:
        with self._lock:
            self.queue_rejections += 1

    def render(self, engines: Iterable[tuple[str, dict[str, int], int]]) -> str:
        """The text body; ``engines``: (model name, ``BatchEngine.usage()``, KV pool bytes) per loaded model."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP localllm_{name} {help_}")
            out.append(f"# TYPE localllm_{name} {kind}")
            for labels, value in samples:
                out.append(f"localllm_{name}{labels} {value:g}" if isinstance(value, float) else
                           f"localllm_{name}{labels} {value}")

        engines = [(_label(m), u, b) for m, u, b in engines]
        with self._lock:
            family("requests_total", "counter", "HTTP requests answered, by route and status.",
                   [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())])
            family("generations_total", "counter", "Generations ended, by finish reason.",
                   [(f'{{reason="{k}"}}', n) for k, n in sorted(self.finished.items())])
            family("generated_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
            family("prompt_tokens_total", "counter", "Prompt tokens of finished generations.", [("", self.prompt_tokens)])
            family("prompt_cached_tokens_total", "counter", "Prompt tokens served by the prefix cache.",
                   [("", self.cached_prompt_tokens)])
            family("queue_rejections_total", "counter", "Requests refused with 503 because the queue was full.",
                   [("", self.queue_rejections)])
            family("models_loaded_total", "counter", "Model loads since start.", [("", self.models_loaded_total)])
            family("models_unloaded_total", "counter", "Model unloads since start.", [("", self.models_unloaded_total)])
        family("models_loaded", "gauge", "Models loaded now.", [("", len(engines))])
        family("requests_running", "gauge", "Sequences in the engine's batch.",
               [(f'{{model="{m}"}}', u["running"]) for m, u, _ in engines])
        family("requests_waiting", "gauge", "Sequences queued for a slot.",
               [(f'{{model="{m}"}}', u["waiting"]) for m, u, _ in engines])
        family("kv_blocks", "gauge", "KV cache pool blocks by state (used by sequences, cached prefixes, free).",
               [(f'{{model="{m}",state="{s}"}}', u[f"blocks_{s}"]) for m, u, _ in engines for s in ("used", "cached", "free")])
        family("kv_blocks_total", "gauge", "KV cache pool blocks.", [(f'{{model="{m}"}}', u["blocks"]) for m, u, _ in engines])
        family("kv_pool_bytes", "gauge", "KV cache pool size.", [(f'{{model="{m}"}}', b) for m, _, b in engines])
        family("kv_pool_usage_ratio", "gauge", "Share of the KV pool's blocks held by running sequences.",
               [(f'{{model="{m}"}}', float(u["blocks_used"] / u["blocks"]) if u["blocks"] else 0.0)
                for m, u, _ in engines])
        family("preemptions_total", "counter", "Sequences preempted for lack of KV blocks.",
               [(f'{{model="{m}"}}', u["preemptions"]) for m, u, _ in engines])
        family("draft_tokens_total", "counter", "Speculative decoding: proposed tokens verified.",
               [(f'{{model="{m}"}}', u["drafted_tokens"]) for m, u, _ in engines])
        family("draft_accepted_tokens_total", "counter", "Speculative decoding: proposed tokens accepted.",
               [(f'{{model="{m}"}}', u["accepted_tokens"]) for m, u, _ in engines])
        family("verify_steps_total", "counter", "Speculative decoding: steps that verified a draft (the mean "
               "accepted length is draft_accepted_tokens_total over this).",
               [(f'{{model="{m}"}}', u["verify_steps"]) for m, u, _ in engines])
        return "\n".join(out) + "\n"


def _label(value: str) -> str:
    """A label value with Prometheus' escapes."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
