"""GGUF blocks multiplied on CUDA: a Triton kernel that decodes each block of the file's bytes in
registers as it multiplies (``x @ W^T``), for the types a Q4_K_M / Q5_K_M / Q6_K file holds and
gpt-oss's MXFP4 experts.

Without it a GGUF's K-quant layers on a GPU went through the reference: the layer's blocks copied to
the host, decoded by numpy and sent back at every call. Here the bytes stay where they are loaded
(``blocks`` uint8 (out, in / QK * bytes), :mod:`quant.formats`) and each program decodes a tile of
output rows one block at a time:

* values as the file defines them: K-quants' products of the fp16 super-block scales and the 6-bit
  (Q4_K, Q5_K) or int8 (Q6_K) sub-scales formed in fp32, in ggml's order (``d * sc * q - dmin * m``),
  as ``gguf.quants.dequantize`` and the CPU kernel form them;
* the decoded tile rounded to the activations' dtype for the tensor cores (what the reference does
  with its decoded weight: ``F.linear`` in the activation dtype), fp32 accumulation;
* ``TRITON_INTERPRET=1`` runs the same source on CPU tensors: ``tests/test_gguf_triton.py`` checks
  every type against ``gguf``'s own decoder that way.

ggml layouts (little-endian), element ``e`` of a block:

* Q4_0 (18 B): fp16 d, 16 B codes: ``(q - 8) * d``; Q4_1 (20 B): d, m: ``q * d + m``; byte ``e % 16``,
  high nibble for ``e >= 16``. Q5_0 (22 B): d, 4 B of fifth bits (bit ``e``), 16 B codes: ``(q - 16)
  * d``; Q5_1 (24 B): d, m, then the same: ``q * d + m``. Q8_0 (34 B): d, 32 int8: ``q * d``.
* Q4_K (144 B): d, dmin, 12 B of 6-bit scales and mins for 8 sub-blocks of 32, 128 B of codes (byte
  ``32 (e // 64) + e % 32``, high nibble in odd sub-blocks). Q5_K (176 B): the same plus 32 B of fifth
  bits before the codes (bit ``e // 32`` of byte ``e % 32``).
* Q6_K (210 B): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales (one per 16), fp16 d last.
* MXFP4 (17 B): an E8M0 byte e, 16 B of E2M1 codes as Q4_0's: ggml's doubled value (0, 1, 2, 3, 4, 6,
  8, 12, the top bit the sign) times ``2^(e - 128)``, exact in fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from localllm.quant.formats import GGUF_BLOCKS
from localllm.triton_kernels import available, check_device, jit

if available():  # only on CUDA (and in the interpreter's checks): the CPU path never imports this module
    import triton.language as tl

#: The block types this kernel decodes (the others stay on the reference).
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
_CODE = {name: i for i, name in enumerate(TYPES)}


@jit
def _gguf_mm(
    X, B, Y, M, N, n_blocks, row_bytes, sxm, sym,
    QTYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WIDEN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    e = tl.arange(0, QK)  # element of a block
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for blk in range(0, n_blocks):
        base = n.to(tl.int64)[:, None] * row_bytes + blk * TS  # (BLOCK_N, 1): each row's block
        ok = n_ok[:, None]
        if QTYPE <= 4:  # 32-wide blocks
            lo = tl.load(B + base, mask=ok, other=0).to(tl.uint16)
            hi = tl.load(B + base + 1, mask=ok, other=0).to(tl.uint16)
            d = (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)  # (BLOCK_N, 1)
            if QTYPE == 4:  # Q8_0
                q = tl.load(B + base + 2 + e[None, :], mask=ok, other=0).to(tl.int8, bitcast=True)
                w = q.to(tl.float32) * d
            else:
                if QTYPE % 2 == 1:  # Q4_1, Q5_1: fp16 m after d
                    lo = tl.load(B + base + 2, mask=ok, other=0).to(tl.uint16)
                    hi = tl.load(B + base + 3, mask=ok, other=0).to(tl.uint16)
                    mn = (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
                codes: tl.constexpr = 2 + 2 * QTYPE  # where the codes start: Q4_0 2, Q4_1 4, Q5_0 6, Q5_1 8
                byte = tl.load(B + base + codes + (e % 16)[None, :], mask=ok, other=0)
                q = ((byte >> (4 * (e // 16))[None, :]) & 15).to(tl.int32)
                if QTYPE >= 2:  # Q5_0, Q5_1: the fifth bits, bit e of 4 bytes
                    bits = tl.load(B + base + codes - 4 + (e // 8)[None, :], mask=ok, other=0)
                    q = q | (((bits >> (e % 8)[None, :]) & 1).to(tl.int32) << 4)
                if QTYPE == 0:
                    w = (q - 8).to(tl.float32) * d
                elif QTYPE == 2:
                    w = (q - 16).to(tl.float32) * d
                else:
                    w = q.to(tl.float32) * d + mn
        elif QTYPE <= 6:  # Q4_K, Q5_K
            lo = tl.load(B + base, mask=ok, other=0).to(tl.uint16)
            hi = tl.load(B + base + 1, mask=ok, other=0).to(tl.uint16)
            d = (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            lo = tl.load(B + base + 2, mask=ok, other=0).to(tl.uint16)
            hi = tl.load(B + base + 3, mask=ok, other=0).to(tl.uint16)
            dmin = (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            j = (e // 32)[None, :]  # sub-block 0..7
            s_j = tl.load(B + base + 4 + j, mask=ok, other=0).to(tl.int32)
            s_j4 = tl.load(B + base + 8 + j, mask=ok, other=0).to(tl.int32)
            s_jm4 = tl.load(B + base + 4 + tl.maximum(j - 4, 0), mask=ok, other=0).to(tl.int32)
            sc = tl.where(j < 4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
            mn = tl.where(j < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
            codes: tl.constexpr = 16 + 32 * (QTYPE - 5)  # Q4_K 16, Q5_K 48 (after the fifth bits)
            byte = tl.load(B + base + codes + (32 * (e // 64) + e % 32)[None, :], mask=ok, other=0)
            q = ((byte >> (4 * ((e // 32) % 2))[None, :]) & 15).to(tl.int32)
            if QTYPE == 6:
                bits = tl.load(B + base + 16 + (e % 32)[None, :], mask=ok, other=0).to(tl.int32)
                q = q | (((bits >> j) & 1) << 4)
            w = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)
        elif QTYPE == 7:  # Q6_K
            half = (e // 128)[None, :]
            part = ((e % 128) // 32)[None, :]
            l = (e % 32)[None, :]
            low = tl.load(B + base + 64 * half + l + 32 * (part % 2), mask=ok, other=0)
            low = ((low >> (4 * (part // 2))) & 15).to(tl.int32)
            high = tl.load(B + base + 128 + 32 * half + l, mask=ok, other=0)
            high = ((high >> (2 * part)) & 3).to(tl.int32)
            q = (low | (high << 4)) - 32
            sc = tl.load(B + base + 192 + 8 * half + l // 16 + 2 * part, mask=ok, other=0)
            sc = sc.to(tl.int8, bitcast=True).to(tl.float32)
            lo = tl.load(B + base + 208, mask=ok, other=0).to(tl.uint16)
            hi = tl.load(B + base + 209, mask=ok, other=0).to(tl.uint16)
            d = (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            w = (d * sc) * q.to(tl.float32)
        else:  # MXFP4: E8M0 e, then the codes as Q4_0's; ggml's doubled E2M1 value times 2^(e - 128)
            e8 = tl.load(B + base, mask=ok, other=0).to(tl.int32)  # (BLOCK_N, 1)
            d = tl.where(e8 < 2, 0x00200000 << e8, (e8 - 1) << 23).to(tl.float32, bitcast=True)
            byte = tl.load(B + base + 1 + (e % 16)[None, :], mask=ok, other=0)
            q = ((byte >> (4 * (e // 16))[None, :]) & 15).to(tl.int32)
            mag = q & 7  # 0, 1, 2, 3, then 4, 6, 8, 12: (2 or 3) << 1 or 2
            mag = tl.where(mag < 4, mag, (2 + (mag & 1)) << ((mag >> 1) - 1))
            w = tl.where(q >= 8, -mag, mag).to(tl.float32) * d
        x = tl.load(X + m[:, None] * sxm + blk * QK + e[None, :], mask=m_ok[:, None], other=0.0)  # (BM, QK)
        if WIDEN:  # bf16 in Triton's interpreter: the same rounded values, multiplied in fp32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(X.dtype.element_ty).to(tl.float32)),
                          input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(X.dtype.element_ty)), input_precision="ieee")
    tl.store(Y + m[:, None] * sym + n[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch(x: torch.Tensor, blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    _, qk, ts = GGUF_BLOCKS[qtype]
    M, N = x.shape[0], blocks.shape[0]
    y = x.new_empty(M, N)
    if M == 0 or N == 0:
        return y
    check_device(x, "GGUF")
    x = x.contiguous()
    block_m = 16 if M <= 16 or x.dtype == torch.float32 else 64  # fp32 tiles: twice the shared memory
    block_n = 32 if qk == 256 else 64
    grid = (-(-M // block_m), -(-N // block_n))
    _gguf_mm[grid](x, blocks, y, M, N, in_features // qk, blocks.stride(0), x.stride(0), y.stride(0),
                    QTYPE=_CODE[qtype], QK=qk, TS=ts, BLOCK_M=block_m, BLOCK_N=block_n,
                    WIDEN=x.dtype == torch.bfloat16 and x.device.type != "cuda", num_warps=4,
                  num_stages=1 if x.dtype == torch.float32 else 2)
    return y


@torch.library.custom_op("localllm::gguf_mm_cuda", mutates_args=())
def _gguf_op(x: torch.Tensor, blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    return _launch(x, blocks, qtype, in_features)


@_gguf_op.register_fake
def _(x, blocks, qtype, in_features):
    return x.new_empty(x.shape[0], blocks.shape[0])


def gguf_mm(x: torch.Tensor, blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """``x @ W^T``: x (M, in) in the activation dtype, W the (out, in) weight whose rows are ``blocks``
    (uint8 (out, in / QK * bytes)) of GGUF type ``qtype`` (one of :data:`TYPES`) -> (M, out) in x's dtype."""
    return _gguf_op(x, blocks, qtype, in_features)
