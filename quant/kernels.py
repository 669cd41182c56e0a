"""Matmul kernels for quantized weights, and the choice among them per device.

Each kernel turns a :class:`quant.linear.QuantLinear`'s canonical tensors into the layout it wants
(``prepare``) and multiplies activations with them (``matmul``) without building the full-precision
weight of the model. The pure-torch reference (dequantize a slice of one layer's rows at a time,
multiply, drop it) runs everywhere; the fast kernels are checked against it when a layer is prepared
and dropped with a warning if they disagree, so a kernel that misbehaves on some GPU or build
degrades to slow, never to wrong. Each kernel says why it cannot run a layer
(:meth:`Kernel.unsupported`), which is what the one-line warning about a slow fallback names.

=====================  ======  ============================================  =====================
kernel                 scheme  where                                         activations
=====================  ======  ============================================  =====================
int4-tinygemm-cpu      int4    CPU (``torch._weight_int4pack_mm_for_cpu``)   bf16
int4-triton-cuda       int4    CUDA, Triton (``quant.int_triton``)           bf16 / fp16 / fp32
int4-tinygemm-cuda     int4    CUDA sm80+ (``torch._weight_int4pack_mm``)    bf16
int8-triton-cuda       int8    CUDA, Triton (``quant.int_triton``)           bf16 / fp16 / fp32
int8-weight-only       int8    per-channel (``torch._weight_int8pack_mm``)   bf16 / fp16 / fp32
int8-group-cpu         int8    grouped, CPU (``localllm::int8_group_mm``)    bf16 / fp16 / fp32
int4-q8-cpu            int4    CPU, AVX2 / VNNI, opt-in (``int4_q8_mm``)     int8 per 32 (from fp32)
int8-q8-cpu            int8    CPU, AVX2 / VNNI, opt-in (``int8_q8_mm``)     int8 per 32 (from fp32)
gguf-q8-cpu            gguf    CPU, opt-in: Q5_0, Q4_K, Q6_K as the above    int8 per 32 (from fp32)
gguf-blocks-cpu        gguf    CPU (``localllm::gguf_mm``): a GGUF's blocks  bf16 / fp16 / fp32
gguf-blocks-cuda       gguf    CUDA, Triton (``quant.gguf_triton``)          bf16 / fp16 / fp32
nf4-bitsandbytes       nf4     bitsandbytes ``matmul_4bit`` (CPU and CUDA)   bf16 / fp16 / fp32
reference              all     dequantize one layer, ``F.linear``            any
=====================  ======  ============================================  =====================
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from localllm import native
from localllm.quant.formats import GGUF_BLOCKS, dequantize, quiet_bitsandbytes, unpack_int4
from localllm.quant.gguf_blocks import INTEGER_GRIDS, integer_grid, q4_k_parts, q6_k_parts
from localllm.quant.target import Target

if TYPE_CHECKING:
    from localllm.quant.linear import QuantLinear

#: Weights the reference dequantizes at a time, by device type (others: ``"default"``): on the CPU
#: 4M (16 MB of fp32), so a vocabulary head's float weight never exists whole in RAM; on a GPU a
#: 7B model's head at once, since each slice costs kernel launches at every token.
REFERENCE_ELEMENTS = {"cpu": 1 << 22, "default": 1 << 28}
#: Output rows the check against the reference samples in a larger layer.
REFERENCE_ROWS = 1024


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Kernel:
    """A way to multiply by a quantized weight. Subclasses set ``name`` and ``scheme`` and override
    :meth:`unsupported`, :meth:`prepare` and :meth:`matmul`."""

    name = "base"
    scheme = ""  # the weight scheme it multiplies by ("" for every scheme)
    device_type: str | None = None  # the one device type it runs on (None: any)
    #: Taken only when named (``--kernel``): it changes the numbers, not only the speed. Naming one
    #: opt-in kernel names the others of its ``family`` for the layers it cannot run (int8 activations
    #: for a model's int4 layers and its int8 head).
    opt_in = False
    family = ""
    #: Activation rows up to which :meth:`matmul` runs a row (decode) kernel, and above which another
    #: path (the panel GEMM); None: one path for any number of rows.
    GEMV_ROWS: int | None = None

    @classmethod
    def row_limit(cls, layer: "QuantLinear") -> int | None:
        """The number of activation rows up to which ``layer``'s product takes the row kernel (an export
        bakes that choice in: :func:`runtime.compiled_step.batch_ranges` cuts its packages there)."""
        return cls.GEMV_ROWS

    @classmethod
    def supports(cls, layer: "QuantLinear", target: "Target | torch.device", act_dtype: torch.dtype) -> bool:
        return cls.unsupported(layer, Target.of(target), act_dtype) is None

    @staticmethod
    def unsupported(layer: "QuantLinear", target: Target, act_dtype: torch.dtype) -> str | None:
        """None when this kernel can run ``layer`` on ``target`` (a device, and a CUDA device's
        capability: see :class:`quant.target.Target`; never asked of ``torch.cuda`` here) with
        ``act_dtype`` activations, else why not, in a few words that follow the kernel's name
        ("needs bf16 activations, not float32")."""
        raise NotImplementedError

    @staticmethod
    def prepare(layer: "QuantLinear") -> dict[str, torch.Tensor]:
        """Kernel-layout tensors built from the layer's canonical ones (on the layer's device)."""
        raise NotImplementedError

    @staticmethod
    def matmul(layer: "QuantLinear", x: torch.Tensor) -> torch.Tensor:
        """x (M, in) in the activation dtype -> (M, out)."""
        raise NotImplementedError


def reference_linear(canonical: dict[str, torch.Tensor], scheme, x: torch.Tensor,  # type: ignore[no-untyped-def]
                     rows: int | None = None) -> torch.Tensor:
    """``x @ W^T`` with W dequantized ``rows`` output rows at a time (default: :data:`REFERENCE_ELEMENTS`
    weights), in ``x``'s dtype: every canonical format keeps an output row's codes and scales on that
    row, so a slice of rows is a smaller weight."""
    out = next(iter(canonical.values())).shape[0]
    if rows is None:
        budget = REFERENCE_ELEMENTS.get(x.device.type, REFERENCE_ELEMENTS["default"])
        rows = max(1, budget // x.shape[-1])
    if out <= rows:
        return F.linear(x, dequantize(canonical, scheme, x.dtype))
    y = x.new_empty((*x.shape[:-1], out))
    for a in range(0, out, rows):
        part = {k: v[a : a + rows] for k, v in canonical.items()}
        y[..., a : a + rows] = F.linear(x, dequantize(part, scheme, x.dtype))
    return y


class Reference(Kernel):
    name = "reference"

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        return None

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return dict(layer.canonical())

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        # A slice of the layer's weight exists in full precision only for the duration of this call.
        return reference_linear(layer.canonical(), layer.scheme, x)


class Int4TinygemmCPU(Kernel):
    name = "int4-tinygemm-cpu"
    scheme = "int4"
    device_type = "cpu"
    #: Output rows repacked at a time (a multiple of the packer's 64-row blocks, which it packs
    #: independently): the int32 codes the packer takes are 8x the packed bytes, never for a whole layer.
    PACK_ROWS = 4096

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "int4":
            return "runs int4 weights only"
        if target.type != "cpu":
            return "runs on the CPU only"
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return f"needs a newer torch than {torch.__version__}"
        if act_dtype != torch.bfloat16:
            return f"needs bfloat16 activations, not {_dtype_name(act_dtype)}"
        if layer.in_features % layer.scheme.group_size or layer.out_features % 16:
            return f"needs widths that are multiples of the group and of 16 ({layer.out_features}x{layer.in_features})"
        return None

    @staticmethod
    def _scales_and_zeros(layer) -> torch.Tensor:  # type: ignore[no-untyped-def]
        # tinygemm dequantizes as (q - 8) * scale + zero: zero = offset + 8 * scale. (in/g, out, 2) bf16.
        s, o = layer.scales.float(), layer.offsets.float()
        return torch.stack([s, o + 8 * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    @staticmethod
    def prepare(layer, rows: int | None = None):  # type: ignore[no-untyped-def]
        rows = rows or Int4TinygemmCPU.PACK_ROWS
        out, half = layer.qweight.shape
        packed = torch.empty((out, half), dtype=torch.uint8, device=layer.qweight.device)
        for a in range(0, out, rows):
            q = unpack_int4(layer.qweight[a : a + rows]).to(torch.int32)  # (rows, in)
            packed[a : a + rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        return {"packed": packed, "scales_zeros": Int4TinygemmCPU._scales_and_zeros(layer)}

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, layer.scheme.group_size, layer.scales_zeros)


class Int4TinygemmCUDA(Kernel):
    name = "int4-tinygemm-cuda"
    scheme = "int4"
    device_type = "cuda"
    #: k-tiles of 16 inputs packed together, widest first: 8 (16-byte loads) where the input width is a
    #: multiple of 128, else 4 or 2 (int4mm.cu takes all three): SmolLM2's 576-wide layers pack by 4.
    INNER_K_TILES = (8, 4, 2)

    @staticmethod
    def inner_k_tiles(in_features: int) -> int | None:
        """The widest packing whose k-tiles divide the input width, or None (not a multiple of 32)."""
        return next((t for t in Int4TinygemmCUDA.INNER_K_TILES if in_features % (16 * t) == 0), None)

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "int4":
            return "runs int4 weights only"
        if target.type != "cuda":
            return "runs on CUDA GPUs only"
        capability = target.capability
        if capability is None:
            return "needs a GPU of compute capability 8.0 or newer (this one's is unknown)"
        if capability < (8, 0):
            return f"needs a GPU of compute capability 8.0 or newer (this one has {capability[0]}.{capability[1]})"
        if act_dtype != torch.bfloat16:
            return f"needs bfloat16 activations, not {_dtype_name(act_dtype)}"
        if Int4TinygemmCUDA.inner_k_tiles(layer.in_features) is None or layer.out_features % 8:
            return (f"needs input widths that are multiples of 32 and outputs of 8 "
                    f"({layer.out_features}x{layer.in_features})")
        return None

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        q = unpack_int4(layer.qweight)  # (out, in) uint8 codes
        hi_first = (q[:, 0::2] << 4) | q[:, 1::2]  # the CUDA packer wants the even column in the high nibble
        tiles = Int4TinygemmCUDA.inner_k_tiles(layer.in_features)
        return {
            "packed": torch.ops.aten._convert_weight_to_int4pack(hi_first.contiguous(), tiles),
            "scales_zeros": Int4TinygemmCPU._scales_and_zeros(layer),
        }

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.aten._weight_int4pack_mm(x, layer.packed, layer.scheme.group_size, layer.scales_zeros)


def _triton_unsupported(target: Target, act_dtype: torch.dtype) -> str | None:
    """Why localllm's Triton kernels cannot run on ``target`` with ``act_dtype`` activations, or None."""
    if target.type != "cuda":
        return "runs on CUDA only"
    if importlib.util.find_spec("triton") is None:
        return "needs Triton (torch's CUDA builds install it)"
    capability = target.capability
    if act_dtype == torch.bfloat16 and (capability is None or capability < (8, 0)):
        have = "this one's is unknown" if capability is None else f"this one has {capability[0]}.{capability[1]}"
        return f"needs a GPU of compute capability 8.0 or newer for bfloat16 activations ({have})"
    return None


