"""The preallocated key/value cache."""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of one attention layer for every position up to ``max_seq``.

    Allocated once, written in place: decoding allocates nothing per token. Its size is known
    before allocation (:meth:`runtime.config.ModelConfig.kv_cache_bytes`).
    """

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        max_seq: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        shape = (batch, kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq(self) -> int:
        return self.k.shape[2]

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` (B, kv_heads, T, head_dim) at positions ``input_pos`` (T,).

        Returns the whole buffers (B, kv_heads, max_seq, head_dim); the caller reads the prefix it needs.
        """
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v
