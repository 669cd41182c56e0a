"""Quality of each scheme against the run's highest-precision one (perplexity, KL divergence, top-1
agreement), with at most two models in memory at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from localllm.bench.meters import release_memory
from localllm.bench.settings import QUALITY_WINDOW, Log


def measure_quality(load: Callable[[str], Any], schemes: Sequence[str], baseline: str, ids: Sequence[int],
                    device: torch.device, log: Log, window: int = QUALITY_WINDOW) -> dict[str, dict[str, float]]:
    """Each scheme against ``baseline`` over ``ids``, with at most the reference and one scheme loaded."""
    from localllm.runtime.quality import Quality, compare

    release_memory(device)
    ref = load(baseline).model
    out: dict[str, Quality] = {}
    for name in schemes:
        if name == baseline:
            continue
        log(f"quality: {name} against {baseline} over {len(ids)} tokens")
        model = load(name).model
        out[name] = compare(ref, {name: model}, list(ids), window)[name]
        del model
        release_memory(device)
    if out:  # the reference against itself is exact by definition: ratio 1, KLD 0, top-1 1
        any_q = next(iter(out.values()))
        out[baseline] = Quality(any_q.tokens, any_q.ref_perplexity, any_q.ref_perplexity, 0.0, 1.0)
    else:
        out[baseline] = compare(ref, {baseline: ref}, list(ids), window)[baseline]
    del ref
    return {name: out[name].to_dict() for name in schemes}
