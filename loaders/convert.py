"""Convert a checkpoint (HF folder, GGUF file, stored model) into a store entry in a given scheme."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from loaders.artifact import quant_manifest, write_artifact
from loaders.load import Checkpoint, load_tokenizer, model_tensors
from loaders.store import Store, StoredModel
from quant.formats import FLOAT_SCHEMES, QuantScheme


def _storage_dtypes(tensors: Iterator[tuple[str, torch.Tensor]], quantized: set[str], float_dtype: torch.dtype | None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Float parameters in the dtype they are stored in: the scheme's for float schemes; for quantized
    schemes the unquantized ones (embedding, norms, head) in 16-bit, bf16 kept as bf16."""
    for name, t in tensors:
        module = name.rpartition(".")[0]
        if module in quantized and not name.endswith(".bias"):
            yield name, t  # canonical tensors: dtypes fixed by the format
        elif float_dtype is not None:
            yield name, t.to(float_dtype)
        elif t.dtype in (torch.float32, torch.float64):
            yield name, t.to(torch.float16)
        else:
            yield name, t


def convert_to_store(
    ckpt: Checkpoint,
    scheme: QuantScheme,
    name: str,
    store: Store,
    source: dict[str, Any],
    quantize_head: bool = False,
) -> tuple[StoredModel, float]:
    """Write ``ckpt`` in ``scheme`` as store entry ``name:scheme``; returns it and the seconds taken.

    Tensors stream from the checkpoint one at a time through quantization into the output, so
    memory stays near the output's size plus the largest tensor. The entry appears atomically
    (nothing is left behind if this fails or is interrupted).
    """
    t0 = time.perf_counter()
    _, tensors, quantized = model_tensors(ckpt, None if scheme.is_float else scheme, quantize_head)
    float_dtype = FLOAT_SCHEMES.get(scheme.name)
    manifest = {
        "source": source,
        "config": ckpt.config.to_dict(),
        "quant": quant_manifest(None if scheme.is_float else scheme, quantized),
        "dtype": scheme.name if scheme.is_float else None,
    }
    with store.write(name, scheme.name, manifest) as tmp:
        write_artifact(tmp, _storage_dtypes(tensors, quantized, float_dtype), load_tokenizer(ckpt), ckpt.config)
    entry = store.get(name, scheme.name)
    assert entry is not None  # just published under the lock
    return entry, time.perf_counter() - t0
