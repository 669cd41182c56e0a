"""Build a Transformer on the ``meta`` device and fill it from a stream of named tensors."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from localllm.errors import LocalLLMError
from localllm.quant.linear import concat_linears
from localllm.runtime.config import ModelConfig
from localllm.runtime.model import Transformer


def empty_model(config: ModelConfig) -> Transformer:
    """The model's structure with no storage: parameters live on ``meta`` until assigned."""
    with torch.device("meta"):
        return Transformer(config)


def load_weights(
    model: Transformer,
    tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype,
    source: str,
) -> Transformer:
    """Assign each (name, tensor) to ``model`` in ``dtype`` on ``device``, checking names and shapes.

    Parameters (embedding, norms, float linears, biases) are converted to ``dtype`` as they stream
    in, so at most one source tensor is held beside the converted model; buffers (the quantized
    weights' codes and scales) keep the dtype their module declares.
    """
    expected = model.state_dict()
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied = model.config.tie_embeddings and isinstance(model.output, torch.nn.Linear)
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if name not in expected:
            raise LocalLLMError(f"{source}: unexpected tensor '{name}'", "the checkpoint does not match its config")
        want = expected[name]
        if tuple(t.shape) != tuple(want.shape):
            raise LocalLLMError(
                f"{source}: tensor '{name}' has shape {tuple(t.shape)}, the config implies {tuple(want.shape)}",
                "the checkpoint does not match its config",
            )
        target = dtype if name in params else want.dtype
        state[name] = t.to(device=device, dtype=target)
    if tied:
        if "output.weight" in state:
            # Some tied checkpoints still store lm_head: keep one tensor.
            del state["output.weight"]
        state["output.weight"] = state.get("embed.weight")  # type: ignore[assignment]
    missing = sorted(k for k in expected if state.get(k) is None)
    if missing:
        raise LocalLLMError(
            f"{source}: missing tensor(s) {', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}",
            "the checkpoint is incomplete; download it again",
        )
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.tie_weights()
    return model.eval().requires_grad_(False)


def fuse_projections(model: Transformer) -> Transformer:
    """Merge each block's q/k/v and gate/up projections into one matmul each.

    Fewer, larger matmuls: at batch 1 a decode step is dominated by per-call overhead and by reading
    weights, and a fused call reads the same bytes with a third (or half) of the calls. Done after
    loading (the checkpoint and the artifact keep the separate layers) and before kernels are chosen.
    """
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        if attn.qkv is None:
            attn.qkv = concat_linears([attn.q, attn.k, attn.v])
            del attn.q, attn.k, attn.v
        if mlp.gate_up is None:
            mlp.gate_up = concat_linears([mlp.gate, mlp.up])
            del mlp.gate, mlp.up
    return model
