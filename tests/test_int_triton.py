"""The Triton int8 / int4 kernel (:mod:`quant.int_triton`, CUDA's kernel for those schemes) checked
on any machine in Triton's interpreter: random weights quantized per channel and per group, at one
activation row with the input width split across programs (decode), at two over a width of partial
tiles, and at 40 and 130 rows (prefill tiles of 64 and 128, partial ones), in fp32, fp16 and bf16, against the dequantized weight rounded
to the activation dtype (the reference's rounding) and summed in float64. The bound is half a unit
in the last place of each output plus fp32 summation error, so a wrong scale, offset or nibble
order fails by far; then the kernels' glue (layout, group, the check at load) and the CUDA choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from localllm import triton_kernels
from localllm.quant import kernels
from localllm.quant.formats import dequantize, parse_scheme, quantize
from localllm.quant.linear import QuantLinear
from localllm.quant.target import Target

on_cpu = pytest.mark.skipif(not triton_kernels.available() or not triton_kernels.interpreting(),
                            reason="triton is not installed (dev extra), or a GPU is here (the cuda test runs)")

SCHEMES = [("int8", None), ("int8", 32), ("int4", 32), ("int4", 128)]
#: (rows, input width): one row split across programs, two rows over a width that is not a whole number
#: of tiles (masked), a 64-row tile, two 128-row tiles (one partial). A width the group does not divide
#: is left out (no such layer exists).
SHAPES = [(1, 2048), (2, 1056), (40, 512), (130, 256)]
#: mantissa bits of each activation dtype (half an ulp of an output is 2 ** -(bits + 1) of it)
MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def layer_tensors(name: str, group: int | None, out: int, inp: int, seed: int) -> tuple[dict, object]:
    g = torch.Generator().manual_seed(seed)
    scheme = parse_scheme(name, group)
    return quantize(torch.randn(out, inp, generator=g), scheme), scheme


def multiply(t: dict, scheme, x: torch.Tensor) -> torch.Tensor:
    from localllm.quant import int_triton

    return int_triton.int_mm(x, t["qweight"], t["scales"], t.get("offsets"), scheme.group_size)


def check(name: str, group: int | None, device: str = "cpu") -> None:
    out = 72  # a partial tile of output columns
    for rows, inp in [(r, i) for r, i in SHAPES if i % (group or 1) == 0]:
        t, scheme = layer_tensors(name, group, out, inp, seed=rows)
        t = {k: v.to(device) for k, v in t.items()}
        x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(inp))
        for dtype, bits in MANTISSA.items():
            xd = x.to(dtype)
            got = multiply(t, scheme, xd.to(device)).cpu()
            assert got.shape == (rows, out) and got.dtype == dtype
            w = dequantize({k: v.cpu() for k, v in t.items()}, scheme, torch.float64)
            if not (scheme.name == "int8" and group is None):
                w = w.to(dtype).double()  # grouped: each weight rounded to the activations' dtype first
            want = xd.double() @ w.T
            bound = 2.0 ** -(bits + 1) * want.abs() + 1e-6 * (xd.double().abs() @ w.abs().T)
            excess = ((got.double() - want).abs() - bound).max().item()
            assert excess <= 0, (name, group, rows, dtype, excess)


@on_cpu
@pytest.mark.parametrize("name,group", SCHEMES)
def test_products_are_the_references_to_half_an_ulp(name, group):
    check(name, group)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,group", SCHEMES)
def test_the_compiled_kernel_on_a_gpu(name, group):
    check(name, group, "cuda")


@on_cpu
@pytest.mark.parametrize("kernel,name,group", [("int4-triton-cuda", "int4", 64), ("int8-triton-cuda", "int8", None),
                                               ("int8-triton-cuda", "int8", 64)])
def test_the_kernels_glue_passes_the_check_at_load(kernel, name, group):
    """The layer's tensors as ``prepare`` leaves them, multiplied by ``matmul`` (CPU tensors, in the
    interpreter), against the reference: the check a real load runs on the GPU; and a layer whose
    offsets are swapped for its scales fails it."""
    layer = QuantLinear(256, 96, parse_scheme(name, group))
    for k, v in quantize(torch.randn(96, 256, generator=torch.Generator().manual_seed(3)), layer.scheme).items():
        setattr(layer, k, v)
    layer.act_dtype = torch.float16
    k = kernels.BY_NAME[kernel]
    tensors = k.prepare(layer)
    assert kernels.agrees_with_reference(layer, k, tensors)
    if name == "int4":
        wrong = {**tensors, "offsets": tensors["scales"]}
        assert not kernels.agrees_with_reference(layer, k, wrong)


@pytest.mark.skipif(not triton_kernels.available(), reason="triton is not installed (dev extra)")
def test_the_cuda_selection_takes_them():
    """On an sm89 target int4 and int8 (per channel or grouped) layers get the Triton kernels, for any
    activation dtype; tinygemm is still there when named."""
    target = Target(torch.device("cuda", 0), (8, 9))
    for name, group, want in (("int4", 32, "int4-triton-cuda"), ("int8", None, "int8-triton-cuda"),
                              ("int8", 32, "int8-triton-cuda")):
        layer = QuantLinear(256, 64, parse_scheme(name, group))
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert kernels.candidates(layer, target, dtype)[0].name == want, (name, group, dtype)
    layer = QuantLinear(256, 64, parse_scheme("int4", 32))
    assert kernels.BY_NAME["int4-tinygemm-cuda"].supports(layer, target, torch.bfloat16)


#: Shared memory a block may use on an sm86 card (RTX 30 series), the smallest of the GPUs it targets.
SM86_SHARED = 101376
#: Run in a process of its own: Triton compiles for a GPU only where its interpreter is off.
COMPILE = """
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from localllm.quant import int_triton
dtype = getattr(torch, sys.argv[1])
act = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
shared = {}
for rows in (1, 40, 300):
    block_m, block_n, block_k, warps, stages = int_triton.tiles(rows, dtype)
    for bits, group in ((8, 0), (4, 32)):
        signature = {"X": "*" + act, "Q": "*i8" if bits == 8 else "*u8", "S": "*fp16", "O": "*fp16", "Y": "*" + act}
        signature.update({a: "i32" for a in ("M", "N", "K", "k_per_split", "sxm", "sqn", "ssn", "sym", "syk")})
        constants = dict(BITS=bits, GROUP=group, OFFSETS=bits == 4, EVEN_K=True, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_K=block_k, WIDEN=False)
        signature.update({name: "constexpr" for name in constants})
        compiled = triton.compile(ASTSource(int_triton._int_mm, signature, constants),
                                  target=GPUTarget("cuda", 86, 32), options=dict(num_warps=warps, num_stages=stages))
        shared[f"{rows} rows, int{bits}"] = compiled.metadata.shared
print(json.dumps(shared))
"""


@pytest.mark.skipif(not triton_kernels.available(), reason="triton is not installed (dev extra)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_it_compiles_for_a_consumer_gpu_without_one(dtype):
    """Triton compiles the kernel ahead of time for sm86 (its own ptxas, no GPU needed): every tile
    shape the launch picks for this dtype, int8 per channel and int4 per group, within the shared
    memory such a card gives a block. (The interpreter checks numbers, not what the compiler accepts.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default today, said so that it does not warn
    done = subprocess.run([sys.executable, "-c", COMPILE, dtype], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(shared) == 6 and all(0 < b <= SM86_SHARED for b in shared.values()), shared
