"""Preallocated key/value caches, owned by the sequence they hold, not by the model.

The model is stateless across sequences (design.md): whoever runs a sequence (a
:class:`runtime.generate.Generator`) makes a :class:`SequenceCache` with
:meth:`runtime.model.Transformer.new_cache` and hands it to every forward. Two generators on one
model therefore never see each other's keys, and a cache-less forward (perplexity windows) cannot
disturb a live one.
"""

from __future__ import annotations

import torch


def attention_mask(start: int, T: int, kv_len: int, window: int | None,
                   device: torch.device) -> torch.Tensor | None:
    """Mask of queries at positions ``start .. start + T - 1`` over keys at ``0 .. kv_len - 1``:
    None when SDPA needs none (plain causal from position 0, or one query that sees every key), else
    (T, kv_len) bool, True = attend. A key is seen when ``q - window < k <= q``."""
    windowed = window is not None and kv_len > window
    if not windowed and (start == 0 or T == 1):
        return None
    q_pos = torch.arange(start, start + T, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if windowed:
        mask &= k_pos > q_pos - window
    return mask


class KVCache:
    """Keys and values of one attention layer, (B, kv_heads, max_seq, head_dim) each; or, for a
    sliding-window layer whose window is shorter than the sequence, a ring of (B, kv_heads, window,
    head_dim): position ``p`` lives in row ``p % window`` (:meth:`update_ring`).

    Allocated once, written in place: decoding allocates nothing per token. Its size is known
    before allocation (:meth:`runtime.config.ModelConfig.sequence_cache_bytes`).
    """

    __slots__ = ("k", "v", "window")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> None:
        self.k, self.v = k, v
        #: The ring's size (= the layer's attention window), or None for a whole-sequence cache.
        self.window = window

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` (B, kv_heads, T, head_dim) at positions ``input_pos`` (T,).

        Returns the whole buffers (B, kv_heads, max_seq, head_dim); the caller reads the prefix it needs.
        """
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v

    def update_ring(
        self, start: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A ring's step: ``k``, ``v`` (B, kv_heads, T, head_dim) at positions ``start .. start + T - 1``
        (``input_pos``). Returns the keys and values the queries attend over and their mask (as
        :func:`attention_mask`): the filled prefix while nothing has wrapped; the whole ring for one
        query (it then holds exactly the window); for a chunk that wraps, the ring as it was before
        the chunk followed by the chunk's own keys (a copy), masked by the position each row holds.
        """
        W = self.k.shape[2]
        T = k.shape[2]
        end = start + T
        if end <= W:
            self.k.index_copy_(2, input_pos, k)
            self.v.index_copy_(2, input_pos, v)
            return self.k[:, :, :end], self.v[:, :, :end], attention_mask(start, T, end, None, k.device)
        if T == 1:
            slot = start % W
            self.k[:, :, slot : slot + 1].copy_(k)
            self.v[:, :, slot : slot + 1].copy_(v)
            return self.k, self.v, None  # rows hold positions start - W + 1 .. start: the window
        rows = torch.arange(W, device=k.device)
        held = (start - 1) - torch.remainder(start - 1 - rows, W)  # (W,) position in each row; < 0: empty
        k_pos = torch.cat([held, input_pos])[None, :]  # (1, W + T)
        q_pos = input_pos[:, None]  # (T, 1)
        mask = (k_pos <= q_pos) & (k_pos > q_pos - W) & (k_pos >= 0)  # (T, W + T)
        k_ctx, v_ctx = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        keep = min(T, W)  # the chunk's last W keys stay
        slots = input_pos[-keep:].remainder(W)
        self.k.index_copy_(2, slots, k[:, :, -keep:])
        self.v.index_copy_(2, slots, v[:, :, -keep:])
        return k_ctx, v_ctx, mask

    def update_ring_static(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One query at ``input_pos`` (1,) (a tensor only: no host sync): write its row, return the whole
        ring and a (1, W) mask of the rows that hold a position (all of them once the ring is full)."""
        if k.shape[2] != 1:
            raise ValueError("a sliding-window ring cache's fixed-shape step takes one token at a time")
        W = self.k.shape[2]
        slot = input_pos.remainder(W)
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        rows = torch.arange(W, device=k.device)
        held = input_pos[:, None] - torch.remainder(input_pos[:, None] - rows[None, :], W)  # (1, W)
        return self.k, self.v, held >= 0


class SequenceCache:
    """The caches of one sequence (or a fixed batch of them): a :class:`KVCache` per layer, the RoPE
    tables for its ``max_seq`` positions, and the token ids whose keys/values it holds.

    The RoPE tables travel with the cache rather than living on the model so that a forward's every
    per-length tensor comes from one argument (what an exported step takes as inputs), and they are
    made once per cache, never per token.
    """

    def __init__(self, layers: list[KVCache], cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.layers = layers
        #: (max_seq, rotary dims) each, in the activation dtype; a model with a second RoPE base for its
        #: sliding layers (Gemma 3) has both tables side by side: (max_seq, 2 * rotary dims).
        self.cos, self.sin = cos, sin
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
        max_seq = tensors[-2].shape[0]
        layers = []
        for i in range(0, len(kv), 2):  # a ring is shorter than the sequence: its length is its window
            rows = kv[i].shape[2]
            layers.append(KVCache(kv[i], kv[i + 1], rows if rows < max_seq else None))
        return cls(layers, tensors[-2], tensors[-1])

    def nbytes(self) -> int:
        """Bytes of the keys and values (rings hold their window only)."""
        return sum(c.k.nbytes + c.v.nbytes for c in self.layers)

    def reusable(self, held: int, shared: int) -> int:
        """Of ``shared`` leading positions that a new prompt has in common with the ``held`` positions
        this cache was filled with, how many it can serve: all of them, unless a ring has since
        overwritten a row the next token needs (then none: the prompt is prefilled whole)."""
        for c in self.layers:
            if c.window is not None and held > c.window and shared < held - 1:
                return 0
        return shared
