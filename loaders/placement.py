"""Where a model's parts live when its device is a GPU: which layers' experts stay in CPU RAM.

A Mixture-of-Experts model works only ``n_active`` of its ``n_experts`` experts per token, so its
experts can live in the CPU's RAM and run there (``localllm::moe_ffn``) while everything a token
always touches stays on the GPU: embeddings, attention, norms, routers, shared experts, the head, the
KV cache and the activations. The memory plan (:mod:`loaders.memory_plan`) puts those on the GPU
first, then as many layers' experts as fit; the experts of the first layers go to the CPU, as
llama.cpp's ``--n-cpu-moe N`` does (its first ``N`` layers), so the flags mean the same in both:

* automatic (no flag): the smallest ``N`` whose plan fits the GPU's free memory; every layer's when the
  experts hold GGUF blocks, which no GPU expert kernel multiplies yet (:func:`experts_run_on_host`);
* ``--n-cpu-moe N``: the experts of layers ``0 .. N-1`` in CPU RAM;
* ``--cpu-moe``: every layer's experts in CPU RAM.

On a CPU device everything is in CPU RAM already: the flags are accepted and change nothing.
A dense model (no experts) is placed whole on its device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from localllm.format import human_size


@dataclass(frozen=True)
class ExpertChoice:
    """What the user asked for: ``--cpu-moe``, ``--n-cpu-moe N``, or neither (automatic)."""

    cpu_moe: bool = False
    n_cpu_moe: int | None = None

    @property
    def automatic(self) -> bool:
        return not self.cpu_moe and self.n_cpu_moe is None

    def layers(self, n_layers: int) -> int:
        """How many first layers' experts the user put in CPU RAM (automatic: not decided here)."""
        if self.cpu_moe:
            return n_layers
        return min(max(self.n_cpu_moe or 0, 0), n_layers)

    def flag(self, n: int, n_layers: int) -> str:
        """The flag that asks for ``n`` layers' experts in CPU RAM."""
        return "--cpu-moe" if n >= n_layers else f"--n-cpu-moe {n}"


@dataclass(frozen=True)
class Placement:
    """Which layers' experts live in CPU RAM (``host_layers``) on a GPU run, and why."""

    #: The device everything else lives on.
    device: str
    #: Each layer's experts' bytes (0: a dense layer).
    expert_bytes: tuple[int, ...]
    #: The first ``n_cpu_moe`` layers' experts are in CPU RAM (0: none).
    n_cpu_moe: int
    #: "automatic", "--n-cpu-moe N", "--cpu-moe", or "cpu" (a CPU run: everything in RAM).
    chosen_by: str
    #: The GPU's free memory the choice was made against (bytes; 0 where not a GPU run).
    gpu_free: int = 0

    @property
    def host_layers(self) -> tuple[int, ...]:
        """The sparse layers whose experts are in CPU RAM."""
        return tuple(i for i in range(self.n_cpu_moe) if self.expert_bytes[i])

    @property
    def host_bytes(self) -> int:
        return sum(self.expert_bytes[i] for i in self.host_layers)

    @property
    def split(self) -> bool:
        """Whether some experts live apart from the rest of the model."""
        return bool(self.host_layers) and torch.device(self.device).type != "cpu"

    def describe(self) -> list[str]:
        """``show``'s and ``run --verbose``'s lines: where each part lives and why."""
        sparse = [i for i, b in enumerate(self.expert_bytes) if b]
        if torch.device(self.device).type == "cpu":
            return ["all parts in CPU RAM (a CPU run)"]
        rest = "embeddings, attention, norms, routers, shared experts, head, KV cache"
        if not sparse:
            return [f"all layers on {self.device}"]
        lines = [f"{rest} on {self.device}"]
        host, gpu = self.host_layers, [i for i in sparse if i not in self.host_layers]
        per = max(self.expert_bytes) if sparse else 0
        why = f"{self.chosen_by}; {self.device} memory: {human_size(self.gpu_free)} free, experts " \
              f"{human_size(per)} a layer" if self.gpu_free else self.chosen_by
        if host:
            lines.append(f"experts of layers {_ranges(host)} in CPU RAM, run on the CPU ({human_size(self.host_bytes)}; "
                         f"{why})")
        if gpu:
            lines.append(f"experts of layers {_ranges(gpu)} on {self.device}" + ("" if host else f" ({why})"))
        return lines


def _ranges(layers: list[int] | tuple[int, ...]) -> str:
    """[0, 1, 2, 5] -> ``0-2, 5``."""
    out, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def expert_layer_bytes(model: nn.Module, act_dtype: torch.dtype) -> tuple[int, ...]:
    """Each block's experts' bytes in ``model`` (on ``meta`` or loaded): its stacked expert projections'
    tensors (parameters in ``act_dtype``, as :func:`loaders.memory_plan.meta_weight_bytes` counts them);
    0 for a dense block."""
    from localllm.runtime.moe import MoE

    sizes = []
    for block in getattr(model, "layers", []):
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, MoE):
            sizes.append(0)
            continue
        n = sum(p.numel() * act_dtype.itemsize for p in mlp.experts.parameters())
        n += sum(b.numel() * b.element_size() for b in mlp.experts.buffers())
        sizes.append(n)
    return tuple(sizes)


def experts_run_on_host(model: nn.Module) -> bool:
    """Whether ``model``'s experts hold GGUF blocks (a MoE GGUF's, gpt-oss's MXFP4): only the CPU's expert
    kernel multiplies those in place, while on a GPU the reference would decode every active expert's
    blocks through the host at every step, so the automatic placement keeps them in CPU RAM."""
    from localllm.quant.experts import QuantExperts

    return any(isinstance(m, QuantExperts) and m.scheme.name == "gguf" for m in model.modules())


def host_expert_modules(n_cpu_moe: int, expert_bytes: tuple[int, ...]) -> frozenset[str]:
    """The module names (``layers.3.mlp.experts``) whose tensors load into CPU RAM."""
    return frozenset(f"layers.{i}.mlp.experts" for i in range(min(n_cpu_moe, len(expert_bytes))) if expert_bytes[i])
