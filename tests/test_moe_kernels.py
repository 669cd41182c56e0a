"""The native expert kernel (quant/expert_kernels.py, quant/csrc/moe_mm.cpp): a MoE layer's whole expert
FFN in one call equals the reference (quant.experts.ReferenceExperts) for every GGUF block type MoE
files use, for canonical int4 and int8 (held as Q4_1 / Q8_0 blocks of the same values, bit for bit),
fused and separate gate/up, few rows (the row kernel) and many (the panel GEMM); a row's result does
not depend on the rows beside it; the kernel is chosen when a layer is prepared; its fake traces."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from localllm import native
from localllm.quant.expert_kernels import MoEBlocksCPU, int4_as_q4_1, int8_as_q8_0
from localllm.quant.experts import EXPERT_KERNELS, QuantExperts, ReferenceExperts, prepare_experts
from localllm.quant.formats import dequantize, gguf_scheme, parse_scheme, quantize
from localllm.quant.native_ops import LIBRARY
from tests.test_gguf_cpu import random_blocks

needs_native = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler for localllm's CPU kernels")

E, D, F = 4, 256, 256  # experts, hidden, expert intermediate (K-quants need multiples of 256)


def gguf_experts(type_name: str, out: int, inp: int, seed: int) -> QuantExperts:
    """E experts of random ``type_name`` blocks (each expert's own draw)."""
    p = QuantExperts(E, inp, out, gguf_scheme(type_name))
    p.blocks = torch.from_numpy(np.stack([random_blocks(type_name, out, inp, seed * 100 + e) for e in range(E)]))
    return p


def quantized_experts(scheme_name: str, group: int | None, out: int, inp: int, seed: int) -> QuantExperts:
    scheme = parse_scheme(scheme_name, group)
    g = torch.Generator().manual_seed(seed)
    parts = [quantize(torch.randn(out, inp, generator=g) * 0.05, scheme) for _ in range(E)]
    p = QuantExperts(E, inp, out, scheme)
    for name in p.canonical_names():
        setattr(p, name, torch.stack([c[name] for c in parts]))
    return p


def routed(n: int, seed: int = 0, k: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, generator=g), -1)
    return x, ids, weights


def native_ffn(gate_up, down, x, ids, weights, act="silu") -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The kernel on its prepared layout (the canonical tensors left on the projections for the reference)."""
    projs = [*gate_up, down] if isinstance(gate_up, tuple) else [gate_up, down]
    saved = [p.canonical() for p in projs]
    for p in projs:
        p.blocks = MoEBlocksCPU.prepare(p)["blocks"]
    try:
        return MoEBlocksCPU.ffn(x, ids, weights, gate_up, down, act)
    finally:
        for p, s in zip(projs, saved):
            for name, v in s.items():
                setattr(p, name, v)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@needs_native
@pytest.mark.parametrize("types", [("Q4_K", "Q6_K"), ("Q4_0", "Q8_0"), ("Q5_0", "Q5_1"), ("Q4_1", "Q4_K"),
                                   ("Q5_K", "Q3_K"), ("Q2_K", "IQ4_NL")])
@pytest.mark.parametrize("rows", [1, 7, 64])  # 64 rows over 4 experts: the panel GEMM (32 rows an expert)
def test_gguf_experts_equal_the_reference(types, rows):
    assert native.available(LIBRARY)
    gate_type, down_type = types
    gate, up = gguf_experts(gate_type, F, D, 1), gguf_experts(gate_type, F, D, 2)
    down = gguf_experts(down_type, D, F, 3)
    x, ids, weights = routed(rows)
    want = ReferenceExperts.ffn(x, ids, weights, (gate, up), down, "silu")
    got = native_ffn((gate, up), down, x, ids, weights)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert relative_error(got, want) < 1e-5


@needs_native
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_int4_experts_fused_gate_up_equal_the_reference(act):
    gate_up = quantized_experts("int4", 32, 2 * F, D, 1)  # gate's rows, then up's, of each expert
    down = quantized_experts("int4", 128, D, F, 2)
    for rows in (3, 64):
        x, ids, weights = routed(rows, seed=rows)
        want = ReferenceExperts.ffn(x, ids, weights, gate_up, down, act)
        got = native_ffn(gate_up, down, x, ids, weights, act)
        assert relative_error(got, want) < 1e-5


@needs_native
def test_int8_experts_and_bf16_activations():
    gate, up = quantized_experts("int8", None, F, D, 1), quantized_experts("int8", 32, F, D, 2)
    down = quantized_experts("int8", None, D, F, 3)
    x, ids, weights = routed(9)
    want = ReferenceExperts.ffn(x, ids, weights, (gate, up), down, "silu")
    got = native_ffn((gate, up), down, x.bfloat16(), ids, weights)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, want) < 2e-2  # bf16 inputs and output
    assert relative_error(native_ffn((gate, up), down, x, ids, weights), want) < 1e-5


@pytest.mark.parametrize("group", [32, 64, 256])
def test_int4_as_q4_1_blocks_holds_the_same_weights(group):
    p = quantized_experts("int4", group, 16, 512, 0)
    blocks = int4_as_q4_1(p.qweight, p.scales, p.offsets)  # (E, 16, 512/32 * 20)
    for e in range(E):
        want = dequantize(p.expert(e), p.scheme).numpy()
        got = gguf.quants.dequantize(blocks[e].numpy(), gguf.GGMLQuantizationType.Q4_1)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("group", [None, 64])
def test_int8_as_q8_0_blocks_holds_the_same_weights(group):
    p = quantized_experts("int8", group, 16, 256, 0)
    blocks = int8_as_q8_0(p.qweight, p.scales)
    for e in range(E):
        want = dequantize(p.expert(e), p.scheme).numpy()
        got = gguf.quants.dequantize(blocks[e].numpy(), gguf.GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(got, want)


@needs_native
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    gate, up, down = gguf_experts("Q4_K", F, D, 1), gguf_experts("Q4_K", F, D, 2), gguf_experts("Q6_K", D, F, 3)
    x, ids, weights = routed(12)
    batch = native_ffn((gate, up), down, x, ids, weights)
    for r in (0, 5, 11):
        alone = native_ffn((gate, up), down, x[r : r + 1], ids[r : r + 1], weights[r : r + 1])
        assert torch.equal(alone[0], batch[r])


@needs_native
def test_the_kernel_is_chosen_when_a_layer_is_prepared_and_its_fake_traces():
    assert EXPERT_KERNELS.index(MoEBlocksCPU) < EXPERT_KERNELS.index(ReferenceExperts)
    gate, up, down = gguf_experts("Q4_K", F, D, 1), gguf_experts("Q4_K", F, D, 2), gguf_experts("Q6_K", D, F, 3)
    x, ids, weights = routed(5)
    want = ReferenceExperts.ffn(x, ids, weights, (gate, up), down, "silu")
    assert prepare_experts((gate, up), down, torch.float32) == MoEBlocksCPU.name
    assert down.kernel is MoEBlocksCPU

    def step(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return MoEBlocksCPU.ffn(x * 1.0, ids, weights, (gate, up), down, "silu") + 0.0

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert relative_error(compiled(x, ids, weights), want) < 1e-5


def test_float_and_nf4_experts_are_not_the_native_kernels():
    from localllm.quant.target import Target

    p = QuantExperts(E, D, F, parse_scheme("nf4"))
    why = MoEBlocksCPU.unsupported([p], Target.of("cpu"), torch.float32)
    assert why is not None and "nf4" in why
