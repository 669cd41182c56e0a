"""GGUF files (llama.cpp's format), read with the ``gguf`` package."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from localllm.errors import LocalLLMError
from localllm.loaders.checkpoint import float_head_scheme, rename
from localllm.loaders.gguf_meta import read_metadata
from localllm.quant.convert import Plan, quantize_stream
from localllm.quant.formats import QuantScheme, parse_scheme
from localllm.quant.experts import expert_name, split_expert_name
from localllm.quant.formats import GGUF_BLOCKS, gguf_scheme
from localllm.quant.gguf_blocks import EXACT, exact_import, exact_scheme, to_canonical
from localllm.runtime.config import ModelConfig, gguf_keys
from localllm.runtime.config_checks import check_tensors

_LAYER_MAP = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "attn_q.weight": "attn.q.weight",
    "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight",
    "attn_q.bias": "attn.q.bias",
    "attn_k.bias": "attn.k.bias",
    "attn_v.bias": "attn.v.bias",
    "attn_output.weight": "attn.o.weight",
    "ffn_gate.weight": "mlp.gate.weight",
    "ffn_up.weight": "mlp.up.weight",
    "ffn_down.weight": "mlp.down.weight",
    # Qwen3 and Gemma 3: per-head q/k norms (OLMoE's over the whole projection); Gemma 3: norms after
    # attention and after the MLP.
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "post_attention_norm.weight": "post_attn_norm.weight",
    "post_ffw_norm.weight": "post_mlp_norm.weight",
    # A MoE layer (runtime/moe.py): the router, and Qwen2-MoE's shared expert and its sigmoid gate.
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_shexp.weight": "mlp.shared.gate.weight",
    "ffn_up_shexp.weight": "mlp.shared.up.weight",
    "ffn_down_shexp.weight": "mlp.shared.down.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_gate.weight",
    # gpt-oss: attention sinks (H,), the output projection's and the router's biases, and the experts'
    # biases, stacked (E, F) / (E, D) as they are ours.
    "attn_sinks.weight": "attn.sinks",
    "attn_output.bias": "attn.o.bias",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.bias": "mlp.experts.gate_bias",
    "ffn_up_exps.bias": "mlp.experts.up_bias",
    "ffn_down_exps.bias": "mlp.experts.down_bias",
}
#: Per-architecture names (ours, as :attr:`runtime.config.ModelConfig.arch`) over :data:`_LAYER_MAP`:
#: gpt-oss's ``post_attention_norm`` (llama.cpp's ``attn_post_norm``) is the norm before its MLP,
#: where Gemma 3's follows attention.
_ARCH_LAYER_MAPS = {"gpt_oss": {**_LAYER_MAP, "post_attention_norm.weight": "mlp_norm.weight"}}
#: llama.cpp's stacked experts, (E, out, in) with the experts on the slowest axis -> the projection of
#: ``layers.{i}.mlp.experts`` they fill (read one expert at a time: ``layers.{i}.mlp.experts.{e}.gate.weight``).
_EXPERTS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down"}
#: Phi-3's fused tensors (our name of the first part -> every part, in row order): ``attn_qkv`` is
#: q, k, v; its ``ffn_up`` holds gate then up (it has no ``ffn_gate``).
_FUSED = {"attn_qkv.weight": ("attn.q.weight", "attn.k.weight", "attn.v.weight")}
#: Tensors that are no parameters: llama3's and Phi-3's RoPE factors (read into the config).
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
_TOP_MAP = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "output.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def map_gguf_name(name: str, arch: str = "") -> str | None:
    """Our parameter name for a GGUF tensor name of an ``arch`` model (ours: ``gpt_oss``); None for
    ``rope_freqs.weight``, which is no parameter (:class:`GGUFCheckpoint` reads it into the config)."""
    ours = rename(name, _TOP_MAP, _LAYER_RE, _ARCH_LAYER_MAPS.get(arch, _LAYER_MAP))
    if ours is not None:
        return ours
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _FUSED:
        return f"layers.{m.group(1)}.{_FUSED[m.group(2)][0]}"
    if m and m.group(2) in _EXPERTS:
        return f"layers.{m.group(1)}.mlp.experts.{_EXPERTS[m.group(2)]}.weight"
    if name in _ROPE_TENSORS:
        return None
    raise LocalLLMError(f"unexpected tensor '{name}' in the GGUF file",
                        "is this a Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, gpt-oss, "
                        "Gemma 3 or Phi-3 model?")


def module_of(ours: str) -> str:
    """The module a tensor of ours fills: one expert's (``layers.0.mlp.experts.5.gate.weight``) fills
    its stacked projection (``layers.0.mlp.experts.gate``), the plan's name for it."""
    split = split_expert_name(ours)
    return (split[0] if split is not None else ours).rpartition(".")[0]


