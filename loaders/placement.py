"""Where a model's parts live when its device is a GPU: which blocks, and which layers' experts, stay
in CPU RAM.

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

A model that does not fit the GPU whole (dense or not) keeps its first blocks in CPU RAM, as
llama.cpp's ``-ngl N`` / ``--gpu-layers N`` does: the last ``N`` transformer blocks, the final norm
and the head on the GPU, the first ``n_layers - N`` blocks (and their KV cache) in CPU RAM, computed by
the CPU's kernels; the embedding table goes with the first block when it is a table of its own (a
table tied to the head stays with the head). The hidden state crosses to the GPU once a step:

* automatic (no flag): every block on the GPU when the plan fits; else (a MoE model's experts moved
  first, as above) the largest ``N`` whose plan fits beside the head, the GPU blocks' KV cache and the
  activations;
* ``--gpu-layers N``: the last ``N`` blocks on the GPU (more than the model has: all of them).

On a CPU device everything is in CPU RAM already: the flags are accepted and change nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
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
class LayerChoice:
    """What the user asked for: ``--gpu-layers N`` (the last N blocks on the GPU), or automatic (None)."""

    gpu_layers: int | None = None

    @property
    def automatic(self) -> bool:
        return self.gpu_layers is None

    def layers(self, n_layers: int) -> int:
        """How many last blocks go on the GPU (automatic: all, until the plan says otherwise)."""
        return n_layers if self.gpu_layers is None else min(max(self.gpu_layers, 0), n_layers)


@dataclass(frozen=True)
class Placement:
    """Which blocks (``cpu_layers``) and which layers' experts (``host_layers``) live in CPU RAM on a GPU
    run, and why."""

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
    #: The last ``n_gpu_layers`` blocks are on the GPU, the first ones in CPU RAM (None: every block).
    n_gpu_layers: int | None = None
    #: Each block's bytes (its experts included), and the embedding table's when it is a table of its
    #: own (0: tied to the head, which it stays with); () where not known (every block on the GPU).
    layer_bytes: tuple[int, ...] = ()
    embed_bytes: int = 0
    #: "automatic", "--gpu-layers N" (where the blocks' placement came from).
    layers_by: str = "automatic"

    @property
    def cpu_layers(self) -> tuple[int, ...]:
        """The first blocks, which live (weights, KV cache) and compute in CPU RAM."""
        n = len(self.expert_bytes)
        return tuple(range(n - self.n_gpu_layers)) if self.n_gpu_layers is not None else ()

    @property
    def embed_on_host(self) -> bool:
        """Whether the embedding table goes to CPU RAM with the first block (a table of its own)."""
        return bool(self.cpu_layers) and self.embed_bytes > 0

    @property
    def cpu_layer_bytes(self) -> int:
        """The weights the CPU blocks (and the embedding table with them) hold in CPU RAM."""
        blocks = sum(self.layer_bytes[i] for i in self.cpu_layers) if self.layer_bytes else 0
        return blocks + (self.embed_bytes if self.embed_on_host else 0)

    @property
    def host_layers(self) -> tuple[int, ...]:
        """The sparse layers whose experts are in CPU RAM (a CPU block's experts included)."""
        cpu = set(self.cpu_layers)
        return tuple(i for i in range(len(self.expert_bytes))
                     if self.expert_bytes[i] and (i < self.n_cpu_moe or i in cpu))

    @property
    def host_bytes(self) -> int:
        """Every weight in CPU RAM: the CPU blocks (and the embedding table), the GPU blocks' experts there."""
        cpu = set(self.cpu_layers)
        return self.cpu_layer_bytes + sum(self.expert_bytes[i] for i in self.host_layers if i not in cpu)

    @property
    def split(self) -> bool:
        """Whether some blocks or experts live apart from the rest of the model."""
        return bool(self.host_layers or self.cpu_layers) and torch.device(self.device).type != "cpu"

    def host_modules(self) -> frozenset[str]:
        """The module names whose tensors load into CPU RAM (:func:`loaders.build.load_weights`'s ``host``)."""
        names = {f"layers.{i}" for i in self.cpu_layers} | host_expert_modules(self.n_cpu_moe, self.expert_bytes)
        return frozenset(names | ({"embed"} if self.embed_on_host else set()))

    def describe(self) -> list[str]:
        """``show``'s and ``run --verbose``'s lines: where each part lives and why."""
        sparse = [i for i, b in enumerate(self.expert_bytes) if b]
        if torch.device(self.device).type == "cpu":
            return ["all parts in CPU RAM (a CPU run)"]
        cpu = self.cpu_layers
        if not sparse and not cpu:
            return [f"all layers on {self.device}"]
        lines = []
        if cpu:
            n = len(self.expert_bytes)
            gpu_blocks = f"{blocks(range(len(cpu), n))}, " if len(cpu) < n else ""
            lines.append(f"{gpu_blocks}final norm, head{'' if self.embed_on_host else ', embeddings'} and the KV "
                         f"cache of those blocks on {self.device}")
            per = max(self.layer_bytes) if self.layer_bytes else 0
            why = f"{self.layers_by}; {self.device} memory: {human_size(self.gpu_free)} free, " \
                  f"{human_size(per)} a block" if self.gpu_free and per else self.layers_by
            lines.append(f"{blocks(cpu)}{' and embeddings' if self.embed_on_host else ''} and their KV "
                         f"cache in CPU RAM, run on the CPU ({human_size(self.cpu_layer_bytes)}; {why})")
            if not sparse:
                return lines
        else:
            lines.append(f"embeddings, attention, norms, routers, shared experts, head, KV cache on {self.device}")
        host = tuple(i for i in self.host_layers if i not in cpu)
        gpu = [i for i in sparse if i not in self.host_layers]
        per = max(self.expert_bytes) if sparse else 0
        why = f"{self.chosen_by}; {self.device} memory: {human_size(self.gpu_free)} free, experts " \
              f"{human_size(per)} a layer" if self.gpu_free else self.chosen_by
        if host:
            lines.append(f"experts of layers {_ranges(host)} in CPU RAM, run on the CPU "
                         f"({human_size(sum(self.expert_bytes[i] for i in host))}; {why})")
        if gpu:
            lines.append(f"experts of layers {_ranges(gpu)} on {self.device}" + ("" if host else f" ({why})"))
        return lines


def blocks(layers: Sequence[int]) -> str:
    """[3] -> ``block 3``; [0, 1, 2] -> ``blocks 0-2``."""
    return f"block{'s' if len(layers) > 1 else ''} {_ranges(layers)}"


def _ranges(layers: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> ``0-2, 5``."""
    layers = list(layers)
    out, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def weight_bytes(module: nn.Module, act_dtype: torch.dtype) -> int:
    """Bytes of ``module``'s weights once loaded (on ``meta`` or loaded): parameters in ``act_dtype`` (a
    float weight loads in the activation dtype), buffers in their own (a quantized layer's packed codes
    and scales), a tensor shared by two modules once. RoPE tables and KV cache buffers are not weights
    (the plan counts them with the KV cache). The one rule behind every count of weights here and in
    :mod:`loaders.memory_plan`: a block's, the experts', the embedding table's, the whole model's."""
    total = sum(p.numel() * act_dtype.itemsize for p in module.parameters())
    for name, b in module.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if not leaf.startswith("rope_") and ".kv_cache." not in f".{name}":
            total += b.numel() * b.element_size()
    return total


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
        sizes.append(weight_bytes(mlp.experts, act_dtype))
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


def layer_bytes(model: nn.Module, act_dtype: torch.dtype) -> tuple[int, ...]:
    """Each block's bytes in ``model`` (on ``meta`` or loaded): parameters in ``act_dtype``, buffers in
    their own dtype, as :func:`loaders.memory_plan.meta_weight_bytes` counts the whole model."""
    return tuple(weight_bytes(block, act_dtype) for block in getattr(model, "layers", []))


def own_embed_bytes(model: nn.Module, act_dtype: torch.dtype) -> int:
    """The embedding table's bytes when it is a table of its own, which goes to CPU RAM with the first
    block (llama.cpp keeps it there too); 0 when it is the head's tensor (tied: it stays with the head)
    or the head serves as the embedding (:class:`quant.linear.TiedHeadEmbedding`)."""
    embed = getattr(model, "embed", None)
    weight = getattr(embed, "weight", None)
    if not isinstance(weight, torch.Tensor) or getattr(getattr(model, "config", None), "tie_embeddings", False):
        return 0
    return weight_bytes(embed, act_dtype)
