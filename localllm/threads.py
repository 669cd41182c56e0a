"""The CPU threads torch computes with (``--threads`` of ``run`` and ``bench``)."""

from __future__ import annotations

import torch

from localllm.errors import LocalLLMError


def set_threads(threads: int | None) -> None:
    """Use ``threads`` CPU threads for torch's kernels (None: leave torch's default, one per core)."""
    if threads is None:
        return
    if threads < 1:
        raise LocalLLMError(f"--threads {threads} is not positive", "give 1 or more, or leave it out")
    torch.set_num_threads(threads)
