"""int8 and int4 weights multiplied on CUDA: a Triton kernel that widens each tile of codes in
registers as it multiplies (``x @ W^T``), straight from the canonical layouts (:mod:`quant.formats`).

Why not torch's own ops: on the first GPU run (an H200, Llama-2-7B shapes) ``_weight_int8pack_mm``
took 28 s to prefill a 2,000-token prompt and decoded at 3% of the card's bandwidth, and tinygemm
(``_weight_int4pack_mm``) prefilled eleven times slower than fp16's cuBLAS (it is tuned for a few
rows). Here one kernel serves both ends:

* a few rows (decode, a verify step): tiles of 16 rows by 32 outputs with the input width split
  across programs (``split``) so that every SM streams its share of the codes; the partial sums are
  added in fp32 afterwards;
* many rows (prefill): 64-128 row tiles on the tensor cores, each code tile read once per row tile.

Values: int8 ``q * scale`` (per channel: the scale applied to the fp32 sums, exact integer products
before it; per group: each code scaled in fp32 and rounded to the activation dtype, as the reference
rounds its dequantized weight); int4 ``q * scale + offset`` per group, rounded the same way. fp32
activations multiply in true fp32 (``input_precision="ieee"``: no TF32). ``TRITON_INTERPRET=1`` runs
the same source on CPU tensors: ``tests/test_int_triton.py`` checks it against the reference there.
"""

from __future__ import annotations

import functools

import torch

from localllm.triton_kernels import available, check_device, jit

if available():  # only on CUDA (and in the interpreter's checks): the CPU path never imports this module
    import triton.language as tl