def _expert_slices(t: gguf.ReaderTensor) -> list[gguf.ReaderTensor]:
    """A stacked (E, out, in) tensor's experts as (out, in) tensors of their own (views of the same
    bytes: each expert's rows are whole rows, so this holds for every type)."""
    n = int(t.data.shape[0])
    nbytes, nel = t.n_bytes // n, t.n_elements // n
    return [t._replace(shape=t.shape[:2].copy(), n_elements=nel, n_bytes=nbytes,
                       data_offset=t.data_offset + nbytes * e, data=t.data[e]) for e in range(n)]


def _as_row(t: gguf.ReaderTensor) -> gguf.ReaderTensor:
    """A (D,) or (1, D) tensor as one row (1, D): Qwen2-MoE's shared-expert gate, ``ffn_gate_inp_shexp``,
    which llama.cpp's converter may write as a vector."""
    shape = t.shape[:1].copy()
    return t._replace(shape=np.append(shape, 1).astype(shape.dtype), data=t.data.reshape(1, -1))


def _row_slices(t: gguf.ReaderTensor, rows: list[int]) -> list[gguf.ReaderTensor]:
    """A tensor's row ranges as tensors of their own (views of the same bytes; rows are whole, so this
    holds for float and block-quantized types alike)."""
    out = []
    start = 0
    row_bytes = t.n_bytes // int(t.data.shape[0])
    per_row = t.n_elements // int(t.data.shape[0])
    for n in rows:
        shape = t.shape.copy()
        shape[-1] = n  # GGUF dims run innermost first: the last is the row count
        out.append(t._replace(shape=shape, n_elements=per_row * n, n_bytes=row_bytes * n,
                              data_offset=t.data_offset + row_bytes * start, data=t.data[start : start + n]))
        start += n
    return out


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs) back to HF's half-split layout.

    The converter maps rows (head, 2, hd/2) -> (head, hd/2, 2); rows are whole, so this works on
    float weights, biases and quantized block rows alike.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _shapes(tensors: list[gguf.ReaderTensor], arch: str) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(our name, the file's name, shape as rows first) of each tensor this runtime reads; Phi-3's
    fused tensors under the fused names the config check knows (``attn.qkv``, ``mlp.gate_up``)."""
    names = {t.name for t in tensors}
    for t in tensors:
        try:
            ours = map_gguf_name(t.name, arch)
        except LocalLLMError:
            continue  # an unknown tensor: the load names it
        if ours is None:
            continue
        m = _LAYER_RE.match(t.name)
        if m is not None and m.group(2) == "attn_qkv.weight":
            ours = f"layers.{m.group(1)}.attn.qkv.weight"
        elif m is not None and m.group(2) == "ffn_up.weight" and f"blk.{m.group(1)}.ffn_gate.weight" not in names:
            ours = f"layers.{m.group(1)}.mlp.gate_up.weight"  # Phi-3: gate then up in one ffn_up
        elif m is not None and m.group(2) in _EXPERTS and len(t.shape) == 3:
            # stacked experts: the last expert's name (the count) and one expert's shape
            yield expert_name(f"layers.{m.group(1)}.mlp.experts", int(t.shape[2]) - 1, _EXPERTS[m.group(2)],
                              "weight"), t.name, (int(t.shape[1]), int(t.shape[0]))
            continue
        elif m is not None and m.group(2) == "ffn_gate_inp_shexp.weight":
            yield ours, t.name, (1, int(t.shape[0]))  # a vector or one row: our (1, D)
            continue
        yield ours, t.name, tuple(int(d) for d in reversed(t.shape))


class FastGGUFReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a plain ndarray view of its memory map.

    The reader takes a small numpy view for every item of the metadata (a 49k-token vocabulary and
    its merges are ~750k views); on ``np.memmap`` each view also runs the subclass's Python hooks,
    which made opening SmolLM2's GGUF take 1.7 s instead of 0.6 s. The memory is the same mapping.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = np.asarray(value)  # drops the memmap subclass; the mapping stays referenced
        self._size = self._data.shape[0]

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        # A file cut in its tensor data: say so with the numbers rather than fail on a short slice.
        need = start_offs
        for f in fields:  # parts: name length, name, n_dims, dims, type, offset
            dims, raw_type, offset = f.parts[3], f.parts[4], f.parts[5]
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
            need = max(need, start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block)
        if need > self._size:
            raise _Truncated(self._size, need)
        super()._build_tensors(start_offs, fields)


class _CheckedGGUFReader(FastGGUFReader):
    """A reader that checks every read against the file's end: run only once the plain reader has
    failed, to tell a file cut inside its header (numpy then fails on a short slice, "When changing
    to a larger dtype, its size must be a divisor...") from a damaged one. (The check costs ~10% of
    opening a file, which the plain reader does not pay.)"""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if offset + np.dtype(dtype).itemsize * int(count) > self._size:
            raise _Truncated(self._size, None)
        return super()._get(offset, dtype, count, override_order)


class _Truncated(Exception):
    """The file ends before what its header declares (``need`` bytes; None: inside the header)."""

    def __init__(self, size: int, need: int | None) -> None:
        super().__init__(size, need)
        self.size, self.need = size, need


def open_reader(path: Path) -> FastGGUFReader:
    """The reader of a GGUF file, or a one-line error: not a GGUF, truncated (with the numbers), damaged."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise LocalLLMError(f"{path.name} is not a GGUF file (bad magic {magic!r})",
                            "give a .gguf file made by llama.cpp's converter (convert_hf_to_gguf.py)")
    try:
        try:
            return FastGGUFReader(str(path))
        except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError) as e:
            failure = e
        _CheckedGGUFReader(str(path))  # raises _Truncated when the header is cut
    except _Truncated as e:
        said = f"header says at least {e.need}" if e.need is not None else "which end inside its header"
        raise LocalLLMError(f"{path.name} is truncated: {e.size} bytes, {said}",
                            "the download or copy stopped early: get the file again") from None
    except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError):
        pass
    raise LocalLLMError(f"cannot read {path.name} as GGUF: {failure}", "the file is damaged: get it again") from failure


