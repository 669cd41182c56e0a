"""Streaming conversion of named float tensors into a scheme's canonical tensors.

One tensor is in flight at a time, so quantizing a checkpoint needs memory for the output plus the
largest single tensor, never the whole float model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from localllm.quant.experts import expert_name, split_expert_name
from localllm.quant.formats import QuantScheme, quantize
from localllm.quant.linear import head_serves_embedding

#: module name -> the scheme its weight is stored in (modules not named stay float).
Plan = dict[str, QuantScheme]


def quantize_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
    plan: Plan,
    tied_head: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` with the weight of each module in ``plan`` replaced by its canonical
    tensors in the module's scheme (``{module}.qweight``, ``.scales``...). Other tensors pass through.

    ``tied_head``: the model ties its output head to the embedding but the head is quantized, so the
    head's tensors are made from ``embed.weight``, which passes through unchanged unless the head
    also serves as the embedding (:func:`quant.linear.head_serves_embedding`: an int8 or GGUF-block head), when
    the model has no 16-bit table to fill.
    """
    head_done = False
    for name, t in tensors:
        module, _, leaf = name.rpartition(".")
        expert = split_expert_name(name)  # one expert of stacked experts: the plan names the stack
        if leaf == "weight" and expert is not None and expert[0].rpartition(".")[0] in plan:
            yield from _quantized(module, t, plan[expert[0].rpartition(".")[0]])
            del t
            continue
        if leaf == "weight" and module in plan and t.dim() == 3:
            yield from _experts_quantized(module, t, plan[module])  # stacked float experts: one at a time
            del t
            continue
        if leaf == "weight" and module in plan:
            if module == "output":
                if head_done:
                    continue  # a tied checkpoint that also stores lm_head: one copy is enough
                head_done = True
            yield from _quantized(module, t, plan[module])
            del t  # not held while the consumer works on the next tensor
            continue
        if tied_head and name == "embed.weight" and "output" in plan and not head_done:
            head_done = True
            yield from _quantized("output", t, plan["output"])
            if head_serves_embedding(plan["output"]):
                continue
        yield name, t
        del t


def _experts_quantized(module: str, w: torch.Tensor, scheme: QuantScheme) -> Iterator[tuple[str, torch.Tensor]]:
    """Stacked float experts (E, out, in) ``{prefix}.experts.{proj}.weight`` as each expert's canonical
    tensors, named for its slice (``{prefix}.experts.{e}.{proj}.qweight``)."""
    experts, _, proj = module.rpartition(".")
    for e in range(w.shape[0]):
        for k, t in quantize(w[e], scheme).items():
            yield expert_name(experts, e, proj, k), t


def _quantized(module: str, w: torch.Tensor, scheme: QuantScheme) -> Iterator[tuple[str, torch.Tensor]]:
    parts = quantize(w, scheme)
    del w
    while parts:
        k = next(iter(parts))
        yield f"{module}.{k}", parts.pop(k)
