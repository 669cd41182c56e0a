"""The C++ forms of RMSNorm, RoPE and the gated activations (runtime/pointwise.py) against the torch
formulas (in float64; RoPE's bit for bit in fp32), and the torch formula kept where a step is traced."""

import pytest
import torch
import torch.nn.functional as F

from localllm import native
from localllm.runtime import pointwise

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler for localllm's CPU kernels")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs() / (want.abs() + 1e-3)).max().item()


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_is_the_fp32_formula(offset):
    """Rows of a width that is no whole number of vectors (70: the scalar tail too), 3-D input, large
    values: Llama's w * x and Gemma's x * (1 + w)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 5, 70, generator=g) * 40, torch.randn(70, generator=g)
    got = pointwise.rms_norm(x, w, 1e-6, offset)
    assert native.registered(pointwise.LIBRARY)  # the C++ form ran, not the formula
    h = x.double()
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.double() + offset)
    assert got.shape == x.shape and rel(got, want) < 1e-6


@pytest.mark.parametrize("gelu", [True, False])
def test_glu_is_the_activation_times_up(gelu):
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(9, 2 * 75, generator=g) * 4
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, 1e-30, -20.0, 20.0])  # saturated, zero, tiny
    got = pointwise.glu(gate_up, gelu)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    assert got.shape == (9, 75) and torch.isfinite(got).all() and rel(got, want) < 1e-6


def rope_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch ops of the formula (rotate_half), the first cos.shape[-1] dims rotating."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([rope_formula(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = rot // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@pytest.mark.parametrize("shape", [(1, 4, 9, 64, 64), (2, 3, 5, 40, 24), (1, 1, 1, 10, 6)],
                         ids=["full", "partial-rotary", "scalar-tail"])
def test_rope_is_the_torch_formula_bit_for_bit(shape):
    """Heads transposed out of a projection (not contiguous), partial rotary (the tail copied), halves of
    no whole vector: the same fp32 values as torch's ops, each product rounded before the sum."""
    B, H, T, hd, rot = shape
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(B, T, H, hd, generator=g) * 30).transpose(1, 2)  # (B, H, T, hd), strided
    angles = torch.randn(T, rot // 2, generator=g) * 50
    # column slices of wider tables, as a step's local and global tables are (rows not contiguous)
    cos, sin = angles.cos().repeat(1, 4)[:, rot:], angles.sin().repeat(1, 4)[:, rot:]
    got = torch.ops.localllm.rope(x, cos, sin) if native.available(pointwise.LIBRARY) else None
    assert got is not None and torch.equal(got, rope_formula(x, cos, sin))
    assert torch.equal(pointwise.rope(x, cos, sin), got)


def test_traced_steps_keep_the_torch_formula():
    """torch.export sees the formulas' ops (which the compiled step fuses), not the C++ op."""

    class Norm(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            h = pointwise.glu(torch.cat([x, x], -1), True) + pointwise.rms_norm(x, w, 1e-6, 1.0)
            return pointwise.rope(h.view(1, 2, 2, 32), w.view(2, 16).repeat(1, 2), w.view(2, 16).repeat(1, 2))

    x, w = torch.randn(4, 32), torch.randn(32)
    graph = torch.export.export(Norm(), (x, w)).graph_module.code
    assert "localllm" not in graph and "rsqrt" in graph and "gelu" in graph and "cat" in graph
