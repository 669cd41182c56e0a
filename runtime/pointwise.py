"""A block's pointwise math: RMSNorm, rotary position embeddings and the gated MLP's activation
(SwiGLU, GeGLU).

Each is written once as torch ops, which a compiled step fuses, and runs on the CPU's eager steps (a
prefill chunk, an eager decode step) as one C++ pass (``localllm::rms_norm``, ``localllm::rope``,
``localllm::glu``, ``csrc/pointwise.cpp``, built by :mod:`localllm.native` as :data:`LIBRARY`): eager
torch spends a thread-pool fork and a pass over the activations on each of RMSNorm's seven ops and
RoPE's six, and computes tanh-GELU through a slow vectorised tanh. Same arithmetic in fp32 (RoPE's
bit for bit), but for the order of a row's sum of squares and GELU in its logistic form (one exp, no
tanh).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from localllm import native


def _register_fakes() -> None:
    @torch.library.register_fake("localllm::rms_norm")
    def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("localllm::rope")
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("localllm::glu")
    def _glu(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


LIBRARY = native.NativeLibrary(
    "localllm_pointwise", (Path(__file__).resolve().parent / "csrc" / "pointwise.cpp",), ("rms_norm", "rope", "glu"),
    _register_fakes,
)


def _native(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through the C++ form: a real fp32 CPU tensor outside tracing (a traced or
    compiled step keeps the torch formula, which its compiler fuses), the library loaded (built the
    first time; where it cannot be, :mod:`localllm.native` warns once and the torch formula runs)."""
    return (type(x) is torch.Tensor and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.compiler.is_compiling() and native.available(LIBRARY))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim, in fp32 whatever x's dtype (as the reference implementations do).
    ``offset`` 0: Llama's ``w * x`` (cast before the product); 1: Gemma's ``x * (1 + w)`` (product in
    fp32, then cast)."""
    if _native(x) and weight.dtype == torch.float32:
        return torch.ops.localllm.rms_norm(x, weight, eps, offset)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (weight.float() + offset)).to(x.dtype)
    return weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, hd) rotated by position: cos, sin (T, rot) already in x's dtype, rot <= hd, in the
    half-split (rotate_half) layout; the first rot dims rotate, the rest pass through (partial
    rotary: Phi-3.5, Phi-4-mini)."""
    if _native(x) and x.dim() == 4 and x.stride(-1) == 1 and cos.dtype == sin.dtype == torch.float32:
        return torch.ops.localllm.rope(x, cos, sin)
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = rot // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def activation(gate: torch.Tensor, gelu: bool) -> torch.Tensor:
    """The gate's activation: SiLU (SwiGLU), or tanh-approximated GELU (GeGLU)."""
    return F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)


def glu(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``activation(gate) * up`` for gate_up (..., 2I), gate its first half."""
    if _native(gate_up):
        return torch.ops.localllm.glu(gate_up, gelu)
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate, gelu) * up
