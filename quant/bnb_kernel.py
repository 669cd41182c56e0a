"""nf4 weights through bitsandbytes' ``matmul_4bit`` (CPU and CUDA)."""

from __future__ import annotations

import torch

from localllm.quant.formats import quiet_bitsandbytes
from localllm.quant.kernel_base import Kernel


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
