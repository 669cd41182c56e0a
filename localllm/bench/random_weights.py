"""Models of a given shape with random weights, made directly on the device (scripts/bench_gpu.py:
the bench's figures for a model too big to download or convert first)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from localllm.bench.meters import sync


def random_model(config: Any, scheme_name: str, device: torch.device, source: str, seed: int = 0,
                 std: float = 0.02) -> Any:
    """A model of ``config``'s shape with random weights, made on ``device`` and quantized there.

    Built on meta; each tensor is created on the device and quantized one at a time, so neither a
    download nor a CPU copy nor the full float model is ever needed (a 7B fp16 model fits a 16 GB GPU
    this way; peak is the packed model plus one float layer).
    """
    from localllm.loaders.build import empty_model, load_weights
    from localllm.loaders.load import LoadedModel, resolve_dtype
    from localllm.quant.formats import FLOAT_SCHEMES, parse_scheme
    from localllm.quant.linear import prepare_model, swap_linears

    t0 = time.perf_counter()
    scheme = parse_scheme(scheme_name)
    act = FLOAT_SCHEMES[scheme.name] if scheme.is_float else resolve_dtype("auto", device)
    model = empty_model(config)
    quantized = set() if scheme.is_float else set(swap_linears(model, scheme))
    tensors = _random_tensors(model, quantized, scheme, device, act, seed, std)
    model = load_weights(model, tensors, device, act, source)
    used = prepare_model(model, act)
    sync(device)
    return LoadedModel(model, None, config, source, device, act, time.perf_counter() - t0,  # type: ignore[arg-type]
                       None if scheme.is_float else scheme, used)


def _random_tensors(model: torch.nn.Module, quantized: set[str], scheme: Any, device: torch.device,
                    dtype: torch.dtype, seed: int, std: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every entry of ``model``'s state dict, one tensor alive at a time."""
    from localllm.quant.formats import quantize

    g = torch.Generator(device=device).manual_seed(seed)
    done: set[str] = set()
    for name, meta in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in quantized:
            if module not in done:
                lin = model.get_submodule(module)
                w = torch.randn(lin.out_features, lin.in_features, generator=g, device=device, dtype=dtype) * std
                tensors = quantize(w, scheme)
                del w
                yield from ((f"{module}.{k}", v) for k, v in tensors.items())
                if lin.bias is not None:
                    yield f"{module}.bias", torch.zeros(lin.out_features, device=device, dtype=dtype)
                done.add(module)
            continue
        if leaf == "weight" and name.endswith("norm.weight"):
            yield name, torch.ones(meta.shape, device=device, dtype=dtype)
        elif leaf == "bias":
            yield name, torch.zeros(meta.shape, device=device, dtype=dtype)
        else:
            yield name, torch.randn(meta.shape, generator=g, device=device, dtype=dtype) * std
