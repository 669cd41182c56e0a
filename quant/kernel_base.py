"""The interface every matmul kernel implements (:class:`Kernel`), and :class:`Layout`, the record of
how a kernel with several layouts laid out one layer's tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from localllm.quant.target import Target

if TYPE_CHECKING:
    from localllm.quant.linear import QuantLinear


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, as the kernels' refusals name activation dtypes."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Layout:
    """One arrangement of a layer's tensors, for a kernel that has several (a GGUF type's blocks kept
    as the file has them, or repacked into tiles). The kernel chooses it when it prepares the layer
    (:meth:`Kernel.layout_for`), the layer records it (``QuantLinear.layout``), and the kernel's
    products and row limit are picked by that record, never by which tensors the layer holds."""

    name: str
    #: The layer's tensors in this layout, in the order its ops take them after the activations.
    tensors: tuple[str, ...]
    #: The ``torch.ops.localllm`` op for up to :meth:`Kernel.row_limit` activation rows (a decode step).
    row_op: str
    #: The op for more rows (a batched step, a prefill).
    panel_op: str


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
    #: ``rows_of(layer, tokens)``: (n,) row ids -> (n, in) fp32 weights, read back from the kernel's
    #: own layout (a tied model's embedding reads its head's rows so); None: the kernel keeps the
    #: layer's canonical tensors or GGUF blocks, which the embedding reads as they are.
    rows_of = None

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
    def layout_for(layer: "QuantLinear") -> Layout | None:
        """The layout :meth:`prepare` makes of ``layer``'s tensors, for a kernel with several (None:
        it has one). :meth:`QuantLinear.prepare` records it on the layer."""
        return None

    @staticmethod
    def prepare(layer: "QuantLinear") -> dict[str, torch.Tensor]:
        """Kernel-layout tensors built from the layer's canonical ones (on the layer's device)."""
        raise NotImplementedError

    @staticmethod
    def caveat(layer: "QuantLinear") -> str | None:
        """What holding ``layer`` in this kernel's layout changes in its weights (said once a process
        when a layer is prepared), or None: it keeps them exactly."""
        return None

    @staticmethod
    def matmul(layer: "QuantLinear", x: torch.Tensor) -> torch.Tensor:
        """x (M, in) in the activation dtype -> (M, out)."""
        raise NotImplementedError
