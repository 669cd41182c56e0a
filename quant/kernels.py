"""Matmul kernels for quantized weights, and the choice among them per device.

Each kernel turns a :class:`quant.linear.QuantLinear`'s canonical tensors into the layout it wants
(``prepare``) and multiplies activations with them (``matmul``) without building the full-precision
weight of the model. The pure-torch reference (dequantize one layer, multiply, drop it) runs
everywhere; the fast kernels are checked against it when a layer is prepared and dropped with a
warning if they disagree, so a kernel that misbehaves on some GPU or build degrades to slow, never to
wrong.

=====================  ======  ============================================  =====================
kernel                 scheme  where                                         activations
=====================  ======  ============================================  =====================
int4-tinygemm-cpu      int4    CPU (``torch._weight_int4pack_mm_for_cpu``)   bf16
int4-tinygemm-cuda     int4    CUDA sm80+ (``torch._weight_int4pack_mm``)    bf16
int8-weight-only       int8    per-channel (``torch._weight_int8pack_mm``)   bf16 / fp16 / fp32
int8-group-cpu         int8    grouped, CPU (``localllm::int8_group_mm``)    bf16 / fp16 / fp32
nf4-bitsandbytes       nf4     bitsandbytes ``matmul_4bit`` (CPU and CUDA)   bf16 / fp16 / fp32
reference              all     dequantize one layer, ``F.linear``            any
=====================  ======  ============================================  =====================
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from localllm import native
from localllm.quant.formats import dequantize, unpack_int4

if TYPE_CHECKING:
    from localllm.quant.linear import QuantLinear

# bitsandbytes logs a warning on its first CPU 4-bit matmul when the optional `kernels` package is
# missing, then uses its own fallback (which the reference check covers): keep stderr clean.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


class Kernel:
    """A way to multiply by a quantized weight. Subclasses set ``name`` and override the three methods."""

    name = "base"

    @staticmethod
    def supports(layer: "QuantLinear", device: torch.device, act_dtype: torch.dtype) -> bool:
        raise NotImplementedError

    @staticmethod
    def prepare(layer: "QuantLinear") -> dict[str, torch.Tensor]:
        """Kernel-layout tensors built from the layer's canonical ones (on the layer's device)."""
        raise NotImplementedError

    @staticmethod
    def matmul(layer: "QuantLinear", x: torch.Tensor) -> torch.Tensor:
        """x (M, in) in the activation dtype -> (M, out)."""
        raise NotImplementedError


class Reference(Kernel):
    name = "reference"

    @staticmethod
    def supports(layer, device, act_dtype) -> bool:  # type: ignore[no-untyped-def]
        return True

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return dict(layer.canonical())

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        # One layer's weight exists in full precision only for the duration of this call.
        return F.linear(x, dequantize(layer.canonical(), layer.scheme, x.dtype))


class Int4TinygemmCPU(Kernel):
    name = "int4-tinygemm-cpu"

    @staticmethod
    def supports(layer, device, act_dtype) -> bool:  # type: ignore[no-untyped-def]
        return (
            device.type == "cpu"
            and layer.scheme.name == "int4"
            and act_dtype == torch.bfloat16
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and layer.in_features % layer.scheme.group_size == 0  # type: ignore[operator]
        )

    @staticmethod
    def _scales_and_zeros(layer) -> torch.Tensor:  # type: ignore[no-untyped-def]
        # tinygemm dequantizes as (q - 8) * scale + zero: zero = offset + 8 * scale. (in/g, out, 2) bf16.
        s, o = layer.scales.float(), layer.offsets.float()
        return torch.stack([s, o + 8 * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        q = unpack_int4(layer.qweight).to(torch.int32)  # (out, in)
        return {
            "packed": torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2),
            "scales_zeros": Int4TinygemmCPU._scales_and_zeros(layer),
        }

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, layer.scheme.group_size, layer.scales_zeros)


class Int4TinygemmCUDA(Kernel):
    name = "int4-tinygemm-cuda"
    INNER_K_TILES = 8

    @staticmethod
    def supports(layer, device, act_dtype) -> bool:  # type: ignore[no-untyped-def]
        return (
            device.type == "cuda"
            and layer.scheme.name == "int4"
            and act_dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (8, 0)
            and layer.in_features % (16 * Int4TinygemmCUDA.INNER_K_TILES) == 0
            and layer.out_features % 8 == 0
        )

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        q = unpack_int4(layer.qweight)  # (out, in) uint8 codes
        hi_first = (q[:, 0::2] << 4) | q[:, 1::2]  # the CUDA packer wants the even column in the high nibble
        return {
            "packed": torch.ops.aten._convert_weight_to_int4pack(hi_first.contiguous(), Int4TinygemmCUDA.INNER_K_TILES),
            "scales_zeros": Int4TinygemmCPU._scales_and_zeros(layer),
        }

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.aten._weight_int4pack_mm(x, layer.packed, layer.scheme.group_size, layer.scales_zeros)


class Int8WeightOnly(Kernel):
    name = "int8-weight-only"

    @staticmethod
    def supports(layer, device, act_dtype) -> bool:  # type: ignore[no-untyped-def]
        return layer.scheme.name == "int8" and layer.scheme.group_size is None and hasattr(
            torch.ops.aten, "_weight_int8pack_mm"
        ) and (device.type == "cpu" or act_dtype in (torch.bfloat16, torch.float16))

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return {"qweight": layer.qweight, "kscales": layer.scales.to(layer.act_dtype)}

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.kscales)


def _register_fakes() -> None:
    """The op's output shape for tracing (torch.export, torch.compile), without running it."""

    @torch.library.register_fake("localllm::int8_group_mm")
    def _mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], qweight.shape[0]))