class _IntTritonCUDA(Kernel):
    """int4 or int8 weights on CUDA from their canonical tensors as they are (:mod:`quant.int_triton`):
    a few rows split the input width across the SMs, prefill runs tensor-core tiles."""

    device_type = "cuda"

    @classmethod
    def unsupported(cls, layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def,override]
        if layer.scheme.name != cls.scheme:
            return f"runs {cls.scheme} weights only"
        return _triton_unsupported(target, act_dtype)

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return dict(layer.canonical())

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        from localllm.quant.int_triton import int_mm

        return int_mm(x, layer.qweight, layer.scales, getattr(layer, "offsets", None), layer.scheme.group_size)


class Int4TritonCUDA(_IntTritonCUDA):
    """Taken before tinygemm, whose prefill the first GPU run measured at eleven times fp16's (the
    README's H200 table); ``--kernel int4-tinygemm-cuda`` still picks that one, and
    ``scripts/linear_gpu.py`` times both."""

    name = "int4-triton-cuda"
    scheme = "int4"


class Int8TritonCUDA(_IntTritonCUDA):
    """Per channel or per group: torch's ``_weight_int8pack_mm`` decoded at 3% of an H200's bandwidth
    and took 28 s over a 2,000-token prompt of a 7B model on the first GPU run."""

    name = "int8-triton-cuda"
    scheme = "int8"


class Int8WeightOnly(Kernel):
    name = "int8-weight-only"
    scheme = "int8"

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "int8":
            return "runs int8 weights only"
        if layer.scheme.group_size is not None:
            return "needs one scale per output channel, not per group"
        if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            return f"needs a newer torch than {torch.__version__}"
        if target.type != "cpu" and act_dtype not in (torch.bfloat16, torch.float16):
            return f"needs bfloat16 or float16 activations on {target.type}, not {_dtype_name(act_dtype)}"
        return None

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return {"qweight": layer.qweight, "kscales": layer.scales.to(layer.act_dtype)}

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.kscales)


