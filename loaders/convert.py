"""Convert a checkpoint (HF folder, GGUF file, stored model) into a store entry in a given scheme."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from localllm.loaders.artifact import quant_manifest, write_artifact
from localllm.loaders.calibrate import DEFAULT_CALIBRATION, Calibration, resolve_calibration
from localllm.loaders.load import Checkpoint, load_tokenizer, model_tensors
from localllm.loaders.store import Store, StoredModel
from localllm.quant.experts import split_expert_name
from localllm.quant.formats import FLOAT_SCHEMES, QuantScheme
from localllm.runtime.model import Transformer


def storage_layout(model: Transformer, float_dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor an artifact of ``model`` (built on meta) holds.

    Parameters (embedding, norms, float linears, biases) are stored in ``float_dtype``; quantized
    modules' buffers in their format's dtypes. A tied head is stored once: as the embedding when it is
    float, as the head when it is int8 (which then serves as the embedding: no 16-bit table).
    """
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    layout = {n: (tuple(t.shape), float_dtype if n in params else t.dtype) for n, t in model.state_dict().items()}
    if model.config.tie_embeddings and isinstance(model.output, torch.nn.Linear):
        del layout["output.weight"]
    return layout


def _skip_tied_head(tensors: Iterator[tuple[str, torch.Tensor]], layout: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors:
        expert = split_expert_name(name)  # one expert of a stacked tensor: written into its slice
        if name in layout or (expert is not None and expert[0] in layout):
            yield name, t


def convert_to_store(
    ckpt: Checkpoint,
    scheme: QuantScheme,
    name: str,
    store: Store,
    source: dict[str, Any],
    quantize_head: str | bool | None = None,
    calibration: str = DEFAULT_CALIBRATION,
) -> tuple[StoredModel, float]:
    """Write ``ckpt`` in ``scheme`` as store entry ``name:scheme``; returns it and the seconds taken.

    Tensors stream from the checkpoint one at a time through quantization into the output, so
    memory stays near the output's size plus the largest tensor. The entry appears atomically
    (nothing is left behind if this fails or is interrupted). ``calibration``: int4 from float weights
    is data-aware (``awq``, :mod:`loaders.calibrate`; the manifest records it) or rounded to nearest
    (``none``).
    """
    t0 = time.perf_counter()
    cal = Calibration(resolve_calibration(calibration, ckpt.config))
    model, tensors, plan = model_tensors(ckpt, None if scheme.is_float else scheme, quantize_head, cal)
    # Unquantized parameters of a quantized model are stored in bf16, the dtype quantized models run
    # in: loading then rounds nothing (fp16 storage would round twice on the way to bf16).
    layout = storage_layout(model, FLOAT_SCHEMES.get(scheme.name, torch.bfloat16))
    manifest = {
        "source": source,
        "config": ckpt.config.to_dict(),
        "quant": quant_manifest(None if scheme.is_float else scheme, plan),
        "dtype": scheme.name if scheme.is_float else None,
    }
    with store.write(name, scheme.name, manifest) as tmp:
        write_artifact(tmp, layout, _skip_tied_head(tensors, layout), load_tokenizer(ckpt))
        if cal.ran:
            manifest["calibration"] = cal.to_manifest()  # the manifest is written on the block's exit
    entry = store.get(name, scheme.name)
    assert entry is not None  # just published under the lock
    return entry, time.perf_counter() - t0
