"""What the KV cache stores, and how: its element types, int8 codes with their scales and key rotation.

The cache itself is the batch engine's paged pool (:mod:`runtime.kv_pool`), whose tensors these
helpers make and whose rows the model writes (:func:`runtime.attention.attend`).
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
    """``kv_dtype``, one of :data:`KV_DTYPES`; else the user-facing error."""
    if kv_dtype not in KV_DTYPES:
        raise LocalLLMError(f"unknown KV cache type {kv_dtype!r}", f"use one of: {', '.join(KV_DTYPES)}")
    return kv_dtype


class QuantKV(NamedTuple):
    """Keys or values of an int8 cache: ``codes`` (..., L, hd) int8 and ``scales`` (..., L) fp32, one
    per row (a token of one kv head); a row's values are ``codes * scale``. A view of a cache (or of the
    paged pool) is a pair of views, so slicing rows copies nothing."""

    codes: torch.Tensor
    scales: torch.Tensor

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
    if check_kv_dtype(kv_dtype) != "fp16":
        return dtype
    if dtype == torch.bfloat16:
        raise LocalLLMError("an fp16 KV cache is for float32 (or float16) activations, not bfloat16",
                            "use --kv-cache 16bit (bf16 already) or int8")
    return torch.float16


def head_row_bytes(kv_dtype: str, dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one token's keys (or values) in one kv head of a ``kv_dtype`` cache under ``dtype``
    activations: ``head_dim`` elements of the cache's dtype, or for int8 a byte each and the row's fp32
    scale. Every KV byte count (:mod:`runtime.kv_pool`'s) is made of these."""
    if check_kv_dtype(kv_dtype) == "int8":
        return head_dim + 4
    return head_dim * kv_storage(kv_dtype, dtype).itemsize


def kv_label(kv_dtype: str, dtype: torch.dtype) -> str:
    """The cache's elements in words ("float32", "float16", "int8 + fp32 scales")."""
    if check_kv_dtype(kv_dtype) == "int8":
        return "int8 + fp32 scales"
    return str(kv_storage(kv_dtype, dtype)).removeprefix("torch.")


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