def _register_fakes() -> None:
    """The ops' output shapes for tracing (torch.export, torch.compile), without running them."""

    @torch.library.register_fake("localllm::int8_group_mm")
    def _mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int, out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("localllm::int8_group_gemm")
    def _gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
              out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("localllm::gguf_mm")
    def _gguf_mm(x: torch.Tensor, blocks: torch.Tensor, type: int, in_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], blocks.shape[0]))

    @torch.library.register_fake("localllm::int4_group_mm")
    def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int,
                 out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("localllm::int4_group_gemm")
    def _int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int,
                   out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("localllm::gguf_gemm")
    def _gguf_gemm(x: torch.Tensor, blocks: torch.Tensor, type: int, in_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], blocks.shape[0]))

    @torch.library.register_fake("localllm::int4_q8_mm")
    def _int4_q8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int,
                 out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("localllm::int8_q8_mm")
    def _int8_q8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
                 out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("localllm::int4_group_dequant")
    def _int4_dequant(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int,
                      out_features: int) -> torch.Tensor:
        return packed.new_empty((out_features, packed.shape[1] * 8), dtype=torch.float32)

    # The int5 (Q5_0) and Int4K (Q4_K) tiles: the int4 codes' tiles and two tensors of their own
    # (fifth and scales; mins and supers), then the output rows.
    def _tiles_mm(x: torch.Tensor, packed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    def _tiles_dequant(packed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_features: int) -> torch.Tensor:
        return packed.new_empty((out_features, packed.shape[1] * 8), dtype=torch.float32)

    for kind in ("int5", "int4k"):
        torch.library.register_fake(f"localllm::{kind}_group_mm")(_tiles_mm)
        torch.library.register_fake(f"localllm::{kind}_group_gemm")(_tiles_mm)
        torch.library.register_fake(f"localllm::{kind}_group_dequant")(_tiles_dequant)

    # The Int6K (Q6_K) tiles: three tensors of their own (top, sub_scales, supers).
    def _tiles3_mm(x: torch.Tensor, packed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    def _tiles3_dequant(packed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                        out_features: int) -> torch.Tensor:
        return packed.new_empty((out_features, packed.shape[1] * 8), dtype=torch.float32)

    torch.library.register_fake("localllm::int6k_group_mm")(_tiles3_mm)
    torch.library.register_fake("localllm::int6k_group_gemm")(_tiles3_mm)
    torch.library.register_fake("localllm::int6k_group_dequant")(_tiles3_dequant)

    @torch.library.register_fake("localllm::gguf_dequant")
    def _gguf_dequant(blocks: torch.Tensor, type: int, in_features: int) -> torch.Tensor:
        return blocks.new_empty((blocks.shape[0], in_features), dtype=torch.float32)


_CSRC = Path(__file__).resolve().parent / "csrc"
#: localllm's quantized CPU matmuls, built by :mod:`localllm.native` as one library: the exact ones
#: on int4, int5, int6 and int8 codes in tiles of 16 rows, with fp32 activations (int16 in the decode
#: kernels of 4-, 5- and 6-bit codes: ``csrc/tile_mm.cpp``), the
#: one on a GGUF tensor's own blocks (``csrc/gguf_blocks_mm.cpp``) and the opt-in ones with int8
#: activations (``csrc/q8_mm.cpp``).
LIBRARY = native.NativeLibrary(
    "localllm_quant", (_CSRC / "tile_mm.cpp", _CSRC / "q8_mm.cpp", _CSRC / "gguf_blocks_mm.cpp"),
    ("int8_group_mm", "int8_group_gemm", "int4_group_mm", "int4_group_gemm", "int4_group_dequant",
     "int4_q8_mm", "int4_q8_mm_isa", "int8_q8_mm", "int8_q8_mm_isa", "q8_isa",
     "gguf_mm", "gguf_gemm", "gguf_dequant", "int5_group_mm", "int5_group_gemm", "int5_group_dequant",
     "int4k_group_mm", "int4k_group_gemm", "int4k_group_dequant",
     "int6k_group_mm", "int6k_group_gemm", "int6k_group_dequant"),
    _register_fakes, headers=(_CSRC / "panel_gemm.h", _CSRC / "fp32_vec.h", _CSRC / "parallel_rows.h"),
)

def _native_cpu_unsupported(target: Target, act_dtype: torch.dtype) -> str | None:
    """Why one of localllm's own CPU kernels cannot run here (None: it can): the device, the
    activations' dtype, and whether the native library could be built."""
    if target.type != "cpu":
        return "runs on the CPU only"
    if act_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"needs float32, bfloat16 or float16 activations, not {_dtype_name(act_dtype)}"
    if not native.available(LIBRARY):
        return f"needs localllm's CPU kernels, which could not be built ({native.unavailable_reason()})"
    return None



class Int8GroupCPU(Kernel):
    """int8 with a scale per group of inputs (a GGUF's Q8_0 blocks exactly) through localllm's C++
    kernel (``csrc/tile_mm.cpp``), with fp32 activations and fp32 accumulation: the product with the
    exact weights, without re-rounding. It also runs per-channel int8 (one scale a row), which torch's
    int8 kernel multiplies 4x slower in fp32 than in bf16. Up to :data:`GEMV_ROWS` activation rows
    (a decode or verify step) share each decoded column of codes; more (a prefill, a quality window's
    every position through the head) go through fp32 panels of the exact weights (``int8_group_gemm``,
    ``csrc/panel_gemm.h``).

    Layout (:meth:`pack`, which :class:`Int8Q8CPU` shares): ``packed`` uint8 (tiles of 16 rows, in/4,
    64), dword j of quad c holding row 16t + j's codes of columns 4c .. 4c + 3, each plus 128;
    ``tile_scales`` fp16 (tiles, in/group or 1, 16). A tied model's embedding reads its rows back
    (:meth:`rows_of`)."""

    name = "int8-group-cpu"
    scheme = "int8"
    device_type = "cpu"
    #: Activation rows up to which the register kernel runs; above, the panel GEMM.
    GEMV_ROWS = 8

    @staticmethod
    def dot_group(layer) -> int:  # type: ignore[no-untyped-def]
        """Inputs the kernel sums before scaling: the scheme's group, or for per-channel scales 32 (16)."""
        g = layer.scheme.group_size
        return g if g is not None else (32 if layer.in_features % 32 == 0 else 16)

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        g = layer.scheme.group_size
        if layer.scheme.name != "int8":
            return "runs int8 weights only"
        why = _native_cpu_unsupported(target, act_dtype)
        if why is not None:
            return why
        if g is None and act_dtype != torch.float32:  # int8-weight-only is as fast with 16-bit ones
            return f"runs per-channel int8 with float32 activations only, not {_dtype_name(act_dtype)}"
        if g is None and layer.in_features % 16:
            return f"needs an input width that is a multiple of 16 ({layer.in_features})"
        if g is not None and g % 16:
            return "needs scales per group of a multiple of 16 inputs"
        return None

    @staticmethod
    def pack(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical int8 tensors (``qweight``, ``scales`` per row or per group) -> this layout."""
        tile = Int4GroupCPU.TILE
        packed = _dword_tiles(canonical["qweight"], lambda q: (q.to(torch.int16) + 128).to(torch.uint8))  # codes + 128
        scales = canonical["scales"].half()
        return {
            "packed": packed,
            "tile_scales": Int4GroupCPU._tiles(scales if scales.dim() == 2 else scales.view(-1, 1), tile),
        }

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return Int8GroupCPU.pack(layer.canonical())

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        ops = torch.ops.localllm
        op = ops.int8_group_mm if x.shape[0] <= Int8GroupCPU.GEMV_ROWS else ops.int8_group_gemm
        return op(x, layer.packed, layer.tile_scales, Int8GroupCPU.dot_group(layer), layer.out_features)

    @staticmethod
    def rows_of(layer, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """(n,) row ids -> (n, in) fp32 weights, q * scale (exact in fp32), from the kernel's layout."""
        codes, s, _ = _tile_rows(layer, tokens)  # (n, in/4, 4) codes + 128, (n, in/group or 1)
        q = (codes.flatten(1).to(torch.int16) - 128).float()  # (n, in)
        return (q.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)


class Int4GroupCPU(Kernel):
    """int4 with an fp16 scale and offset per group (the canonical format: a GGUF's Q4_0 / Q4_1 blocks
    exactly, or weights quantized to int4) through localllm's C++ kernel (``csrc/tile_mm.cpp``),
    with fp32 accumulation: the product with the exact weights, up to summation order. A decode step
    of one or a few sequences decodes the codes in registers and, where the CPU has AVX2 or AVX-512,
    multiplies them by the activations rounded to int16 per 32 columns (steps of 2^-16 of their
    largest, ``tile_rows_q16``); more than
    :data:`GEMV_ROWS` rows (a batched step, a prefill) go through fp32 panels of the exact weights
    (``int4_group_gemm``, ``csrc/panel_gemm.h``), which never hold more than a few KB of them.

    Layout (made here, from the canonical tensors; :class:`Int4Q8CPU` reads the same): output rows in
    tiles of 16, ``packed`` uint8 (tiles, in/8, 64), dword j of octet o holding row 16t + j's codes of
    columns 8o + i (low nibble of byte i) and 8o + 4 + i (high nibble), so that each of an octet's
    columns is a shift and a mask of one load's lanes; ``tile_scales`` and ``tile_offsets`` fp16
    (tiles, in/group, 16). Rows past the layer's last in the last tile are zeros. Same bytes as the
    canonical tensors (but that padding)."""

    name = "int4-group-cpu"
    scheme = "int4"
    device_type = "cpu"
    TILE = 16
    #: Output rows repacked at a time (the codes are unpacked to a byte each on the way).
    PACK_ROWS = 4096
    #: Activation rows up to which the register kernel runs; above, the panel GEMM.
    GEMV_ROWS = 4

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "int4":
            return "runs int4 weights only"
        return _native_cpu_unsupported(target, act_dtype)

    @staticmethod
    def _tiles(t: torch.Tensor, tile: int) -> torch.Tensor:
        """(rows, cols) -> (ceil(rows / tile), cols, tile), rows past the end zero."""
        rows, cols = t.shape
        pad = -rows % tile
        if pad:
            t = torch.cat([t, t.new_zeros((pad, cols))])
        return t.view(-1, tile, cols).transpose(1, 2).contiguous()

    @staticmethod
    def octet_bytes(codes: torch.Tensor) -> torch.Tensor:
        """(rows, in) 4-bit codes, a byte each -> (rows, in/2), 4 bytes an octet of columns (low nibbles 0-3)."""
        q = codes.view(codes.shape[0], -1, 2, 4)  # (rows, octets, 2 halves, 4)
        return (q[:, :, 0] | (q[:, :, 1] << 4)).flatten(1)

    @staticmethod
    def _octets(qweight: torch.Tensor) -> torch.Tensor:
        """(rows, in/2) canonical bytes -> :meth:`octet_bytes`."""
        return Int4GroupCPU.octet_bytes(unpack_int4(qweight))

    @staticmethod
    def pack(canonical: dict[str, torch.Tensor], rows: int | None = None) -> dict[str, torch.Tensor]:
        """Canonical int4 tensors (``qweight``, ``scales``, ``offsets``) -> this layout, ``rows`` output
        rows repacked at a time (:data:`PACK_ROWS`)."""
        tile = Int4GroupCPU.TILE
        return {
            "packed": _dword_tiles(canonical["qweight"], Int4GroupCPU._octets, rows),
            "tile_scales": Int4GroupCPU._tiles(canonical["scales"].half(), tile),
            "tile_offsets": Int4GroupCPU._tiles(canonical["offsets"].half(), tile),
        }

    @staticmethod
    def prepare(layer, rows: int | None = None):  # type: ignore[no-untyped-def]
        return Int4GroupCPU.pack(layer.canonical(), rows)

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        g, n = layer.scheme.group_size, layer.out_features
        ops = torch.ops.localllm
        op = ops.int4_group_mm if x.shape[0] <= Int4GroupCPU.GEMV_ROWS else ops.int4_group_gemm
        return op(x, layer.packed, layer.tile_scales, layer.tile_offsets, g, n)


#: ``localllm::q8_isa()``'s paths, narrowest first (``csrc/q8_mm.cpp``'s ``Isa``).
Q8_PORTABLE, Q8_AVX2, Q8_AVX_VNNI, Q8_AVX512_VNNI = range(4)


class _Q8Kernel(Kernel):
    """The opt-in family of CPU kernels with int8 activations (``csrc/q8_mm.cpp``): what they share."""

    device_type = "cpu"
    opt_in = True
    family = "q8"

    @classmethod
    def unsupported(cls, layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def,override]
        if layer.scheme.name != cls.scheme:
            return f"runs {cls.scheme} weights only"
        why = _native_cpu_unsupported(target, act_dtype)
        if why is not None:
            return why
        group = layer.scheme.group_size or layer.in_features
        if layer.in_features % 32 or (group % 32 and not (group == 16 and cls.scheme != "int4")):
            # a weight scale covers whole activation blocks, or (int8) each half of one
            return "needs weight scales per group (or row) of a multiple of 32 inputs"
        if torch.ops.localllm.q8_isa() == Q8_PORTABLE:
            return ("needs AVX2 (this CPU, or ATEN_CPU_CAPABILITY=default, gives none; the portable loop is "
                    "slower than fp32)")
        return None


def _dword_tiles(qweight: torch.Tensor, row_bytes, rows: int | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The layout of the int4 kernels and of the int8-activation ones: uint8 (tiles of 16 rows, n/4,
    64), dword j of column c being output row 16t + j's 4 bytes c of ``row_bytes(qweight rows)``
    ((rows, n) uint8); built ``rows`` (:data:`Int4GroupCPU.PACK_ROWS`) rows at a time, the last tile
    padded with zeros."""
    if not native.available(LIBRARY):
        raise RuntimeError("localllm's CPU kernels are not built")
    tile = Int4GroupCPU.TILE
    rows = rows or Int4GroupCPU.PACK_ROWS
    rows -= rows % tile
    parts = [Int4GroupCPU._tiles(row_bytes(qweight[a : a + rows]).view(torch.int32), tile)
             for a in range(0, qweight.shape[0], rows)]  # (rows/16, n/4, 16) dwords each
    packed = torch.cat(parts) if len(parts) > 1 else parts[0]
    return packed.view(torch.uint8).view(packed.shape[0], packed.shape[1], 4 * tile)


def _tile_rows(layer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # type: ignore[no-untyped-def]
    """(n,) output rows -> (n, in/4, 4) bytes of ``layer.packed`` (:func:`_dword_tiles`' layout), and
    (n, groups) fp32 ``layer.tile_scales`` and ``layer.tile_offsets`` (None without) of those rows."""
    t, j = tokens // Int4GroupCPU.TILE, tokens % Int4GroupCPU.TILE
    tiles, dwords, _ = layer.packed.shape
    offsets = getattr(layer, "tile_offsets", None)
    return (layer.packed.view(tiles, dwords, Int4GroupCPU.TILE, 4)[t, :, j], layer.tile_scales[t, :, j].float(),
            None if offsets is None else offsets[t, :, j].float())


class Int4Q8CPU(_Q8Kernel):
    """int4 with an fp16 scale and offset per group (as :class:`Int4GroupCPU`), multiplied by the
    activations quantized to int8 per block of 32 inputs, as llama.cpp multiplies its Q4 weights
    (``csrc/q8_mm.cpp``): the codes' dot products run in 8-bit integers (AVX-512 VNNI, AVX-VNNI, or
    AVX2's vpmaddubsw), four times the multiply-adds an instruction of fp32 FMAs (twice, on AVX2
    without VNNI), which is what bounds a batched decode step or a prefill on a CPU. One kernel for
    any number of rows, each row one fixed chain of operations: a
    sequence's numbers are the same alone and in any batch. Opt-in (``--kernel int4-q8-cpu``): the
    activations' rounding moves the logits (by what ``localllm bench`` reports as KL divergence), so
    the default stays the fp32 product with the exact weights. Every path gives the portable loop's
    bits; that loop is slow, so the kernel is offered only where AVX2 is.

    Layout: :class:`Int4GroupCPU`'s."""

    name = "int4-q8-cpu"
    scheme = "int4"
    pack = staticmethod(Int4GroupCPU.pack)  # the same layout

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return Int4GroupCPU.pack(layer.canonical())

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.localllm.int4_q8_mm(x, layer.packed, layer.tile_scales, layer.tile_offsets,
                                             layer.scheme.group_size, layer.out_features)

    @staticmethod
    def rows_of(layer, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """(n,) row ids -> (n, in) fp32 weights, q * scale + offset, from the kernel's layout."""
        octets, s, o = _tile_rows(layer, tokens)  # (n, in/8, 4): byte i holds columns 8o + i and 8o + 4 + i
        q = torch.cat([octets & 0x0F, octets >> 4], dim=-1).flatten(1).float()  # (n, in)
        assert o is not None  # an int4 layout always has its offsets
        return (q.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1) + o.unsqueeze(-1)).flatten(-2)


class Int8Q8CPU(_Q8Kernel):
    """int8 weights (a scale per group of a multiple of 32 inputs, a GGUF's Q8_0 head; or per row) by
    the activations quantized to int8 per block of 32, on AVX2 or VNNI (``csrc/q8_mm.cpp``): the int8
    member of :class:`Int4Q8CPU`'s opt-in family, which ``--kernel int4-q8-cpu`` also takes for a
    model's int8 head. Layout: :class:`Int8GroupCPU`'s (``pack``, ``rows_of``)."""

    name = "int8-q8-cpu"
    scheme = "int8"

    @staticmethod
    def _group(layer) -> int:  # type: ignore[no-untyped-def]
        return layer.scheme.group_size or layer.in_features

    pack = staticmethod(Int8GroupCPU.pack)  # the same layout
    rows_of = staticmethod(Int8GroupCPU.rows_of)

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return Int8GroupCPU.pack(layer.canonical())

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.localllm.int8_q8_mm(x, layer.packed, layer.tile_scales, Int8Q8CPU._group(layer),
                                             layer.out_features)



class GGUFQ8CPU(_Q8Kernel):
    """The int8-activation family's member for a GGUF's Q5_0, Q4_K and Q6_K blocks (a Q4_K_M file's),
    which ``--kernel int4-q8-cpu`` takes with the rest of its family. At load the blocks become the
    integer grid that holds their codes (:func:`quant.gguf_blocks.integer_grid`: Q5_0 int8 codes with
    its fp16 scale, Q4_K int4 codes with an fp16 scale and offset a sub-block, Q6_K int8 codes with an
    fp16 scale per 16 inputs) in
    :class:`Int8Q8CPU`'s or :class:`Int4Q8CPU`'s layout, and the codes multiply in 8-bit integers as
    theirs do, as llama.cpp multiplies these blocks (the exact default forms an fp32 product of every
    weight, which bounds a one-row step by the core rather than by memory on AVX2 machines). Q5_0's
    and Q6_K's codes take a byte each (5.5 -> 8.5 and 6.56 -> 9 bits a weight); the K-quants' scales
    are rounded to fp16 on the way (see ``integer_grid``). Other GGUF types (Q5_K, Q3_K...) stay on
    :class:`GGUFBlocksCPU`."""

    name = "gguf-q8-cpu"
    scheme = "gguf"

    @classmethod
    def unsupported(cls, layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def,override]
        why = super().unsupported(layer, target, act_dtype)
        if why is None and layer.scheme.gguf_type not in INTEGER_GRIDS:
            return f"runs {', '.join(INTEGER_GRIDS)} blocks only"
        return why

    @staticmethod
    def _grid(layer):  # type: ignore[no-untyped-def]
        return Int4Q8CPU if INTEGER_GRIDS[layer.scheme.gguf_type][0] == "int4" else Int8Q8CPU

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        grid, rows = GGUFQ8CPU._grid(layer), Int4GroupCPU.PACK_ROWS
        kind = layer.scheme.gguf_type
        if kind.endswith("_K"):  # never a coarser grid silently (the weights, not only the activations)
            warn_once(f"kernel {GGUFQ8CPU.name} holds {kind} layers with their sub-block scales rounded to fp16 "
                      "(within 2^-11 of the file's)")
        parts = [grid.pack(integer_grid(layer.scheme.gguf_type, layer.blocks[a : a + rows]))
                 for a in range(0, layer.out_features, rows)]  # a head's codes never all unpacked at once
        return {k: torch.cat([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in parts[0]}

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        ops, n = torch.ops.localllm, layer.out_features
        group = INTEGER_GRIDS[layer.scheme.gguf_type][1]
        if hasattr(layer, "tile_offsets"):
            return ops.int4_q8_mm(x, layer.packed, layer.tile_scales, layer.tile_offsets, group, n)
        return ops.int8_q8_mm(x, layer.packed, layer.tile_scales, group, n)

    @staticmethod
    def rows_of(layer, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """A tied head's embedding rows from the kernel's layout (Q4_K's with the fp16-rounded scales)."""
        return GGUFQ8CPU._grid(layer).rows_of(layer, tokens)


def gguf_dequantize(blocks: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """(rows, bytes) uint8 blocks of a GGUF type -> (rows, in_features) fp32 weights, by the C++ decoder
    the matmul uses (bit for bit ``gguf.quants.dequantize``; the tests compare)."""
    if not native.available(LIBRARY):
        raise RuntimeError(f"localllm's CPU kernels are not built ({native.unavailable_reason()})")
    return torch.ops.localllm.gguf_dequant(blocks, GGUF_BLOCKS[type_name][0], in_features)


class GGUFBlocksCPU(Kernel):
    """A GGUF tensor's blocks as the file has them (the ``gguf`` scheme: Q4_K, Q5_0, Q6_K...): decode
    steps (a few rows of activations) run localllm's C++ kernel, which decodes each block as it
    multiplies; more rows (a batched step, a prefill) go through fp32 panels of the weights decoded
    by the same decoder (``gguf_gemm``, ``csrc/panel_gemm.h``). No copy of the whole weight is ever
    made, and the scales stay as exact as the file's (fp32 products, never rounded to 16 bits). Q5_0,
    Q4_K and Q6_K are repacked at load into ``csrc/tile_mm.cpp``'s tiles (:meth:`int5_pack`,
    :meth:`q4_k_pack`, :meth:`q6_k_pack`), whose decode kernels take int16 activations as
    :class:`Int4GroupCPU`'s do."""

    name = "gguf-blocks-cpu"
    scheme = "gguf"
    device_type = "cpu"
    #: Activation rows up to which the block-decoding kernel runs; above, the panel GEMM.
    GEMV_ROWS = 16

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "gguf":
            return "runs GGUF blocks only"
        return _native_cpu_unsupported(target, act_dtype)

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        if not native.available(LIBRARY):
            raise RuntimeError("localllm's CPU kernels are not built")
        if not getattr(layer, "serves_embedding", False):  # a tied head keeps its blocks: the embedding reads them
            if layer.scheme.gguf_type == "Q5_0":
                return GGUFBlocksCPU.int5_pack(layer.blocks)
            if layer.scheme.gguf_type == "Q4_K":
                return GGUFBlocksCPU.q4_k_pack(layer.blocks)
            if layer.scheme.gguf_type == "Q6_K":
                return GGUFBlocksCPU.q6_k_pack(layer.blocks)
        return {"blocks": layer.blocks}  # the file's bytes as they are

    @staticmethod
    def top_plane(top: torch.Tensor, bits: int) -> torch.Tensor:
        """(rows, in) each code's top ``bits`` bits past its nibble -> (rows, in * bits / 32) int32, the
        plane ``csrc/tile_mm.cpp`` reads beside the nibbles (``OctetHi``): a dword for 32 / bits columns,
        octet c's column i at bit bits * c + the bit where column i's nibble starts in its dword."""
        i = torch.arange(8)
        shift = torch.where(i < 4, 8 * i, 8 * (i - 4) + 4)  # (8,): where column i's nibble starts
        octets = 4 // bits
        at = shift + bits * torch.arange(octets).view(octets, 1)  # (octets, 8)
        words = (top.long().view(top.shape[0], -1, octets, 8) << at).sum((-1, -2))  # < 2^32
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    @staticmethod
    def int5_pack(blocks: torch.Tensor, rows: int | None = None) -> dict[str, torch.Tensor]:
        """Q5_0 blocks (out, in/32 * 22) -> ``csrc/tile_mm.cpp``'s int5 layout, the same codes and
        scales (``packed`` as :class:`Int4GroupCPU`'s, of the codes' low nibbles; ``fifth`` (tiles, in/32,
        64): dword j of group g holding row 16t + j's fifth bits, column 8c + i's at bit c + the bit
        where column i's nibble starts in its dword; ``tile_scales`` fp16 (tiles, in/32, 16): d). A
        decode step multiplies 16 rows' codes a vector without a byte shuffle, where the blocks' own
        layout (16 bytes of nibbles, then 4 of fifth bits, a row at a time) takes several."""
        tile = Int4GroupCPU.TILE
        rows = rows or Int4GroupCPU.PACK_ROWS
        rows -= rows % tile
        parts: dict[str, list[torch.Tensor]] = {"packed": [], "fifth": [], "tile_scales": []}
        for a in range(0, blocks.shape[0], rows):
            b = blocks[a : a + rows].reshape(-1, blocks.shape[1] // 22, 22)  # (r, nb, bytes): d, qh, qs
            r = b.shape[0]
            qs = b[..., 6:22]  # (r, nb, 16): column j's low 4 bits, column 16 + j's in the high nibble
            nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=-1).view(r, -1)  # (r, in): the codes' low 4 bits
            octets = Int4GroupCPU.octet_bytes(nibbles).view(torch.int32)  # (r, in/8)
            qh = b[..., 2:6]  # (r, nb, 4): bit i of byte c is column 8c + i's fifth bit
            fifth = ((qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(r, -1)  # (r, in)
            words = GGUFBlocksCPU.top_plane(fifth, 1)  # (r, in/32)
            d = b[..., 0:2].contiguous().view(torch.float16).view(r, -1)  # (r, nb)
            parts["packed"].append(Int4GroupCPU._tiles(octets, tile))  # (r/16, in/8, 16) dwords
            parts["fifth"].append(Int4GroupCPU._tiles(words, tile))  # (r/16, in/32, 16) dwords
            parts["tile_scales"].append(Int4GroupCPU._tiles(d, tile))
        out = {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}
        for k in ("packed", "fifth"):
            out[k] = out[k].view(torch.uint8).view(out[k].shape[0], out[k].shape[1], 4 * tile)
        return out

    @staticmethod
    def q4_k_pack(blocks: torch.Tensor, rows: int | None = None) -> dict[str, torch.Tensor]:
        """Q4_K blocks (out, in/256 * 144) -> ``csrc/tile_mm.cpp``'s Int4K layout, the same codes and
        scales in 148 bytes a 256 weights (``packed`` as :class:`Int4GroupCPU`'s, of the codes;
        ``mins`` uint8 (tiles, in/32, 32): each row's 6-bit sc of a sub-block, then its m, a byte each;
        ``supers`` fp16 (tiles, in/256, 32): d, then dmin). The kernel forms d * sc and -dmin * m in registers, exact in fp32,
        where the blocks' layout spreads each sub-block's codes with byte shuffles a row at a time."""
        tile = Int4GroupCPU.TILE
        rows = rows or Int4GroupCPU.PACK_ROWS
        rows -= rows % tile
        parts: dict[str, list[torch.Tensor]] = {"packed": [], "mins": [], "supers": []}
        for a in range(0, blocks.shape[0], rows):
            d, dmin, sc, m, codes = q4_k_parts(blocks[a : a + rows])  # (r, nb), (r, nb, 8), (r, in)
            r = codes.shape[0]
            parts["packed"].append(Int4GroupCPU._tiles(Int4GroupCPU.octet_bytes(codes).view(torch.int32), tile))
            # (r/16, in/32, 16) bytes of sc beside those of m: one (r/16, in/32, 32) row of 32 a group
            mins = [Int4GroupCPU._tiles(v.reshape(r, -1), tile) for v in (sc, m)]
            parts["mins"].append(torch.cat(mins, dim=-1))
            parts["supers"].append(torch.cat([Int4GroupCPU._tiles(v, tile) for v in (d, dmin)], dim=-1))
        out = {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}
        out["packed"] = out["packed"].view(torch.uint8).view(out["packed"].shape[0], out["packed"].shape[1], 4 * tile)
        return out

    @staticmethod
    def q6_k_pack(blocks: torch.Tensor, rows: int | None = None) -> dict[str, torch.Tensor]:
        """Q6_K blocks (out, in/256 * 210) -> ``csrc/tile_mm.cpp``'s Int6K layout, the same codes and
        scales in as many bytes (``packed`` as :class:`Int4GroupCPU`'s, of the codes' low nibbles;
        ``top`` uint8 (tiles, in/16, 64): dword j of sub-block g holding row 16t + j's top two bits, those
        of column 8c + i (octet c of the sub-block) at bits 2c, 2c + 1 from where column i's nibble
        starts; ``sub_scales`` int8 (tiles, in/16, 16): sc; ``supers`` fp16 (tiles, in/256, 16): d). The
        kernel forms d * sc and -32 d * sc in registers, exact in fp32, where the blocks' layout spreads
        each sub-block's codes over two arrays with byte shuffles a row at a time."""
        tile = Int4GroupCPU.TILE
        rows = rows or Int4GroupCPU.PACK_ROWS
        rows -= rows % tile
        parts: dict[str, list[torch.Tensor]] = {"packed": [], "top": [], "sub_scales": [], "supers": []}
        for a in range(0, blocks.shape[0], rows):
            d, sc, codes = q6_k_parts(blocks[a : a + rows])  # (r, nb), (r, nb, 16), (r, in)
            r = codes.shape[0]
            octets = Int4GroupCPU.octet_bytes(codes & 0x0F).view(torch.int32)  # (r, in/8)
            words = GGUFBlocksCPU.top_plane(codes >> 4, 2)  # (r, in/16)
            parts["packed"].append(Int4GroupCPU._tiles(octets, tile))
            parts["top"].append(Int4GroupCPU._tiles(words, tile))
            parts["sub_scales"].append(Int4GroupCPU._tiles(sc.reshape(r, -1), tile))
            parts["supers"].append(Int4GroupCPU._tiles(d, tile))
        out = {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}
        for k in ("packed", "top"):
            out[k] = out[k].view(torch.uint8).view(out[k].shape[0], out[k].shape[1], 4 * tile)
        return out

    @classmethod
    def row_limit(cls, layer):  # type: ignore[no-untyped-def]
        """Repacked layers (Q5_0, Q4_K, Q6_K) take the tile kernels' rows (:class:`Int4GroupCPU`'s);
        the file's own blocks, the block-decoding kernel's."""
        repacked = any(hasattr(layer, name) for name in ("sub_scales", "supers", "fifth"))
        return Int4GroupCPU.GEMV_ROWS if repacked else cls.GEMV_ROWS

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        ops = torch.ops.localllm
        row_kernel = x.shape[0] <= GGUFBlocksCPU.row_limit(layer)
        if hasattr(layer, "sub_scales"):  # Q6_K, repacked (q6_k_pack)
            op = ops.int6k_group_mm if row_kernel else ops.int6k_group_gemm
            return op(x, layer.packed, layer.top, layer.sub_scales, layer.supers, layer.out_features)
        if hasattr(layer, "supers"):  # Q4_K, repacked (q4_k_pack)
            op = ops.int4k_group_mm if row_kernel else ops.int4k_group_gemm
            return op(x, layer.packed, layer.mins, layer.supers, layer.out_features)
        if hasattr(layer, "fifth"):  # Q5_0, repacked (int5_pack): the int4 kernel's register rows and panels
            op = ops.int5_group_mm if row_kernel else ops.int5_group_gemm
            return op(x, layer.packed, layer.fifth, layer.tile_scales, layer.out_features)
        kind = GGUF_BLOCKS[layer.scheme.gguf_type][0]
        op = ops.gguf_mm if row_kernel else ops.gguf_gemm
        return op(x, layer.blocks, kind, layer.in_features)


class GGUFBlocksCUDA(Kernel):
    """A GGUF tensor's blocks on CUDA (the ``gguf`` scheme): a Triton kernel decodes each block in
    registers as it multiplies (:mod:`quant.gguf_triton`); the bytes stay as the file has them."""

    name = "gguf-blocks-cuda"
    scheme = "gguf"
    device_type = "cuda"

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "gguf":
            return "runs GGUF blocks only"
        if target.type != "cuda":
            return "runs on CUDA only"
        if importlib.util.find_spec("triton") is None:
            return "needs Triton (torch's CUDA builds install it)"
        from localllm.quant.gguf_triton import TYPES  # imports Triton: only for a CUDA target

        if layer.scheme.gguf_type not in TYPES:
            return f"has no Triton decoder for {layer.scheme.gguf_type}"
        return None

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return {"blocks": layer.blocks}  # the file's bytes as they are

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        from localllm.quant.gguf_triton import gguf_mm

        return gguf_mm(x, layer.blocks, layer.scheme.gguf_type, layer.in_features)


class Nf4Bitsandbytes(Kernel):
    name = "nf4-bitsandbytes"
    scheme = "nf4"

    @staticmethod
    def unsupported(layer, target, act_dtype) -> str | None:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "nf4":
            return "runs nf4 weights only"
        try:
            with quiet_bitsandbytes():
                import bitsandbytes  # noqa: F401
        except ImportError:
            return "needs bitsandbytes (pip install bitsandbytes)"
        return None

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        # The code book goes to the device here, at load, not at a layer's first call (on CUDA a
        # blocking upload, a host sync, in every layer of the first forward).
        code = Nf4Bitsandbytes._code(layer.absmax.device)
        return {"qweight": layer.qweight, "absmax": layer.absmax, "code": code}

    @staticmethod
    def _state(layer):  # type: ignore[no-untyped-def]
        """bitsandbytes' QuantState over the layer's tensors, made once for them (found again by the
        tensors' identity: no data_ptr, which fake and traced tensors do not have)."""
        from bitsandbytes.functional import QuantState

        cached = layer.__dict__.get("_bnb_state")
        if cached is None or cached[0] is not layer.absmax or cached[1] is not layer.code:
            state = QuantState(
                absmax=layer.absmax.view(-1),
                shape=torch.Size((layer.out_features, layer.in_features)),
                code=layer.code,
                blocksize=layer.scheme.group_size,
                quant_type="nf4",
                dtype=layer.act_dtype,
            )
            cached = layer.__dict__["_bnb_state"] = (layer.absmax, layer.code, state)
        return cached[2]

    @staticmethod
    def _code(device: torch.device) -> torch.Tensor:
        from bitsandbytes.functional import get_4bit_type

        return get_4bit_type("nf4", device=device)

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        with quiet_bitsandbytes():
            import bitsandbytes as bnb

        return bnb.matmul_4bit(x, layer.qweight.view(-1, 1).t(), quant_state=Nf4Bitsandbytes._state(layer))


#: In order of preference; the first that supports a layer (and passes its check) is used.
KERNELS: tuple[type[Kernel], ...] = (
    Int4TritonCUDA, Int4TinygemmCUDA, Int4TinygemmCPU, Int4GroupCPU, Int8GroupCPU, Int8TritonCUDA, Int8WeightOnly,
    GGUFBlocksCPU, GGUFBlocksCUDA,
    Nf4Bitsandbytes, Int4Q8CPU, Int8Q8CPU, GGUFQ8CPU, Reference
)
BY_NAME = {k.name: k for k in KERNELS}


def candidates(layer: "QuantLinear", target: "Target | torch.device", act_dtype: torch.dtype) -> list[type[Kernel]]:
    """The kernels that can run ``layer`` on ``target`` (a :class:`quant.target.Target`; a bare device
    is resolved with :meth:`Target.of`), in order of preference."""
    target = Target.of(target)
    return [k for k in KERNELS if not k.opt_in and k.unsupported(layer, target, act_dtype) is None]


def why_not_fast(layer: "QuantLinear", target: "Target | torch.device", act_dtype: torch.dtype) -> list[str]:
    """Why each fast kernel of the layer's scheme cannot run it here ("int4-tinygemm-cpu needs
    bfloat16 activations, not float32"): what a warning about the slow reference names. Kernels made
    for another device are named only when none is made for this one (grouped int8 on CUDA)."""
    target = Target.of(target)
    fast = [k for k in KERNELS if k is not Reference and not k.opt_in and k.scheme == layer.scheme.name]
    if any(k.device_type == target.type for k in fast):
        fast = [k for k in fast if k.device_type in (None, target.type)]
    reasons = []
    for k in fast:
        why = k.unsupported(layer, target, act_dtype)
        if why is not None:
            reasons.append(f"{k.name} {why}")
    return reasons


def agrees_with_reference(layer: "QuantLinear", kernel: type[Kernel], tensors: dict[str, torch.Tensor]) -> bool:
    """Run ``kernel`` and the reference on the same random input; True when they agree closely.

    The kernel computes every output; the reference only a sample of :data:`REFERENCE_ROWS` rows
    spread over them (first and last included): a wrong layout shows in any of them, and a
    vocabulary head is not dequantized whole at every start."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, layer.in_features, generator=g).to(device=layer.device, dtype=layer.act_dtype)
    canonical = layer.canonical()
    rows = None
    if layer.out_features > REFERENCE_ROWS:
        rows = torch.linspace(0, layer.out_features - 1, REFERENCE_ROWS).round().long().unique()
        canonical = {k: v[rows.to(v.device)] for k, v in canonical.items()}
    with torch.no_grad():
        want = reference_linear(canonical, layer.scheme, x.float())
        del canonical
        saved = {k: getattr(layer, k, None) for k in tensors}
        for k, v in tensors.items():
            setattr(layer, k, v)
        try:
            got = kernel.matmul(layer, x).float()
        except RuntimeError as e:
            warn_once(f"kernel {kernel.name} fails on {layer.scheme.label()} layers here "
                      f"({str(e).splitlines()[0] if str(e) else type(e).__name__})")
            return False
        finally:
            for k, v in saved.items():
                if v is None:
                    delattr(layer, k)
                else:
                    setattr(layer, k, v)
    if rows is not None:
        got = got[:, rows.to(got.device)]
    err = (got - want).norm() / want.norm().clamp(min=1e-6)
    return bool(err < 2e-2)  # bf16 activations and scales cost ~0.5%; a wrong layout costs ~100%


#: The warnings :func:`warn_once` has given in this process.
WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """A warning given once a process: a model's 200 layers falling back for one reason are one line."""
    if message not in WARNED:
        WARNED.add(message)
        warnings.warn(message, stacklevel=3)
