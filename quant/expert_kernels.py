"""localllm's native expert kernel: a MoE layer's whole expert FFN in one C++ call on the CPU
(``localllm::moe_ffn``, ``csrc/moe_mm.cpp``).

The op takes every expert's gate, up and down projections as GGUF blocks stacked on a leading expert
dim, groups the rows by expert, and multiplies each active expert's rows once by gguf_mm's row kernel
(or the panel GEMM for an expert with many rows): every active expert's weights are read once per
call, and there is no Python loop over experts or tokens. Its fake (``quant.native_ops.OPS``) lets
torch.compile trace through it.

Layout (:meth:`MoEBlocksCPU.prepare`): one ``blocks`` uint8 (E, out, row bytes) a projection.

* ``gguf``: the file's blocks, as they are;
* ``int4`` (any group, all multiples of 32): Q4_1 blocks holding the same values: a group's fp16
  scale and offset are a Q4_1 block's ``d`` and ``m`` (``w = q * d + m``), repeated for each 32
  columns of the group, its codes reordered to the block's nibbles (column j low, j + 16 high);
* ``int8`` per channel or with groups of a multiple of 32: Q8_0 blocks (``w = q * d``, d the fp16 scale).

Either way the weights are the ones the reference dequantizes, bit for bit.

gpt-oss's expert biases and clamped SwiGLU (:class:`quant.experts.ClampedSwiGLU`) are the op's
optional bias tensors and its activation 2 (with the limit and alpha): the same one call a layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localllm.quant.experts import (EXPERT_KERNELS, ClampedSwiGLU, ExpertBiases, ExpertKernel, QuantExperts,
                                    ReferenceExperts)
from localllm.quant.formats import GGUF_BLOCKS, parse_scheme, unpack_int4
from localllm.quant.native_ops import native_cpu_unsupported
from localllm.quant.target import Target

#: The op's activation codes (``act`` argument of ``localllm::moe_ffn``); a :class:`ClampedSwiGLU` is 2.
ACT_CODES = {"silu": 0, "gelu_tanh": 1}
CLAMPED_CODE = 2
#: GGUF types the op multiplies (those with a block kernel in ``csrc/gguf_blocks.h``).
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def block_type(proj: QuantExperts) -> str | None:
    """The GGUF type the op reads ``proj`` in (None: its scheme has none)."""
    s = proj.scheme
    if s.name in ("int4", "int8") and s != parse_scheme(s.name, s.group_size, s.symmetric):
        return None  # a variant (input columns in act order) the blocks do not hold
    if s.name == "gguf":
        return s.gguf_type if s.gguf_type in BLOCK_TYPES else None
    if s.name == "int4" and s.group_size is not None and s.group_size % 32 == 0:
        return "Q4_1"
    if s.name == "int8" and (s.group_size is None or s.group_size % 32 == 0) and proj.in_features % 32 == 0:
        return "Q8_0"
    return None


def int4_as_q4_1(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Canonical int4 ``qweight`` (..., out, in/2), ``scales``/``offsets`` fp16 (..., out, in/group) ->
    Q4_1 blocks uint8 (..., out, in/32 * 20) of the same values: d = scale, m = offset."""
    lead = qweight.shape[:-1]
    q = unpack_int4(qweight.reshape(-1, qweight.shape[-1]))  # (rows, in) codes
    rows, inp = q.shape
    q = q.view(rows, inp // 32, 32)
    qs = q[..., :16] | (q[..., 16:] << 4)  # (rows, in/32, 16): column j low nibble, j + 16 high
    per = inp // 32 // scales.shape[-1]  # blocks a group
    d = scales.reshape(rows, -1).repeat_interleave(per, dim=-1).contiguous()  # (rows, in/32) fp16
    m = offsets.reshape(rows, -1).repeat_interleave(per, dim=-1).contiguous()
    blocks = torch.cat([d.view(torch.uint8).view(rows, -1, 2), m.view(torch.uint8).view(rows, -1, 2), qs], dim=-1)
    return blocks.reshape(*lead, -1)


def int8_as_q8_0(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Canonical int8 ``qweight`` (..., out, in), ``scales`` fp16 (..., out) or (..., out, in/group) ->
    Q8_0 blocks uint8 (..., out, in/32 * 34) of the same values: d = the scale of the block's columns."""
    lead = qweight.shape[:-1]
    q = qweight.reshape(-1, qweight.shape[-1])
    rows, inp = q.shape
    s = scales.reshape(rows, -1)
    d = s.repeat_interleave(inp // 32 // s.shape[1], dim=-1).contiguous()  # (rows, in/32) fp16
    blocks = torch.cat([d.view(torch.uint8).view(rows, -1, 2), q.view(torch.uint8).view(rows, -1, 32)], dim=-1)
    return blocks.reshape(*lead, -1)


class MoEBlocksCPU(ExpertKernel):
    """A layer's experts in one native call on the CPU (``localllm::moe_ffn``): GGUF blocks of the
    types in :data:`BLOCK_TYPES`, canonical int4 (as Q4_1) and int8 (as Q8_0); fp32 accumulation of
    the exact weights, activations in fp32."""

    name = "moe-blocks-cpu"
    device_type = "cpu"

    @staticmethod
    def unsupported(projs: Sequence[QuantExperts], target: Target, act_dtype: torch.dtype) -> str | None:
        why = native_cpu_unsupported(target, act_dtype)
        if why is not None:
            return why
        for p in projs:
            if block_type(p) is None:
                return f"runs GGUF blocks ({', '.join(BLOCK_TYPES)}), int4 and int8 with groups of 32, not {p.scheme.label()}"
        return None

    @staticmethod
    def prepare(proj: QuantExperts) -> dict[str, torch.Tensor]:
        c = proj.canonical()
        if proj.scheme.name == "gguf":
            return {"blocks": c["blocks"]}
        if proj.scheme.name == "int4":
            return {"blocks": int4_as_q4_1(c["qweight"], c["scales"], c["offsets"])}
        if proj.scheme.name == "int8":
            return {"blocks": int8_as_q8_0(c["qweight"], c["scales"])}
        raise ValueError(f"{MoEBlocksCPU.name} cannot lay out {proj.scheme.label()} experts")

    @staticmethod
    def ffn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            gate_up: "QuantExperts | tuple[QuantExperts, QuantExperts]", down: QuantExperts,
            act: "str | ClampedSwiGLU", biases: ExpertBiases | None = None) -> torch.Tensor:
        if isinstance(gate_up, tuple):
            gate, up = gate_up
            g, u, gt, ut = gate.blocks, up.blocks, block_type(gate), block_type(up)
        else:  # gate's rows [0, F), up's [F, 2F) of each expert: two views of one tensor
            f = down.in_features
            g, u = gate_up.blocks[:, :f], gate_up.blocks[:, f:]
            gt = ut = block_type(gate_up)
        ids64 = ids if ids.dtype == torch.int64 else ids.long()
        clamped = isinstance(act, ClampedSwiGLU)
        code = CLAMPED_CODE if clamped else ACT_CODES[act]  # type: ignore[index]
        limit, alpha = (act.limit, act.alpha) if clamped else (0.0, 0.0)  # type: ignore[union-attr]
        # the biases where the experts run (no copy when they are there already: the loader's placement
        # keeps them beside the expert projections)
        gb, ub, db = (b.to(x.device, torch.float32) for b in biases) if biases is not None else (None, None, None)
        return torch.ops.localllm.moe_ffn(
            x, ids64, weights.float(), g, u, down.blocks, GGUF_BLOCKS[gt][0], GGUF_BLOCKS[ut][0],  # type: ignore[index]
            GGUF_BLOCKS[block_type(down)][0], code, gb, ub, db, limit, alpha)  # type: ignore[index]


# The registry (quant.experts): before the reference.
EXPERT_KERNELS.insert(EXPERT_KERNELS.index(ReferenceExperts), MoEBlocksCPU)