@jit
def _int_mm(
    X, Q, S, O, Y, M, N, K, k_per_split, sxm, sqn, ssn, sym, syk,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSETS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN: tl.constexpr,
):
    # GROUP (0: one scale per output channel) is a constant so that the compiler knows a scale is the
    # same for GROUP columns and loads it once; EVEN_K: the width is a whole number of tiles, no mask.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # the slice of the input width this program sums
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    rows = n.to(tl.int64)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.minimum(K, (pid_k + 1) * k_per_split)
    for k0 in range(pid_k * k_per_split, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # int4: the bytes of columns k
        if EVEN_K:  # masks broadcast over the tile
            ok = n_ok[:, None]
            x_ok = m_ok[:, None]
            kb_ok = n_ok[:, None]
        else:
            ok = n_ok[:, None] & (k < k_end)[None, :]
            x_ok = m_ok[:, None] & (k < k_end)[None, :]
            kb_ok = n_ok[:, None] & (2 * kb < k_end)[None, :]
        x = tl.load(X + m[:, None] * sxm + k[None, :], mask=x_ok, other=0.0)
        if BITS == 8:
            q = tl.load(Q + rows * sqn + k[None, :], mask=ok, other=0).to(tl.float32)  # (BN, BK)
        else:  # two codes a byte, the even column in the low nibble: each byte read once
            byte = tl.load(Q + rows * sqn + kb[None, :], mask=kb_ok, other=0)
            q = tl.interleave(byte & 15, byte >> 4).to(tl.float32)  # (BN, BK): columns 2j, 2j + 1
        if GROUP == 0:
            w = q  # integers: exact in any activation dtype; the scale comes after the sums
        else:
            at = rows * ssn + (k // GROUP)[None, :]
            w = q * tl.load(S + at, mask=ok, other=0.0).to(tl.float32)
            if OFFSETS:
                w += tl.load(O + at, mask=ok, other=0.0).to(tl.float32)
        if WIDEN:  # Triton's interpreter: the values the GPU multiplies, multiplied in fp32
            if X.dtype.element_ty == tl.bfloat16:  # rounded to nearest even by hand: the interpreter truncates
                bits = w.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                w = bits.to(tl.float32, bitcast=True)
            else:
                w = w.to(X.dtype.element_ty).to(tl.float32)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(X.dtype.element_ty)), input_precision="ieee")
    if GROUP == 0:
        acc *= tl.load(S + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = Y + pid_k * syk + m[:, None] * sym + n[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a CUDA one; 8 in the interpreter, so that its checks
    take the split path)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split(programs: int, k_steps: int, sms: int) -> int:
    """How many slices of the input width a few rows' product is cut into: doubled while the programs
    do not fill the SMs twice over and each slice keeps at least four steps of the loop."""
    split = 1
    while programs * split < 2 * sms and k_steps >= 8 * split:
        split *= 2
    return split


def tiles(rows: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for ``rows`` activation rows of ``dtype``: a few rows'
    thin tiles, then 64- and 128-row ones (fp32 tiles hold twice the bytes: smaller)."""
    wide = dtype == torch.float32
    if rows <= 16:
        return 16, 32, 64 if wide else 128, 4, 3
    if rows <= 64:
        return (64, 64, 32, 4, 3) if wide else (64, 128, 64, 4, 3)
    return (64, 64, 32, 4, 2) if wide else (128, 128, 64, 8, 3)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
           bits: int, group: int | None, in_features: int) -> None:
    """The layouts the kernel reads (run by the op and by its fake, so a traced or dry run checks them
    too). Called at every matmul: the conditions are plain comparisons, the message is built only when
    one fails."""
    N, K = qweight.shape[0], in_features
    codes = (torch.int8, (N, K)) if bits == 8 else (torch.uint8, (N, K // 2))
    groups = (N,) if group is None else (N, K // group)
    tensors = (qweight, scales) if offsets is None else (qweight, scales, offsets)
    if (x.dim() == 2 and x.shape[1] == K and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and (qweight.dtype, tuple(qweight.shape)) == codes and qweight.stride(1) == 1
            and (group is None or K % group == 0) and tuple(scales.shape) == groups and scales.stride(-1) == 1
            and (bits == 8 or (group is not None and offsets is not None and offsets.shape == scales.shape
                               and offsets.stride() == scales.stride()))
            and all(t.device == x.device for t in tensors)):
        return
    raise ValueError(
        f"int{bits} Triton matmul: x {x.dtype} {tuple(x.shape)} (rows, {K} wanted), codes {qweight.dtype} "
        f"{tuple(qweight.shape)} stride {qweight.stride()} ({codes[0]} {codes[1]} wanted), group {group}, scales "
        f"{tuple(scales.shape)} ({groups} wanted), offsets {None if offsets is None else tuple(offsets.shape)} "
        f"(int4: laid out as the scales), devices {[str(t.device) for t in (x, *tensors)]}")


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
            bits: int, group: int | None, in_features: int) -> torch.Tensor:
    _check(x, qweight, scales, offsets, bits, group, in_features)
    M, K, N = x.shape[0], in_features, qweight.shape[0]
    if M == 0 or N == 0:
        return x.new_empty(M, N)
    check_device(x, f"int{bits}")
    x = x.contiguous()
    block_m, block_n, block_k, warps, stages = tiles(M, x.dtype)
    k_steps = -(-K // block_k)
    grid_mn = (-(-M // block_m), -(-N // block_n))
    split = _split(grid_mn[0] * grid_mn[1], k_steps, _sms(x.device)) if M <= 16 else 1
    k_per_split = -(-k_steps // split) * block_k
    split = -(-K // k_per_split)  # no empty slice
    interpreted = x.device.type != "cuda"
    # Partial sums in fp32, added and rounded by torch: also the interpreter's output (it truncates to bf16).
    sums = split > 1 or (interpreted and x.dtype != torch.float32)
    y = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if sums else x.new_empty(M, N)
    per_channel = scales.dim() == 1
    _int_mm[(*grid_mn, split)](
        x, qweight, scales, offsets if offsets is not None else scales, y, M, N, K, k_per_split,
        x.stride(0), qweight.stride(0), 0 if per_channel else scales.stride(0),
        y.stride(-2), y.stride(0) if sums else 0,
        BITS=bits, GROUP=group or 0, OFFSETS=offsets is not None, EVEN_K=K % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        WIDEN=interpreted and x.dtype != torch.float32, num_warps=warps, num_stages=stages)
    return y.sum(0).to(x.dtype) if sums else y


@torch.library.custom_op("localllm::int_mm_cuda", mutates_args=())
def _int_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
            bits: int, group: int | None, in_features: int) -> torch.Tensor:
    return _launch(x, qweight, scales, offsets, bits, group, in_features)


@_int_op.register_fake
def _(x, qweight, scales, offsets, bits, group, in_features):
    _check(x, qweight, scales, offsets, bits, group, in_features)
    return x.new_empty(x.shape[0], qweight.shape[0])


def int_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
           group: int | None) -> torch.Tensor:
    """``x @ W^T``: x (M, in) in the activation dtype; W int8 (``qweight`` int8 (out, in), ``scales``
    (out,) per channel or (out, in / group)) or int4 (``qweight`` uint8 (out, in / 2), two codes a byte,
    the even column in the low nibble; ``scales`` and ``offsets`` (out, in / group)) -> (M, out) in x's dtype."""
    bits = 8 if qweight.dtype == torch.int8 else 4
    return _int_op(x, qweight, scales, offsets, bits, group, qweight.shape[1] * (8 // bits))
