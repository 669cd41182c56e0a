"""localllm's quantized CPU ops (``quant/csrc``): the native library that registers them, and one
table of what each op returns, from which their fake (meta) implementations are generated.

The C++ declares each op's schema (``m.def`` in ``TORCH_LIBRARY_FRAGMENT(localllm, ...)``); what it
cannot declare is the output's shape and dtype, which tracing (torch.export, torch.compile, the CUDA
dry run's fake tensors) needs without running the op. :data:`OPS` says it in one row an op, by the
names its schema gives the arguments; a new op is one row here and its ``m.def`` there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import torch

from localllm import native
from localllm.quant.formats import GGUF_BLOCKS
from localllm.quant.kernel_base import dtype_name
from localllm.quant.target import Target

# The outputs the ops make, each a function of the arguments it reads (by their schema names).


def product(x: torch.Tensor, out_features: int, **_: object) -> torch.Tensor:
    """(M, out_features) in the activations' dtype."""
    return x.new_empty((x.shape[0], out_features))


def block_product(x: torch.Tensor, blocks: torch.Tensor, **_: object) -> torch.Tensor:
    """(M, a row of blocks for each output) in the activations' dtype."""
    return x.new_empty((x.shape[0], blocks.shape[0]))


def moe_product(x: torch.Tensor, **_: object) -> torch.Tensor:
    """(rows, hidden) in the activations' dtype: a MoE layer's experts' output for each row."""
    return x.new_empty(x.shape)


def tile_weights(packed: torch.Tensor, out_features: int, **_: object) -> torch.Tensor:
    """(out_features, in) fp32 from tiles of 4-bit codes (``packed``: (tiles, in/8, 64))."""
    return packed.new_empty((out_features, packed.shape[1] * 8), dtype=torch.float32)


def weight_product(x: torch.Tensor, weight: torch.Tensor, **_: object) -> torch.Tensor:
    """(M, rows of the weight) in the activations' dtype."""
    return x.new_empty((x.shape[0], weight.shape[0]))


def block_weights(blocks: torch.Tensor, in_features: int, **_: object) -> torch.Tensor:
    """(rows of blocks, in_features) fp32."""
    return blocks.new_empty((blocks.shape[0], in_features), dtype=torch.float32)


#: Every op the library registers, and its output for tracing (None: no fake; an op that tracing
#: never meets: the ``_isa`` variants the tests call to pin a path, and the host query ``q8_isa``).
OPS: dict[str, Callable[..., torch.Tensor] | None] = {
    # csrc/tile_mm.cpp: int8 and int4 codes in tiles of 16 rows
    "int8_group_mm": product,
    "int8_group_gemm": product,
    "int4_group_mm": product,
    "int4_group_gemm": product,
    "int4_group_dequant": tile_weights,
    "int4z_group_mm": product,
    "int4z_group_gemm": product,
    "int4z_group_dequant": tile_weights,
    # csrc/q8_mm.cpp: int8 activations
    "int4_q8_mm": product,
    "int4_q8_mm_isa": None,
    "int8_q8_mm": product,
    "int8_q8_mm_isa": None,
    "q8_isa": None,
    # csrc/gguf_blocks_mm.cpp: a GGUF tensor's own blocks
    "gguf_mm": block_product,
    "gguf_gemm": block_product,
    "gguf_dequant": block_weights,
    # csrc/tile_mm.cpp: GGUF Q5_0, Q4_K, Q6_K blocks repacked into tiles (quant.gguf_cpu)
    "int5_group_mm": product,
    "int5_group_gemm": product,
    "int5_group_dequant": tile_weights,
    "int4k_group_mm": product,
    "int4k_group_gemm": product,
    "int4k_group_dequant": tile_weights,
    "int6k_group_mm": product,
    "int6k_group_gemm": product,
    "int6k_group_dequant": tile_weights,
    # csrc/moe_mm.cpp: a MoE layer's experts in one call (quant.expert_kernels)
    "moe_ffn": moe_product,
    # csrc/float_mm.cpp: bf16 and fp16 weights as stored, few activation rows (quant.float_kernels)
    "float_mm": weight_product,
    "float_mm_isa": None,
    "float_isa": None,
}


def fake(op: str, output: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``op``'s fake implementation: its arguments named as its C++ schema names them, passed to
    ``output``. Raises where ``output`` reads an argument the schema does not have (the table and
    the C++ disagree), at registration rather than at a trace."""
    names = [a.name for a in getattr(torch.ops.localllm, op).default._schema.arguments]
    wanted = [p.name for p in inspect.signature(output).parameters.values() if p.kind is not p.VAR_KEYWORD]
    missing = [n for n in wanted if n not in names]
    if missing:
        raise TypeError(f"localllm::{op} has no argument {', '.join(missing)} (its schema names {', '.join(names)})")

    def run(*args: object, **kwargs: object) -> torch.Tensor:
        return output(**dict(zip(names, args)), **kwargs)

    run.__name__ = f"{op}_fake"
    return run


def register_fakes() -> None:
    """The ops' output shapes for tracing, without running them: one per row of :data:`OPS`."""
    for op, output in OPS.items():
        if output is not None:
            torch.library.register_fake(f"localllm::{op}")(fake(op, output))


_CSRC = Path(__file__).resolve().parent / "csrc"
#: localllm's quantized CPU matmuls, built by :mod:`localllm.native` as one library: the exact ones
#: on int4, int5, int6 and int8 codes in tiles of 16 rows, with fp32 activations (int16 in the decode
#: kernels of 4-, 5- and 6-bit codes: ``csrc/tile_mm.cpp``), the
#: one on a GGUF tensor's own blocks (``csrc/gguf_blocks_mm.cpp``) and the opt-in ones with int8
#: activations (``csrc/q8_mm.cpp``).
LIBRARY = native.NativeLibrary(
    "localllm_quant", (_CSRC / "tile_mm.cpp", _CSRC / "q8_mm.cpp", _CSRC / "gguf_blocks_mm.cpp",
                       _CSRC / "moe_mm.cpp", _CSRC / "float_mm.cpp"),
    tuple(OPS), register_fakes,
    headers=(_CSRC / "panel_gemm.h", _CSRC / "fp32_vec.h", _CSRC / "parallel_rows.h", _CSRC / "gguf_blocks.h"),
)


def native_cpu_unsupported(target: Target, act_dtype: torch.dtype) -> str | None:
    """Why one of localllm's own CPU kernels cannot run here (None: it can): the device, the
    activations' dtype, and whether the native library could be built."""
    if target.type != "cpu":
        return "runs on the CPU only"
    if act_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"needs float32, bfloat16 or float16 activations, not {dtype_name(act_dtype)}"
    if not native.available(LIBRARY):
        return f"needs localllm's CPU kernels, which could not be built ({native.unavailable_reason()})"
    return None


def gguf_dequantize(blocks: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """(rows, bytes) uint8 blocks of a GGUF type -> (rows, in_features) fp32 weights, by the C++ decoder
    the matmul uses (bit for bit ``gguf.quants.dequantize``; the tests compare)."""
    if not native.available(LIBRARY):
        raise RuntimeError(f"localllm's CPU kernels are not built ({native.unavailable_reason()})")
    return torch.ops.localllm.gguf_dequant(blocks, GGUF_BLOCKS[type_name][0], in_features)
