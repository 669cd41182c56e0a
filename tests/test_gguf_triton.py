"""The Triton GGUF kernel (:mod:`quant.gguf_triton`, CUDA's kernel for a GGUF's blocks) checked on any
machine in Triton's interpreter: for every block type it decodes, random blocks (fp16 scales kept
finite) against ``gguf``'s own decoder in float64, at one activation row (decode) and at 40 (a
prefill tile and a partial one), in fp32, fp16 and bf16; and the kernel the CUDA selection gives a
GGUF layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localllm import triton_kernels
from localllm.quant import gguf_triton
from localllm.quant.formats import GGUF_BLOCKS, QuantScheme, dequantize

on_cpu = pytest.mark.skipif(not triton_kernels.available() or not triton_kernels.interpreting(),
                            reason="triton is not installed (dev extra), or a GPU is here (the cuda test runs)")

#: Where each type keeps its fp16 scales (byte offsets in a block): set to finite values.
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (208,), "MXFP4": ()}


def random_blocks(qtype: str, out: int, inp: int, seed: int) -> torch.Tensor:
    """(out, in / QK * bytes) uint8: random bytes, each block's fp16 scales drawn small and finite."""
    _, qk, ts = GGUF_BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out, inp // qk, ts), dtype=np.uint8)
    for at in HALVES[qtype]:
        scales = (rng.standard_normal((out, inp // qk)) * 0.02).astype(np.float16)
        raw[:, :, at : at + 2] = scales.view(np.uint8).reshape(out, inp // qk, 2)
    if qtype == "MXFP4":  # E8M0 scale bytes: 2^-8 .. 2^-3, as a trained model's
        raw[:, :, 0] = rng.integers(119, 125, size=(out, inp // qk), dtype=np.uint8)
    return torch.from_numpy(raw.reshape(out, -1).copy())


def check_type(qtype: str, device: str = "cpu") -> None:
    """Random blocks of ``qtype`` multiplied on ``device`` (cpu: the interpreter) against gguf's decoder."""
    _, qk, _ = GGUF_BLOCKS[qtype]
    out, inp = 72, 2 * max(qk, 256)  # 72: a partial tile of output rows
    blocks = random_blocks(qtype, out, inp, seed=len(qtype) + qk)
    w = dequantize({"blocks": blocks}, QuantScheme("gguf", gguf_type=qtype), torch.float64)  # (out, in)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 40):
        x = torch.randn(rows, inp, generator=gen)
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
            xd = x.to(dtype)
            got = gguf_triton.gguf_mm(xd.to(device), blocks.to(device), qtype, inp).cpu()
            assert got.shape == (rows, out) and got.dtype == dtype
            # the reference's rounding: the decoded weight in the activation dtype, then fp64 sums
            want = xd.double() @ w.to(dtype).double().T
            err = (got.double() - want).abs().max().item()
            assert err <= tol * max(1.0, want.abs().max().item()), (qtype, rows, dtype, err)


@on_cpu
@pytest.mark.parametrize("qtype", gguf_triton.TYPES)
def test_every_type_decodes_as_ggufs_own_decoder(qtype):
    check_type(qtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qtype", gguf_triton.TYPES)
def test_the_compiled_kernel_decodes_every_type_on_a_gpu(qtype):
    check_type(qtype, "cuda")


@pytest.mark.skipif(not triton_kernels.available(), reason="triton is not installed (dev extra)")
def test_the_cuda_selection_takes_it_for_gguf_blocks():
    """On a CUDA target a GGUF layer of these types gets the Triton kernel; others say why not."""
    from localllm.quant import kernels
    from localllm.quant.linear import QuantLinear
    from localllm.quant.target import Target

    target = Target(torch.device("cuda", 0), (8, 9))
    for qtype, want in (("Q4_K", "gguf-blocks-cuda"), ("Q6_K", "gguf-blocks-cuda"), ("Q3_K", "reference")):
        layer = QuantLinear(256, 64, QuantScheme("gguf", gguf_type=qtype))
        got = [k.name for k in kernels.candidates(layer, target, torch.float16)]
        assert got[0] == want, (qtype, got)
    layer = QuantLinear(256, 64, QuantScheme("gguf", gguf_type="Q3_K"))
    assert "gguf-blocks-cuda has no Triton decoder for Q3_K" in kernels.why_not_fast(layer, target, torch.float16)