#: A GGUF's float tensor types as torch dtypes.
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class GGUFCheckpoint:
    """A ``.gguf`` file: metadata, tokenizer and tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise LocalLLMError(f"GGUF file not found: {path}", "check the path")
        self.reader = open_reader(path)
        self.metadata: dict[str, Any] = read_metadata(self.reader)
        # The reader's own views of the metadata (tens of MB for a large vocabulary): read once above.
        self.reader.fields.clear()
        tensors = {t.name: t for t in self.reader.tensors}
        # Llama 3.x: llama3 rope scaling as per-frequency divisors (the converter writes no metadata for it).
        freqs = tensors.get("rope_freqs.weight")
        factors = None
        if freqs is not None:
            factors = [float(f) for f in gguf.quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1)]
        # Phi-3's longrope: its short and long factors as tensors.
        short, long = tensors.get("rope_factors_short.weight"), tensors.get("rope_factors_long.weight")
        longrope = None
        if short is not None and long is not None:
            longrope = tuple([float(f) for f in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]
                             for t in (short, long))
        self.config = ModelConfig.from_gguf(self.metadata, tie_embeddings="output.weight" not in tensors,
                                            rope_freq_factors=factors, longrope_factors=longrope)  # type: ignore[arg-type]
        # Before anything is built for it: the metadata against the tensors' shapes.
        check_tensors(self.config, _shapes(self.reader.tensors, self.config.arch), "GGUF metadata",
                      gguf_keys(self.metadata))
        # llama.cpp permutes q/k only for its "llama" rope layout (Llama, Mistral, Mixtral); the others are
        # left as is.
        self._permuted = self.config.arch in ("llama", "mistral", "mixtral")
        # llama.cpp's converter stores Gemma's norm weights as 1 + w: ours are w (runtime.model.RMSNorm).
        self._norm_offset = self.config.norm_offset

    def drop_metadata(self) -> None:
        """Forget the metadata once the tokenizer and config are made from it: a vocabulary and its
        merges as Python objects are tens of MB that a load would otherwise hold to its end."""
        self.metadata = {}

    def raw_tensors(self) -> Iterator[tuple[str, gguf.ReaderTensor]]:
        """(our name, reader tensor) pairs, for importers that keep the quantized blocks."""
        c = self.config
        for t in self.reader.tensors:
            ours = map_gguf_name(t.name, c.arch)
            if ours is None:
                continue
            if t.name.endswith(".attn_qkv.weight"):  # Phi-3: q, k, v as row ranges of their own
                layer = ours.rsplit(".", 3)[0]
                parts = _row_slices(t, [c.q_dim, c.kv_dim, c.kv_dim])
                yield from ((f"{layer}.attn.{p}.weight", part) for p, part in zip("qkv", parts))
            elif t.name.endswith(tuple(f".{n}" for n in _EXPERTS)):  # stacked experts: one at a time
                experts, _, leaf = ours.rpartition(".")
                experts, _, proj = experts.rpartition(".")
                yield from ((expert_name(experts, e, proj, leaf), part) for e, part in enumerate(_expert_slices(t)))
            elif t.name.endswith(".ffn_gate_inp_shexp.weight"):
                yield ours, _as_row(t)
            elif ours.endswith("mlp.up.weight") and int(t.data.shape[0]) == 2 * c.intermediate_size:
                layer = ours.rsplit(".", 3)[0]  # Phi-3: gate then up in one ffn_up
                gate, up = _row_slices(t, [c.intermediate_size] * 2)
                yield f"{layer}.mlp.gate.weight", gate
                yield ours, up
            else:
                yield ours, t

    def fix_rows(self, ours: str, rows: np.ndarray) -> np.ndarray:
        """Undo the converter's changes: its q/k permutation on an array whose first axis is output
        rows, and Gemma's ``1 + w`` norm weights."""
        if self._norm_offset and ours.endswith("norm.weight"):
            return rows - np.float32(self._norm_offset)
        if not self._permuted:
            return rows
        if ours.endswith(("attn.q.weight", "attn.q.bias")):
            return unpermute_rows(rows, self.config.n_heads)
        if ours.endswith(("attn.k.weight", "attn.k.bias")):
            return unpermute_rows(rows, self.config.n_kv_heads)  # type: ignore[arg-type]
        return rows

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, float32 tensor) pairs, dequantized one at a time (a slice of rows at a time) from
        bytes read into a buffer of their own: the memory map's pages would stay resident."""
        from localllm.loaders.safetensors_stream import read_array
        from localllm.quant.gguf_blocks import dequantize

        with self.path.open("rb", buffering=0) as f:
            for ours, t in self.raw_tensors():
                raw = read_array(f, t.data_offset, t.data.shape, t.data.dtype, t.name)
                w = self.fix_rows(ours, dequantize(raw, t.tensor_type))  # (out, in) float32, its own buffer
                del raw
                yield ours, torch.from_numpy(np.ascontiguousarray(w))
                del w

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The float dtype the file holds the tensor ``name`` (ours) in; None for a block type or a
        tensor it does not have."""
        kind = next((t.tensor_type.name for ours, t in self.raw_tensors() if ours == name), None)
        return _FLOAT_TYPES.get(kind) if kind is not None else None

    def default_scheme(self) -> QuantScheme | None:
        """The scheme that holds this file's most common block type as it is: int4 group 32 for Q4_0/Q4_1
        files, int8 group 32 for Q8_0 ones, the file's own blocks (the ``gguf`` scheme) for the other
        quantized types (Q5_0, K-quants, IQ4_NL...), and None (float) for F16/BF16/F32 files and types
        localllm cannot keep, which are dequantized rather than put on a coarser grid. A MoE file whose
        most common type is a float one but whose experts are blocks (gpt-oss's MXFP4 experts beside
        16-bit attention, as its converter writes them) takes the experts' type: they are nearly all its
        weights, and float would dequantize them.
        :meth:`exact_plan` keeps each module's own tensor type exact in a mixed file."""
        blk = [t for t in self.reader.tensors if t.name.startswith("blk.") and t.name.endswith("weight")]
        types = Counter(t.tensor_type.name for t in blk if len(t.shape) in (2, 3))  # 3: a MoE's stacked experts
        main = types.most_common(1)[0][0] if types else "F32"
        floats = ("F32", "F16", "BF16")
        experts = Counter(t.tensor_type.name for t in blk if len(t.shape) == 3).most_common(1)
        if main in floats and experts and experts[0][0] not in floats:
            main = experts[0][0]
        if main == "Q8_0":
            return parse_scheme("int8", 32)
        if main in ("Q4_0", "Q4_1"):
            return parse_scheme("int4", 32, symmetric=main == "Q4_0")
        if main in GGUF_BLOCKS and main not in ("F32", "F16", "BF16"):
            return gguf_scheme(main)
        return None

    def exact_plan(self, plan: Plan) -> Plan:
        """``plan`` (module -> scheme, the file's own) with each module in the scheme its own tensor
        imports into exactly (:func:`quant.gguf_blocks.exact_scheme`: a Q8_0 tensor in a Q4_1 file int8,
        a Q6_K one in its blocks, an F16 one in a quantized file its F16 rows); a type localllm cannot
        keep is left out (float, dequantized), never re-rounded onto another grid. (A scheme the user
        names with ``--quant`` re-quantizes every module: that is asked for, not silent.)"""
        types = {module_of(ours): t.tensor_type.name for ours, t in self.raw_tensors() if ours.endswith(".weight")}
        if self.config.tie_embeddings:
            types.setdefault("output", types.get("embed", ""))
        exact: Plan = {}
        for m, scheme in plan.items():
            kind = types.get(m, "")
            if exact_import(kind, scheme):
                exact[m] = scheme
            elif (own := exact_scheme(kind)) is not None:  # blocks of another type: their own scheme
                exact[m] = own
        return exact

    def tensor_import(self, plan: Plan, float_dtype: str, held: dict[str, str] | None = None) -> dict[str, str]:
        """What each tensor type of the file became under ``plan``, for ``--verbose`` and ``show``:
        ``{"Q4_1": "210 tensors -> int4 (group 32, asymmetric), exact", "F32": "61 tensors -> fp32", ...}``.
        ``float_dtype`` names what unplanned tensors are converted to; ``held``, the dtype of those held
        apart from the activations (an embedding table: ``{"embed.weight": "bf16"}``)."""
        from localllm.quant.linear import head_serves_embedding

        dtype = float_dtype
        became: Counter[tuple[str, str]] = Counter()
        for ours, t in self.raw_tensors():
            kind = t.tensor_type.name
            module = module_of(ours)
            float_dtype = (held or {}).get(ours, dtype)
            if ours == "embed.weight" and self.config.tie_embeddings and head_serves_embedding(plan.get("output")):
                module = "output"  # the head's table (int8, or its blocks) serves as the embedding
            scheme = plan.get(module) if ours.endswith(".weight") else None
            if scheme is not None:
                how = "exact" if exact_import(kind, scheme) else "re-quantized from the dequantized values"
                became[(kind, f"{scheme.label()}, {how}")] += 1
            elif kind in ("F32", "F16", "BF16"):
                became[(kind, float_dtype)] += 1
            elif kind in EXACT:
                became[(kind, f"{float_dtype}, dequantized")] += 1
            elif kind in GGUF_BLOCKS:
                became[(kind, f"{float_dtype}, dequantized")] += 1
            else:
                became[(kind, f"{float_dtype}, dequantized (no exact import of {kind} yet)")] += 1
        out: dict[str, str] = {}
        for (kind, result), n in sorted(became.items()):
            entry = f"{n} tensor{'s' if n > 1 else ''} -> {result}"
            out[kind] = f"{out[kind]}; {entry}" if kind in out else entry
        return out

    def default_head(self, scheme: QuantScheme | None) -> QuantScheme | None:
        """A Q8_0 head (or tied embedding) loads as it is in the file, int8 with groups of 32, on every
        device (re-rounding it per channel doubled SmolLM2's KLD; a 16-bit copy would round q * d).
        A head of another quantized type (a Q4_K_M file's Q6_K ``output.weight``, or its tied Q6_K
        ``token_embd``) keeps its blocks; tied, the blocks serve as the embedding too
        (:class:`quant.linear.TiedHeadEmbedding`), so the table is held once, at the file's bytes.
        A float head re-quantized with the rest becomes int8 as a float checkpoint's does
        (:func:`loaders.checkpoint.float_head_scheme`); the file's own mix keeps it as stored."""
        if scheme is None:
            return None
        names = {ours: t for ours, t in self.raw_tensors() if ours in ("output.weight", "embed.weight")}
        head = names.get("output.weight", names.get("embed.weight") if self.config.tie_embeddings else None)
        if head is None:
            return None
        kind = head.tensor_type.name
        if kind == "Q8_0":
            return parse_scheme("int8", 32) if self.config.dim % 32 == 0 else None
        if kind in GGUF_BLOCKS and kind not in ("F32", "F16", "BF16"):
            return gguf_scheme(kind)
        return float_head_scheme(self.config, scheme)

    def iter_canonical(self, plan: Plan, tied_head: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors for a model whose modules hold the schemes of ``plan``: Q4_0/Q4_1/Q8_0 blocks that
        fit their module's grid are imported exactly; every other tensor is dequantized (and quantized
        by :func:`quant.convert.quantize_stream` when its module is in ``plan``).

        ``tied_head``: the quantized head is made from the embedding's tensor, exactly when its blocks
        fit the head's grid (a Q8_0 table as an int8 group-32 head); an int8 or block head also serves as the
        embedding, which then is not dequantized at all. Bytes are read into buffers of their own, one
        tensor at a time: the memory map's pages would stay resident while the file is open."""
        from localllm.loaders.safetensors_stream import read_array
        from localllm.quant.gguf_blocks import dequantize
        from localllm.quant.linear import head_serves_embedding

        head = plan.get("output") if tied_head else None
        exact: list[tuple[str, str, gguf.ReaderTensor]] = []  # (module it fills, our name, tensor)
        for ours, t in self.raw_tensors():
            module = module_of(ours)
            if module in plan and ours.endswith(".weight") and exact_import(t.tensor_type.name, plan[module]):
                exact.append((module, ours, t))
            elif head is not None and ours == "embed.weight" and exact_import(t.tensor_type.name, head):
                exact.append(("output", ours, t))
        head_exact = any(module == "output" and ours == "embed.weight" for module, ours, _ in exact)
        skip = {ours for _, ours, _ in exact if ours != "embed.weight" or head_serves_embedding(head)}

        with self.path.open("rb", buffering=0) as f:

            def floats() -> Iterator[tuple[str, torch.Tensor]]:
                for ours, t in self.raw_tensors():
                    if ours not in skip:
                        raw = read_array(f, t.data_offset, t.data.shape, t.data.dtype, t.name)
                        w = self.fix_rows(ours, dequantize(raw, t.tensor_type))
                        del raw
                        yield ours, torch.from_numpy(np.ascontiguousarray(w))
                        del w

            for module, ours, t in exact:
                raw = read_array(f, t.data_offset, t.data.shape, t.data.dtype, t.name)
                canonical = to_canonical(t.tensor_type.name, raw, plan[module])
                del raw
                # one expert's tensors are named for its slice of the stack (layers.0.mlp.experts.5.gate.blocks)
                prefix = ours.rpartition(".")[0] if split_expert_name(ours) is not None else module
                while canonical:
                    k, v = canonical.popitem()
                    yield f"{prefix}.{k}", torch.from_numpy(np.ascontiguousarray(self.fix_rows(ours, v.numpy())))
                    del v
            yield from quantize_stream(floats(), plan, tied_head and not head_exact)

    def describe(self) -> str:
        return str(self.path)
