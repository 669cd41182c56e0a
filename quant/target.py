"""Where kernels run: a device and, for a CUDA device, its compute capability.

The device decision is made once, where the user's ``--device`` is resolved
(:func:`loaders.load.load_model`), and passed down to the kernel choice
(:meth:`quant.linear.QuantLinear.prepare`, :func:`quant.kernels.candidates`), which never asks
``torch.cuda`` itself. So a caller can also say "a CUDA device of capability (8, 9)" without one
being present: the CUDA dry run (``tests/test_cuda_dryrun.py``) builds models on a fake CUDA device
under ``FakeTensorMode`` and checks the CUDA branches' choices, shapes, dtypes and devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    """A device kernels are chosen for. ``capability`` is (major, minor) for a CUDA device, None
    elsewhere (or when unknown: the kernels that need sm80+ then say so)."""

    device: torch.device
    capability: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))
        if self.capability is not None:
            object.__setattr__(self, "capability", tuple(self.capability))

    @property
    def type(self) -> str:
        """The device type ("cpu", "cuda", ...)."""
        return self.device.type

    @classmethod
    def of(cls, device: "torch.device | str | Target") -> "Target":
        """The target for a real ``device``: a CUDA device's capability is read from it here (once).
        A :class:`Target` is returned as it is."""
        if isinstance(device, Target):
            return device
        device = torch.device(device)
        capability = None
        if device.type == "cuda":
            capability = tuple(torch.cuda.get_device_capability(device))
        return cls(device, capability)  # type: ignore[arg-type]

    def describe(self) -> str:
        """E.g. ``cuda (sm89)`` or ``cpu``."""
        if self.capability is None:
            return str(self.device)
        return f"{self.device} (sm{self.capability[0]}{self.capability[1]})"
