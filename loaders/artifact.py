"""localllm's own artifact: a store entry holding a converted (usually quantized) model.

    models/<name>/<scheme>/
        manifest.json         written by loaders.store (sizes, sha256, source, config, quant)
        model.safetensors     our parameter names; quantized modules as canonical tensors
        tokenizer.json, tokenizer_config.json

The manifest says what the tensors are (``quant``: scheme and the list of quantized modules): a
loader never guesses a format from a file name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from localllm.errors import LocalLLMError
from localllm.loaders import store as store_mod
from localllm.loaders.safetensors_stream import iter_safetensors, read_header, tensor_dtypes, write_safetensors
from localllm.quant.convert import Plan, quantize_stream
from localllm.quant.experts import expert_name, stacked_experts
from localllm.quant.formats import QuantScheme, dequantize, dequantize_weight
from localllm.runtime.config import ModelConfig
from localllm.runtime.tokenizer import Tokenizer

WEIGHTS = "model.safetensors"
_VERIFIED = ".verified.json"  # sizes and mtimes of files whose sha256 was checked


def quant_manifest(scheme: QuantScheme | None, plan: Plan) -> dict[str, Any]:
    """The manifest's ``quant`` entry: the main scheme, the quantized modules, and the modules whose
    scheme differs from the main one (the output head, when it is quantized differently)."""
    return {
        "scheme": scheme.to_dict() if scheme else None,
        "modules": sorted(plan),
        "overrides": {m: s.to_dict() for m, s in sorted(plan.items()) if s != scheme},
    }


def plan_from_manifest(q: dict[str, Any]) -> Plan:
    main = QuantScheme.from_dict(q["scheme"]) if q["scheme"] else None
    overrides = {m: QuantScheme.from_dict(d) for m, d in q.get("overrides", {}).items()}
    return {m: overrides.get(m, main) for m in q["modules"]}  # type: ignore[misc]


def write_artifact(folder: Path, layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                   tensors: Iterable[tuple[str, torch.Tensor]], tokenizer: Tokenizer) -> None:
    """Write the weights (streamed one tensor at a time into ``layout``) and the tokenizer into
    ``folder`` (a store's temporary folder)."""
    write_safetensors(folder / WEIGHTS, layout, tensors, metadata={"format": "pt", "producer": "localllm"})
    tokenizer.save(folder)


class ArtifactCheckpoint:
    """A stored model: config and quant format from its manifest, tensors from model.safetensors."""

    def __init__(self, stored: store_mod.StoredModel) -> None:
        self.stored = stored
        self.folder = stored.path
        m = stored.manifest
        version = m.get("format_version")
        if not isinstance(version, int) or version > store_mod.FORMAT_VERSION:
            raise LocalLLMError(
                f"model '{stored.ref}' was stored in format {version}, newer than this localllm reads "
                f"(up to {store_mod.FORMAT_VERSION})",
                "upgrade localllm, or pull the model again with this one",
            )
        try:
            self.config = ModelConfig.from_dict(m["config"])
            q = m["quant"]
            self.scheme = QuantScheme.from_dict(q["scheme"]) if q["scheme"] else None
            self.plan = plan_from_manifest(q)
        except (KeyError, TypeError) as e:
            raise LocalLLMError(
                f"model '{stored.ref}' has an incomplete manifest (no {e})",
                f"run `localllm rm {stored.ref}` and pull it again",
            ) from e
        _verify_once(stored)

    def default_scheme(self) -> QuantScheme | None:
        if self.scheme is None and self.stored.manifest.get("dtype"):
            from localllm.quant.formats import parse_scheme

            return parse_scheme(self.stored.manifest["dtype"])  # a float entry: its stored dtype
        return self.scheme

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The dtype the entry holds the float tensor ``name`` in (None: quantized, or not stored)."""
        dtype = tensor_dtypes(self.folder / WEIGHTS).get(name)
        return dtype if dtype is not None and dtype.is_floating_point else None

    def _raw(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_safetensors(self.folder / WEIGHTS)

    @property
    def stores_embedding(self) -> bool:
        """Whether the weights hold an ``embed.weight`` of their own: not where a tied int8 or GGUF-block
        head serves as the embedding (older artifacts kept both)."""
        header, _ = read_header(self.folder / WEIGHTS)
        return "embed.weight" in header

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Float tensors (quantized modules dequantized one at a time), for a conversion to another scheme.

        A tied model stored with an int8 or GGUF-block head has no 16-bit embedding (the head serves as it): its
        ``embed.weight`` is the dequantized head, the same tensor."""
        embed_from_head = self.config.tie_embeddings and "output" in self.plan and not self.stores_embedding
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in self._raw():
            module, _, leaf = key.rpartition(".")
            if module not in self.plan or leaf == "bias":
                yield key, t
                continue
            scheme = self.plan[module]
            parts = pending.setdefault(module, {})
            parts[leaf] = t
            if len(parts) == len(_canonical_names(scheme)):
                stacked = stacked_experts(module)
                if stacked is not None:  # a MoE layer's experts: each one's weight, one at a time
                    done = pending.pop(module)
                    for e in range(next(iter(done.values())).shape[0]):
                        w = dequantize({k: v[e] for k, v in done.items()}, scheme)
                        yield expert_name(stacked[0], e, stacked[1], "weight"), w
                    continue
                w = dequantize_weight(pending.pop(module), scheme)  # an act-order layer's columns put back
                yield f"{module}.weight", w
                if module == "output" and embed_from_head:
                    yield "embed.weight", w

    def default_head(self, scheme: QuantScheme | None) -> QuantScheme | None:
        """The head as stored, when the blocks are loaded in the stored scheme."""
        return self.plan.get("output") if scheme == self.scheme else None

    def exact_plan(self, plan: Plan) -> Plan:
        """In the stored scheme, each module as stored: quantized in its own scheme (a mixed GGUF's
        Q6_K or int8 tensors beside its Q4_K ones: the manifest's overrides), float where stored float."""
        return {m: self.plan[m] for m in plan if m in self.plan}

    def iter_canonical(self, plan: Plan, tied_head: bool) -> Iterator[tuple[str, torch.Tensor]]:
        if plan == self.plan:
            return self._raw()  # stored as asked: no re-quantization
        return quantize_stream(self.iter_tensors(), plan, tied_head)

    def describe(self) -> str:
        return self.stored.ref


def _canonical_names(scheme: QuantScheme) -> tuple[str, ...]:
    from localllm.quant.formats import canonical_shapes

    return tuple(canonical_shapes(scheme, 2, 64))


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _verify_once(stored: store_mod.StoredModel) -> None:
    """Check every file against the manifest's sha256 the first time an entry is loaded; later loads
    only compare sizes and modification times with what was verified (hashing gigabytes on every
    start would cost seconds)."""
    stamp = stored.path / _VERIFIED
    files = stored.manifest["files"]
    try:
        current = {rel: _stat_key(stored.path / rel) for rel in files}
    except OSError:
        current = None
    try:
        if current is not None and json.loads(stamp.read_text()) == current:
            return
    except (OSError, json.JSONDecodeError):
        pass
    store_mod.verify(stored)  # raises a LocalLLMError naming the bad file and the fix
    try:
        tmp = stamp.with_suffix(".tmp")
        tmp.write_text(json.dumps(current))
        os.replace(tmp, stamp)
    except OSError:
        pass  # a read-only store still loads; it just hashes again next time
