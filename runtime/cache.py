"""Preallocated key/value caches, owned by the sequence they hold, not by the model.

The model is stateless across sequences (design.md): whoever runs a sequence (a
:class:`runtime.generate.Generator`) makes a :class:`SequenceCache` with
:meth:`runtime.model.Transformer.new_cache` and hands it to every forward. Two generators on one
model therefore never see each other's keys, and a cache-less forward (perplexity windows) cannot
disturb a live one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from localllm.errors import LocalLLMError

#: What a KV cache stores: "16bit" the keys and values as they are (the model's activation dtype: bf16,
#: or fp32 for an unquantized model on the CPU), "fp16" float16 whatever the activations (half the
#: bytes of an fp32 cache: with the CPU's fp32 activations a batched step's attention reads its keys
#: and values from memory, and this halves them; each value rounded once, to 11 significant bits),
#: "int8" an int8 code per value and an fp32 scale per token and kv head (:class:`QuantKV`), half
#: the bytes of a bf16 cache.
#:
#: An int8 cache holds each key rotated, ``k @ R`` with ``R`` orthogonal (:func:`key_rotation`), and
#: attention over it takes the query rotated alike: ``(q R) . (k R) = q . k``. Keys have a few
#: outlier channels that set a row's absmax and leave the rest a coarse grid; rotated, the energy is
#: spread over every channel. On SmolLM2 this cuts the KL divergence an int8 cache adds by ~3x
#: (keys' quantization is most of it; values are stored as they are). Attention over an int8 cache
#: runs in fp32 (rotated queries, dequantized rows, the kernel's probabilities): with bf16 activations
#: the extra bf16 roundings of rotated queries and dequantized keys cost more than the int8 grid.
KV_DTYPES = ("16bit", "fp16", "int8")
DEFAULT_KV_DTYPE = "16bit"
#: The largest int8 code of the symmetric grid: codes are -127 .. 127, x ~= code * absmax / 127.
Q8_MAX = 127.0


def check_kv_dtype(kv_dtype: str) -> str:
    """``kv_dtype`` when it is one of :data:`KV_DTYPES`; else the user-facing error."""
    if kv_dtype not in KV_DTYPES:
        raise LocalLLMError(f"unknown KV cache type {kv_dtype!r}", f"use one of: {', '.join(KV_DTYPES)}")
    return kv_dtype


class QuantKV(NamedTuple):
    """Keys or values of an int8 cache: ``codes`` (..., L, hd) int8 and ``scales`` (..., L) fp32, one
    per row (a token of one kv head); a row's values are ``codes * scale``. A view of a cache (or of the
    paged pool) is a pair of views, so slicing rows copies nothing."""

    codes: torch.Tensor
    scales: torch.Tensor

    def rows(self, end: int) -> "QuantKV":
        """The first ``end`` rows (axis 2) of a (B, KV, L, hd) cache: views."""
        return QuantKV(self.codes[:, :, :end], self.scales[:, :, :end])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The values (..., L, hd) in ``dtype``: a new tensor of these rows only."""
        return (self.codes.to(torch.float32) * self.scales.unsqueeze(-1)).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