#: localllm's grouped int8 matmul (``csrc/int8_group_mm.cpp``), built by :mod:`localllm.native`.
LIBRARY = native.NativeLibrary(
    "localllm_int8", (Path(__file__).resolve().parent / "csrc" / "int8_group_mm.cpp",), ("int8_group_mm",),
    _register_fakes,
)


class Int8GroupCPU(Kernel):
    """int8 with a scale per group of inputs (a GGUF's Q8_0 blocks exactly) through localllm's C++
    kernel (:mod:`localllm.native`): as fast as the per-channel kernel, without re-rounding."""

    name = "int8-group-cpu"

    @staticmethod
    def supports(layer, device, act_dtype) -> bool:  # type: ignore[no-untyped-def]
        g = layer.scheme.group_size
        return (device.type == "cpu" and layer.scheme.name == "int8" and g is not None and g % 16 == 0
                and act_dtype in (torch.bfloat16, torch.float16, torch.float32) and native.available(LIBRARY))

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        if not native.available(LIBRARY):
            raise RuntimeError("localllm's CPU kernels are not built")
        return {"qweight": layer.qweight, "scales": layer.scales}  # the canonical layout as it is

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        return torch.ops.localllm.int8_group_mm(x, layer.qweight, layer.scales, layer.scheme.group_size)


class Nf4Bitsandbytes(Kernel):
    name = "nf4-bitsandbytes"

    @staticmethod
    def supports(layer, device, act_dtype) -> bool:  # type: ignore[no-untyped-def]
        if layer.scheme.name != "nf4":
            return False
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            return False
        return True

    @staticmethod
    def prepare(layer):  # type: ignore[no-untyped-def]
        return {"qweight": layer.qweight, "absmax": layer.absmax}

    @staticmethod
    def _state(layer):  # type: ignore[no-untyped-def]
        from bitsandbytes.functional import QuantState

        state = getattr(layer, "_bnb_state", None)
        if state is None or state.absmax.data_ptr() != layer.absmax.data_ptr():
            state = QuantState(
                absmax=layer.absmax.view(-1),
                shape=torch.Size((layer.out_features, layer.in_features)),
                code=Nf4Bitsandbytes._code(layer.absmax.device),
                blocksize=layer.scheme.group_size,
                quant_type="nf4",
                dtype=layer.act_dtype,
            )
            layer._bnb_state = state
        return state

    @staticmethod
    def _code(device: torch.device) -> torch.Tensor:
        from bitsandbytes.functional import get_4bit_type

        return get_4bit_type("nf4", device=device)

    @staticmethod
    def matmul(layer, x):  # type: ignore[no-untyped-def]
        import bitsandbytes as bnb

        return bnb.matmul_4bit(x, layer.qweight.view(-1, 1).t(), quant_state=Nf4Bitsandbytes._state(layer))


#: In order of preference; the first that supports a layer (and passes its check) is used.
KERNELS: tuple[type[Kernel], ...] = (
    Int4TinygemmCUDA, Int4TinygemmCPU, Int8WeightOnly, Int8GroupCPU, Nf4Bitsandbytes, Reference
)
BY_NAME = {k.name: k for k in KERNELS}


def candidates(layer: "QuantLinear", device: torch.device, act_dtype: torch.dtype) -> list[type[Kernel]]:
    return [k for k in KERNELS if k.supports(layer, device, act_dtype)]


def agrees_with_reference(layer: "QuantLinear", kernel: type[Kernel], tensors: dict[str, torch.Tensor]) -> bool:
    """Run ``kernel`` and the reference on the same random input; True when they agree closely."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, layer.in_features, generator=g).to(device=layer.qweight.device, dtype=layer.act_dtype)
    with torch.no_grad():
        want = F.linear(x.float(), dequantize(layer.canonical(), layer.scheme, torch.float32))
        saved = {k: getattr(layer, k, None) for k in tensors}
        for k, v in tensors.items():
            setattr(layer, k, v)
        try:
            got = kernel.matmul(layer, x).float()
        except RuntimeError as e:
            warnings.warn(f"kernel {kernel.name} failed on {tuple(x.shape)} x {layer.out_features}: {e}")
            return False
        finally:
            for k, v in saved.items():
                if v is None:
                    delattr(layer, k)
                else:
                    setattr(layer, k, v)
    err = (got - want).norm() / want.norm().clamp(min=1e-6)
    return bool(err < 2e-2)  # bf16 activations and scales cost ~0.5%; a wrong layout costs ~100%
