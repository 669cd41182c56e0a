"""Convert a checkpoint (HF folder, GGUF file, stored model) into a store entry in a given scheme."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from localllm.loaders.artifact import quant_manifest, write_artifact
from localllm.loaders.calibrate import DEFAULT_CALIBRATION, Calibration, resolve_calibration
from localllm.loaders.load import Checkpoint, load_tokenizer, model_tensors, table_dtypes
from localllm.loaders.store import Store, StoredModel
from localllm.quant.experts import split_expert_name
from localllm.quant.formats import FLOAT_SCHEMES, QuantScheme
from localllm.runtime.model import Transformer


def entry_scheme(scheme: QuantScheme) -> str:
    """The store tag of an entry in ``scheme`` (``NAME:TAG``): the scheme's name, but for the ``gguf``
    scheme its block type in lower case (``q4_k``, ``q6_k``, ``mxfp4``), so that a model's Q4_K_M and
    Q6_K files are two entries, each named for what it holds. Loading reads the manifest, never the tag."""
    return scheme.gguf_type.lower() if scheme.name == "gguf" and scheme.gguf_type else scheme.name


def storage_layout(model: Transformer, float_dtype: torch.dtype, dtypes: dict[str, torch.dtype] | None = None
                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor an artifact of ``model`` (built on meta) holds.

    Parameters (embedding, norms, float linears, biases) are stored in ``float_dtype``, or in the dtype
    ``dtypes`` names for them; quantized modules' buffers in their format's dtypes. A tied head is
    stored once: as the embedding when it is float, as the head when it is int8 (which then serves as
    the embedding: no 16-bit table).
    """
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    dtypes = dtypes or {}
    layout = {n: (tuple(t.shape), dtypes.get(n, float_dtype) if n in params else t.dtype)
              for n, t in model.state_dict().items()}
    if model.config.tie_embeddings and isinstance(model.output, torch.nn.Linear):
        del layout["output.weight"]
    return layout


def _skip_tied_head(tensors: Iterator[tuple[str, torch.Tensor]], layout: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors:
        expert = split_expert_name(name)  # one expert of a stacked tensor: written into its slice
        if name in layout or (expert is not None and expert[0] in layout):
            yield name, t


def float_storage_dtypes(ckpt: Checkpoint, scheme: QuantScheme, model: Transformer) -> dict[str, torch.dtype]:
    """The dtypes that store a quantized model's float parameters as a CPU load of ``ckpt`` holds them,
    so that a pulled model is the model ``run`` loads from its source: its float tables (an untied
    embedding, a float head, other float linears) in their 16-bit dtype (:func:`loaders.load.table_dtypes`),
    the small ones (norms, biases, routers, attention sinks) in fp32, which holds any float source's
    values exactly (and a GGUF's Gemma norms less their offset). Empty for a float scheme: its
    parameters are stored in the scheme's dtype."""
    if scheme.is_float:
        return {}
    tables = table_dtypes(model, ckpt)
    return {name: tables.get(name, torch.float32) for name, _ in model.named_parameters(remove_duplicate=False)}


def convert_to_store(
    ckpt: Checkpoint,
    scheme: QuantScheme,
    name: str,
    store: Store,
    source: dict[str, Any],
    quantize_head: str | bool | None = None,
    calibration: str = DEFAULT_CALIBRATION,
) -> tuple[StoredModel, float]:
    """Write ``ckpt`` in ``scheme`` as store entry ``name:TAG`` (:func:`entry_scheme`); returns it and
    the seconds taken.

    Tensors stream from the checkpoint one at a time through quantization into the output, so
    memory stays near the output's size plus the largest tensor. The entry appears atomically
    (nothing is left behind if this fails or is interrupted). ``calibration``: int4 from float weights
    is data-aware (``awq``, :mod:`loaders.calibrate`; the manifest records it) or rounded to nearest
    (``none``).
    """
    t0 = time.perf_counter()
    cal = Calibration(resolve_calibration(calibration, ckpt.config))
    model, tensors, plan = model_tensors(ckpt, None if scheme.is_float else scheme, quantize_head, cal)
    # A quantized model's unquantized parameters as a load of the source holds them
    # (:func:`float_storage_dtypes`); a float scheme's in its dtype.
    layout = storage_layout(model, FLOAT_SCHEMES.get(scheme.name, torch.bfloat16),
                            float_storage_dtypes(ckpt, scheme, model))
    manifest = {
        "source": source,
        "config": ckpt.config.to_dict(),
        "quant": quant_manifest(None if scheme.is_float else scheme, plan),
        "dtype": scheme.name if scheme.is_float else None,
    }
    tag = entry_scheme(scheme)
    with store.write(name, tag, manifest) as tmp:
        write_artifact(tmp, layout, _skip_tied_head(tensors, layout), load_tokenizer(ckpt))
        if cal.ran:
            manifest["calibration"] = cal.to_manifest()  # the manifest is written on the block's exit
    entry = store.get(name, tag)
    assert entry is not None  # just published under the lock
    return entry, time.perf_counter() - t0
