"""The reference product: dequantize a slice of one layer's output rows at a time, multiply, drop it.
It runs every scheme on every device, and every fast kernel is checked against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localllm.quant.formats import dequantize
from localllm.quant.kernel_base import Kernel

#: Weights the reference dequantizes at a time, by device type (others: ``"default"``): on the CPU
#: 4M (16 MB of fp32), so a vocabulary head's float weight never exists whole in RAM; on a GPU a
#: 7B model's head at once, since each slice costs kernel launches at every token.
REFERENCE_ELEMENTS = {"cpu": 1 << 22, "default": 1 << 28}


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
