"""Preallocated key/value caches, owned by the sequence they hold, not by the model.

The model is stateless across sequences (design.md): whoever runs a sequence (a
:class:`runtime.generate.Generator`) makes a :class:`SequenceCache` with
:meth:`runtime.model.Transformer.new_cache` and hands it to every forward. Two generators on one
model therefore never see each other's keys, and a cache-less forward (perplexity windows) cannot
disturb a live one.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of one attention layer, (B, kv_heads, max_seq, head_dim) each.

    Allocated once, written in place: decoding allocates nothing per token. Its size is known
    before allocation (:meth:`runtime.config.ModelConfig.kv_cache_bytes`).
    """

    __slots__ = ("k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` (B, kv_heads, T, head_dim) at positions ``input_pos`` (T,).

        Returns the whole buffers (B, kv_heads, max_seq, head_dim); the caller reads the prefix it needs.
        """
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class SequenceCache:
    """The caches of one sequence (or a fixed batch of them): a :class:`KVCache` per layer, the RoPE
    tables for its ``max_seq`` positions, and the token ids whose keys/values it holds.

    The RoPE tables travel with the cache rather than living on the model so that a forward's every
    per-length tensor comes from one argument (what an exported step takes as inputs), and they are
    made once per cache, never per token.
    """

    def __init__(self, layers: list[KVCache], cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.layers = layers
        self.cos, self.sin = cos, sin  # (max_seq, head_dim) each, in the activation dtype
        #: Token ids whose keys/values sit at positions 0..len-1 (kept by the cache's user, e.g. the
        #: Generator, to reuse a shared prefix; the model does not read it).
        self.tokens: list[int] = []

    @property
    def max_seq(self) -> int:
        return self.cos.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, in a fixed order: k and v of each layer, then cos and sin."""
        out = [t for c in self.layers for t in (c.k, c.v)]
        return [*out, self.cos, self.sin]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> "SequenceCache":
        """The inverse of :meth:`tensors` (for a traced step that gets the tensors as inputs)."""
        kv = tensors[:-2]
        layers = [KVCache(kv[i], kv[i + 1]) for i in range(0, len(kv), 2)]
        return cls(layers, tensors[-2], tensors[-1])
