"""Build a Transformer on the ``meta`` device and fill it from a stream of named tensors."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.heap import trim_heap
from localllm.quant.linear import QuantLinear, TiedHeadEmbedding, concat_linears
from localllm.quant.target import Target
from localllm.runtime.config import ModelConfig
from localllm.quant.experts import QuantExperts, concat_experts, split_expert_name
from localllm.runtime.model import MLP, Attention, Transformer
from localllm.runtime.moe import Experts

#: Fused module -> (the modules holding it, the projections it stacks, in output order).
FUSIONS = {"qkv": ((Attention,), ("q", "k", "v")), "gate_up": ((MLP, Experts), ("gate", "up"))}


def empty_model(config: ModelConfig) -> Transformer:
    """The model's structure with no storage: parameters live on ``meta`` until assigned."""
    with torch.device("meta"):
        return Transformer(config)


@dataclass
class _Target:
    """One tensor of the model being filled: whole from one source tensor, or (fused) row slices."""

    name: str
    module: nn.Module
    leaf: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool
    pending: set[str] = field(default_factory=set)  # source names still to arrive


def _targets(model: nn.Module,
             dtype: torch.dtype) -> tuple[dict[str, _Target], dict[str, tuple[_Target, int, int, int]]]:
    """The model's tensors by name, and the source names that fill a slice of one: a fused module's
    parts (``layers.0.attn.k.weight`` -> rows of ``layers.0.attn.qkv.weight``; a fused expert
    projection's, rows of each expert): (target, first row, rows, the dim the rows are on)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    modules = dict(model.named_modules())
    targets: dict[str, _Target] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        module_name, _, leaf = name.rpartition(".")
        is_param = name in params
        target_dtype = dtype if is_param else t.dtype
        targets[name] = _Target(name, modules[module_name], leaf, tuple(t.shape), target_dtype, is_param)
    slices: dict[str, tuple[_Target, int, int, int]] = {}
    for module_name, module in modules.items():
        parts = getattr(module, "fused_from", None)
        if not parts:
            continue
        parent = module_name.rpartition(".")[0]
        dim = 1 if isinstance(module, QuantExperts) else 0  # stacked experts: rows within each expert
        for leaf in [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]:
            target = targets[f"{module_name}.{leaf}"]
            start = 0
            for part, rows, has_bias in parts:
                if leaf != "bias" or has_bias:
                    source = f"{parent}.{part}.{leaf}"
                    slices[source] = (target, start, rows, dim)
                    target.pending.add(source)
                start += rows
    return targets, slices


def _assign(target: _Target, t: torch.Tensor) -> None:
    if target.is_param:
        target.module._parameters[target.leaf] = nn.Parameter(t, requires_grad=False)
    else:
        target.module._buffers[target.leaf] = t


def load_weights(
    model: Transformer,
    tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | Target,
    dtype: torch.dtype,
    source: str,
    kernel: str | None = None,
    check: bool = True,
    host: frozenset[str] = frozenset(),
) -> Transformer:
    """Assign each (name, tensor) to ``model`` in ``dtype`` on ``device``, checking names and shapes.

    Streaming: each tensor is converted and put in place as it arrives, so at most one source tensor
    is held beside the model being filled. Parameters (embedding, norms, float linears, biases) take
    ``dtype``; buffers (the quantized weights' codes and scales) keep the dtype their module declares.
    A model fused on ``meta`` (:func:`fuse_projections` before loading) receives the checkpoint's
    separate projections into row slices of its fused tensors, never a concatenated copy. Stacked
    experts (:class:`quant.experts.QuantExperts`) arrive whole or one expert at a time
    (``layers.0.mlp.experts.7.gate.qweight``: :func:`quant.experts.split_expert_name`), each into its
    slice. Each
    :class:`QuantLinear` is prepared (kernel chosen, repacked, ``dtype`` activations, ``kernel`` if it
    can run it) as soon as its tensors are complete, so its canonical tensors live only that long.
    ``device`` may be a :class:`quant.target.Target` (the device with a CUDA device's capability, as
    the caller resolved it: kernels are chosen for it); ``check=False`` skips the kernels' check
    against the reference (:meth:`QuantLinear.prepare`). ``host`` names modules (a MoE layer's
    ``layers.3.mlp.experts``, a block ``layers.0`` below ``--gpu-layers``) whose tensors go to CPU RAM
    instead (:mod:`loaders.placement`), their layers prepared for the CPU's kernels.
    """
    where = Target.of(device)
    device = where.device

    def device_of(target: _Target) -> torch.device:
        return torch.device("cpu") if any(target.name.startswith(f"{m}.") for m in host) else device
    tied = model.config.tie_embeddings and isinstance(model.output, nn.Linear)
    shared_embedding = isinstance(getattr(model, "embed", None), TiedHeadEmbedding)
    targets, slices = _targets(model, dtype)
    if tied:
        del targets["output.weight"]  # the embedding's tensor, tied below
    unfilled = {name for name, target in targets.items() if not target.pending}  # whole tensors still to come
    waiting: dict[int, set[str]] = {}  # id(module) -> its tensors not yet complete
    for name, target in targets.items():
        waiting.setdefault(id(target.module), set()).add(name)
    verdicts: dict[tuple, bool] = {}
    arrived: set[str] = set()
    experts_left: dict[str, set[int]] = {}  # a stacked tensor arriving one expert at a time -> experts to come
    block = ""  # the transformer block the stream is in ("layers.3."): its temporaries are freed after it

    def complete(target: _Target) -> None:
        left = waiting[id(target.module)]
        left.discard(target.name)
        if not left and isinstance(target.module, QuantLinear):  # a layer in CPU RAM takes the CPU's kernels
            on_host = device_of(target).type == "cpu" and device.type != "cpu"
            target.module.prepare(dtype, kernel, verdicts, Target(torch.device("cpu")) if on_host else where, check)

    for name, t in tensors:
        here = name[: name.index(".", 7) + 1] if name.startswith("layers.") else ""
        if here != block:  # a block is complete: its conversions' freed pages go back (see localllm.heap)
            trim_heap()
            block = here
        if tied and name == "output.weight":
            continue  # some tied checkpoints still store lm_head: the embedding's tensor serves
        if shared_embedding and name == "embed.weight":
            continue  # a 16-bit table an older artifact stores beside its int8 head, which serves as it
        split = split_expert_name(name)
        whole, expert = split if split is not None else (name, None)  # the tensor it fills, the expert's slice
        if whole in slices:
            target, start, rows, dim = slices[whole]
            want = (*target.shape[:dim], rows, *target.shape[dim + 1 :])
        elif whole in targets:
            target, start, rows, dim = targets[whole], 0, 0, 0
            want = target.shape
        else:
            raise LocalLLMError(f"{source}: unexpected tensor '{name}'", "the checkpoint does not match its config")
        if expert is not None:
            if not isinstance(target.module, QuantExperts) or expert >= want[0]:
                raise LocalLLMError(f"{source}: unexpected tensor '{name}'", "the checkpoint does not match its config")
            want = want[1:]
        if name in arrived:
            raise LocalLLMError(f"{source}: tensor '{name}' appears twice",
                                "the checkpoint is damaged; download it again")
        arrived.add(name)
        if tuple(t.shape) != want:
            raise LocalLLMError(
                f"{source}: tensor '{name}' has shape {tuple(t.shape)}, the config implies {want}",
                "the checkpoint does not match its config",
            )
        if whole not in slices and expert is None:
            _assign(target, t.to(device=device_of(target), dtype=target.dtype))
            unfilled.discard(name)
            complete(target)
            continue
        current = getattr(target.module, target.leaf)
        if current.device.type == "meta":
            current = torch.empty(target.shape, dtype=target.dtype, device=device_of(target))
            if target.leaf == "bias":
                current.zero_()  # a part without bias contributes zeros
            _assign(target, current)
        part = current if expert is None else current[expert]
        if whole in slices:
            part = part.narrow(dim if expert is None else dim - 1, start, rows)
        part.copy_(t)
        del t, current, part
        if expert is not None:
            left = experts_left.setdefault(whole, set(range(target.shape[0])))
            left.discard(expert)
            if left:
                continue  # more of this tensor's experts to come
        if whole in slices:
            target.pending.discard(whole)
            if not target.pending:
                complete(target)
        else:
            unfilled.discard(whole)
            complete(target)
    missing = sorted(unfilled | {s for tg in targets.values() for s in tg.pending})
    if missing:
        raise LocalLLMError(
            f"{source}: missing tensor(s) {', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}",
            "the checkpoint is incomplete; download it again",
        )
    if tied:
        model.tie_weights()
    return model.eval().requires_grad_(False)


def fuse_projections(model: Transformer) -> Transformer:
    """Merge each block's q/k/v and gate/up projections into one matmul each.

    Fewer, larger matmuls: at batch 1 a decode step is dominated by per-call overhead and by reading
    weights, and a fused call reads the same bytes with a third (or half) of the calls. Done on the
    ``meta`` model before loading (:func:`load_weights` then fills the fused tensors' row slices) or
    on a loaded one (the tensors are concatenated), before kernels are chosen; the checkpoint and the
    artifact keep the separate layers. Each fused module records its parts in ``fused_from``:
    (name, output rows, has bias) in output order.
    """
    for owner in list(model.modules()):
        for fused_name, (kinds, part_names) in FUSIONS.items():
            if not isinstance(owner, kinds) or getattr(owner, fused_name) is not None:
                continue
            parts = [getattr(owner, p) for p in part_names]
            if len({getattr(m, "scheme", None) for m in parts}) > 1:
                continue  # mixed schemes (a GGUF's q in Q4_0 beside its v kept 16-bit): kept separate
            if getattr(parts[0], "scheme", None) is not None and parts[0].scheme.act_order:
                continue  # each part gathers its input in an order of its own (GPTQ desc_act)
            fused = concat_experts(parts) if isinstance(owner, Experts) else concat_linears(parts)
            fused.fused_from = tuple((p, m.out_features, m.bias is not None) for p, m in zip(part_names, parts))
            setattr(owner, fused_name, fused)
            for p in part_names:
                delattr(owner, p)
    return model
