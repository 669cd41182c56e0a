#!/usr/bin/env python
"""``bench_routes.py`` with the Responses API's route (``/v1/responses``) added next to chat's: the
same prompts, rounds and medians, its throughput as a ratio of chat's.

    .venv/bin/python scripts/bench_responses.py --routes chat,responses --concurrency 1,8 --rounds 5
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_routes  # noqa: E402


def _responses(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "input": prompt, "max_output_tokens": max_tokens, "temperature": 0, "stream": True,
            "store": False}


def _responses_tokens(event: dict[str, Any]) -> int | None:
    if event.get("type") in ("response.completed", "response.incomplete"):
        return int(event["response"]["usage"]["output_tokens"])
    return None


bench_routes.ROUTES["responses"] = ("/v1/responses", _responses, _responses_tokens)

if __name__ == "__main__":
    bench_routes.main()