_rotations: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def key_rotation(hd: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthogonal (hd, hd) matrix an int8 cache rotates keys (and queries) by: the normalised
    Sylvester Hadamard matrix when ``hd`` is a power of two, else a fixed (seeded) random orthogonal one."""
    key = (hd, dtype, torch.device(device))
    if key not in _rotations:
        if hd & (hd - 1) == 0:
            h = torch.ones(1, 1, dtype=torch.float64)
            while h.shape[0] < hd:
                h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
            r = h / hd ** 0.5
        else:
            gen = torch.Generator().manual_seed(hd)
            r, _ = torch.linalg.qr(torch.randn(hd, hd, generator=gen, dtype=torch.float64))
        r = r.to(dtype=dtype, device=key[2])
        if is_fake(r):  # made while tracing (FakeTensorMode): a fake tensor, not one to keep
            return r
        _rotations[key] = r
    return _rotations[key]


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., hd) times :func:`key_rotation`, in fp32 (what attention over an int8 cache runs in).
    One (rows, hd) x (hd, hd) mm: a batched matmul over a strided view would be a bmm, which wakes
    the thread pool for a decode step's few rows (~10 ms a call on a contended 2-core machine)."""
    hd = x.shape[-1]
    rows = x.to(torch.float32).reshape(-1, hd)  # (N, hd)
    return torch.mm(rows, key_rotation(hd, torch.float32, x.device)).view(x.shape)


def rotate_qk(q: torch.Tensor, k: torch.Tensor,
              rotation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotate` of queries (..., hd) and keys (..., hd) in one mm (``rotation``: the
    :func:`key_rotation` matrix, when the caller holds it)."""
    hd = q.shape[-1]
    rows = torch.cat([q.to(torch.float32).reshape(-1, hd), k.to(torch.float32).reshape(-1, hd)])  # (Nq + Nk, hd)
    out = torch.mm(rows, rotation if rotation is not None else key_rotation(hd, torch.float32, q.device))
    nq = q.numel() // hd
    return out[:nq].view(q.shape), out[nq:].view(k.shape)


def quantize_kv(x: torch.Tensor) -> QuantKV:
    """Symmetric absmax int8 of each row of ``x`` (..., hd): codes (..., hd) int8, scales (...) fp32
    (0 for a row of zeros, whose codes are 0)."""
    # Few ops: a decode step quantizes one row per kv head and layer, so the per-op overhead is the cost.
    xf = x.to(torch.float32)
    scales = xf.abs().amax(dim=-1, keepdim=True) * (1.0 / Q8_MAX)  # (..., 1)
    codes = (xf / scales.clamp_min(torch.finfo(torch.float32).tiny)).round_().to(torch.int8)  # |x| / s <= 127
    return QuantKV(codes, scales.squeeze(-1))


def quantize_pair(k: torch.Tensor, v: torch.Tensor) -> tuple[QuantKV, QuantKV]:
    """:func:`quantize_kv` of keys and values of one shape at once (one set of ops for both)."""
    both = quantize_kv(torch.stack([k.to(torch.float32), v.to(torch.float32)]))
    return QuantKV(both.codes[0], both.scales[0]), QuantKV(both.codes[1], both.scales[1])


def kv_storage(kv_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a float cache of ``kv_dtype`` under ``dtype`` activations. Refuses an fp16
    cache under bf16 activations (attention would round each row to bf16 again: use 16bit)."""
    if kv_dtype != "fp16":
        return dtype
    if dtype == torch.bfloat16:
        raise LocalLLMError("an fp16 KV cache is for float32 (or float16) activations, not bfloat16",
                            "use --kv-cache 16bit (bf16 already) or int8")
    return torch.float16


def kv_element(kv_dtype: str, dtype: torch.dtype) -> int | str:
    """What one cached value costs, as :meth:`runtime.config.ModelConfig.kv_cache_bytes` takes it."""
    return "int8" if kv_dtype == "int8" else kv_storage(kv_dtype, dtype).itemsize


def kv_label(kv_dtype: str, dtype: torch.dtype) -> str:
    """The cache's elements in words ("float32", "float16", "int8 + fp32 scales")."""
    return "int8 + fp32 scales" if kv_dtype == "int8" else str(kv_storage(kv_dtype, dtype)).removeprefix("torch.")


def empty_kv(shape: tuple[int, ...], kv_dtype: str, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor | QuantKV:
    """Zeroed storage for keys or values of ``shape`` (..., rows, hd): a tensor of ``dtype`` (float16 for
    an fp16 cache), or for an int8 cache the codes and their (..., rows) scales."""
    if kv_dtype == "int8":
        return QuantKV(torch.zeros(shape, dtype=torch.int8, device=device),
                       torch.zeros(shape[:-1], dtype=torch.float32, device=device))
    return torch.zeros(shape, dtype=kv_storage(kv_dtype, dtype), device=device)


def readable(x: torch.Tensor | QuantKV, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values as SDPA takes them, in ``dtype``: a float tensor as it is (an fp16 cache's rows
    widened), int8 rows dequantized."""
    if isinstance(x, QuantKV):
        return x.dequantize(dtype)
    return x if x.dtype == dtype else x.to(dtype)


def kv_rows(x: torch.Tensor | QuantKV, end: int) -> torch.Tensor | QuantKV:
    """The first ``end`` rows (axis 2) of a (B, KV, L, hd) cache: views."""
    return x.rows(end) if isinstance(x, QuantKV) else x[:, :, :end]


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

    ``k`` and ``v`` are tensors of the activation dtype (a "16bit" cache) or :class:`QuantKV` pairs (an
    "int8" cache: int8 codes of that shape and fp32 scales (B, kv_heads, rows)); new rows are
    quantized as they are written. The update methods return what attention reads in the same form
    (QuantKV views of an int8 cache, for the decode kernel; see :func:`readable` for SDPA).

    Allocated once, written in place: decoding allocates nothing per token but the new rows' codes.
    Its size is known before allocation (:meth:`runtime.config.ModelConfig.sequence_cache_bytes`).
    """

    __slots__ = ("k", "v", "window")

    def __init__(self, k: torch.Tensor | QuantKV, v: torch.Tensor | QuantKV, window: int | None = None) -> None:
        self.k, self.v = k, v
        #: The ring's size (= the layer's attention window), or None for a whole-sequence cache.
        self.window = window

    @property
    def quantized(self) -> bool:
        return isinstance(self.k, QuantKV)

    @property
    def rows(self) -> int:
        """Positions it holds (max_seq, or a ring's window)."""
        return self.k.shape[2] if isinstance(self.k, torch.Tensor) else self.k.codes.shape[2]

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor | QuantKV, torch.Tensor | QuantKV]:
        """New rows ``k``, ``v`` (B, kv_heads, T, hd) in the cache's form (quantized for an int8 cache,
        rounded to float16 for an fp16 one)."""
        if self.quantized:
            return quantize_pair(k, v)
        assert isinstance(self.k, torch.Tensor)
        return (k, v) if k.dtype == self.k.dtype else (k.to(self.k.dtype), v.to(self.k.dtype))

    @staticmethod
    def _write(dst: torch.Tensor | QuantKV, rows: torch.Tensor, src: torch.Tensor | QuantKV) -> None:
        """``dst``'s rows ``rows`` (n,) (axis 2) = ``src`` (B, kv_heads, n, hd), in place."""
        if isinstance(dst, QuantKV):
            assert isinstance(src, QuantKV)
            dst.codes.index_copy_(2, rows, src.codes)
            dst.scales.index_copy_(2, rows, src.scales)
        else:
            dst.index_copy_(2, rows, src)  # type: ignore[arg-type]

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor | QuantKV, torch.Tensor | QuantKV]:
        """Write ``k``, ``v`` (B, kv_heads, T, head_dim) at positions ``input_pos`` (T,).

        Returns the whole buffers (B, kv_heads, max_seq, head_dim); the caller reads the prefix it needs.
        """
        kq, vq = self._encode(k, v)
        self._write(self.k, input_pos, kq)
        self._write(self.v, input_pos, vq)
        return self.k, self.v

    def update_ring(
        self, start: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor | QuantKV, torch.Tensor | QuantKV, torch.Tensor | None]:
        """A ring's step: ``k``, ``v`` (B, kv_heads, T, head_dim) at positions ``start .. start + T - 1``
        (``input_pos``). Returns the keys and values the queries attend over and their mask (as
        :func:`attention_mask`): the filled prefix while nothing has wrapped; the whole ring for one
        query (it then holds exactly the window); for a chunk that wraps, the ring as it was before
        the chunk followed by the chunk's own keys (a copy, dequantized for an int8 cache), masked by
        the position each row holds.
        """
        W = self.rows
        T = k.shape[2]
        end = start + T
        kq, vq = self._encode(k, v)
        if end <= W:
            self._write(self.k, input_pos, kq)
            self._write(self.v, input_pos, vq)
            return kv_rows(self.k, end), kv_rows(self.v, end), attention_mask(start, T, end, None, k.device)
        if T == 1:
            slot = input_pos.remainder(W)
            self._write(self.k, slot, kq)
            self._write(self.v, slot, vq)
            return self.k, self.v, None  # rows hold positions start - W + 1 .. start: the window
        rows = torch.arange(W, device=k.device)
        held = (start - 1) - torch.remainder(start - 1 - rows, W)  # (W,) position in each row; < 0: empty
        k_pos = torch.cat([held, input_pos])[None, :]  # (1, W + T)
        q_pos = input_pos[:, None]  # (T, 1)
        mask = (k_pos <= q_pos) & (k_pos > q_pos - W) & (k_pos >= 0)  # (T, W + T)
        dtype = k.dtype
        k_ctx = torch.cat([readable(self.k, dtype), readable(kq, dtype)], dim=2)  # (B, KV, W + T, hd)
        v_ctx = torch.cat([readable(self.v, dtype), readable(vq, dtype)], dim=2)
        keep = min(T, W)  # the chunk's last W keys stay
        slots = input_pos[-keep:].remainder(W)
        self._write(self.k, slots, kv_tail(kq, keep))
        self._write(self.v, slots, kv_tail(vq, keep))
        return k_ctx, v_ctx, mask

    def update_ring_static(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One query at ``input_pos`` (1,) (a tensor only: no host sync): write its row, return the whole
        ring and a (1, W) mask of the rows that hold a position (all of them once the ring is full)."""
        if k.shape[2] != 1:
            raise ValueError("a sliding-window ring cache's fixed-shape step takes one token at a time")
        if self.quantized:
            raise ValueError("the fixed-shape (compiled) step does not take an int8 KV cache")
        assert isinstance(self.k, torch.Tensor) and isinstance(self.v, torch.Tensor)
        W = self.k.shape[2]
        slot = input_pos.remainder(W)
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        rows = torch.arange(W, device=k.device)
        held = input_pos[:, None] - torch.remainder(input_pos[:, None] - rows[None, :], W)  # (1, W)
        return self.k, self.v, held >= 0

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.k, self.v))


def kv_tail(x: torch.Tensor | QuantKV, n: int) -> torch.Tensor | QuantKV:
    """The last ``n`` rows (axis 2) of new keys or values (B, KV, T, hd)."""
    if isinstance(x, QuantKV):
        return QuantKV(x.codes[:, :, -n:], x.scales[:, :, -n:])
    return x[:, :, -n:]


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

    @property
    def kv_dtype(self) -> str:
        """"int8", "fp16" or "16bit" (see :data:`KV_DTYPES`)."""
        if self.layers and self.layers[0].quantized:
            return "int8"
        if self.layers and self.layers[0].k.dtype != self.cos.dtype:  # type: ignore[union-attr]
            return "fp16"
        return "16bit"

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, in a fixed order: k and v of each layer, then cos and sin (a 16-bit cache only:
        the fixed-shape step that takes them does not read int8 caches)."""
        if self.kv_dtype != "16bit":
            raise ValueError(f"an {self.kv_dtype} KV cache has no fixed-shape (compiled) form")
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
        return sum(c.nbytes for c in self.layers)

    def reusable(self, held: int, shared: int) -> int:
        """Of ``shared`` leading positions that a new prompt has in common with the ``held`` positions
        this cache was filled with, how many it can serve: all of them, unless a ring has since
        overwritten a row the next token needs (then none: the prompt is prefilled whole)."""
        for c in self.layers:
            if c.window is not None and held > c.window and shared < held - 1:
                return 0
        return shared
