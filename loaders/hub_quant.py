"""Checkpoints quantized on the Hub: which format ``quantization_config`` in ``config.json`` names (never
a file name), and each quantized linear's packed tensors as localllm's canonical ones, exactly.

Read: GPTQ (``quant_method: gptq``: 4 and 8 bits, any group or per channel, symmetric or not,
``desc_act`` with ``g_idx``, ``checkpoint_format`` gptq (v1: stored zeros are z - 1) or gptq_v2), AWQ
(``quant_method: awq``, ``version: gemm``), compressed-tensors (``pack-quantized`` and
``naive-quantized`` int4 / int8 weights, group, channel or tensor scales, with or without zero points)
and bitsandbytes' serialized 4-bit NormalFloat (``load_in_4bit``, nf4, its absmax double-quantized or not:
onto the ``nf4`` scheme, whose kernel is bitsandbytes' own) and FP8 (``quant_method: fp8``, e4m3 with
128x128-block, per-channel or per-tensor ``weight_scale_inv``: onto the ``fp8`` scheme, its values and
scales as they are, multiplied by the reference kernel one slice of a layer at a time) and MXFP4
(``quant_method: mxfp4``, gpt-oss's experts: repacked exactly into GGUF's MXFP4 blocks, the ``gguf``
scheme's, by :class:`MXFP4Checkpoint`).
The grid each lands on is :mod:`quant.hub_formats`' (int4, int8, or int4 / int8 with integer zero
points). Refused, with one line naming the format and what to pull instead: EXL2, EXL3, HQQ,
bitsandbytes fp4 and 8-bit, FP8 with static activation scales, activation-quantized or sparse compressed-tensors, other GPTQ / AWQ packings, and
any format this module does not know.

Which linears are quantized is read from the tensors themselves (a module with a ``qweight`` or
``weight_packed``, or compressed-tensors' ``weight_scale``); the others are float and load as such.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from localllm.errors import LocalLLMError
from localllm.loaders.checkpoint import FUSED, HFCheckpoint, float_head_scheme, map_hf_name, split_fused
from localllm.loaders.safetensors_stream import iter_safetensors, read_header
from localllm.quant.convert import Plan, quantize_stream
from localllm.quant.formats import QuantScheme, dequantize_weight, fp8_scheme, gguf_scheme, parse_scheme
from localllm.quant import hub_formats

#: quant_method values localllm refuses, as their users know them.
REFUSED = {"exl2": "EXL2", "exl3": "EXL3", "hqq": "HQQ",
           "fbgemm_fp8": "FP8 (fbgemm)", "aqlm": "AQLM", "quanto": "quanto", "eetq": "EETQ",
           "higgs": "HIGGS", "vptq": "VPTQ", "torchao": "torchao", "spqr": "SpQR",
           "bitnet": "BitNet", "gptqmodel": "GPTQModel"}
#: The tensors of one quantized linear, by format (the first names the module as quantized).
LEAVES = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
          "pack-quantized": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"),
          "naive-quantized": ("weight_scale", "weight", "weight_zero_point", "weight_g_idx"),
          "fp8": ("weight_scale_inv", "weight"),
          "bitsandbytes": ("weight.quant_state.bitsandbytes__nf4", "weight", "weight.absmax", "weight.quant_map",
                           "weight.nested_absmax", "weight.nested_quant_map")}
#: bitsandbytes' serialized quant state of a 4-bit type other than NormalFloat.
_BNB_OTHER_STATE = "weight.quant_state.bitsandbytes__fp4"


def _instead(hf_config: dict[str, Any]) -> str:
    base = hf_config.get("_name_or_path") or ""
    named = f" ({base} is named as its source)" if base and "/" in str(base) else ""
    return f"pull the model's float repo{named} or a GGUF file of it"


def refuse(what: str, hf_config: dict[str, Any]) -> LocalLLMError:
    return LocalLLMError(f"this checkpoint holds {what} weights, which localllm does not read", _instead(hf_config))


@dataclass(frozen=True)
class HubQuant:
    """A Hub quantization format as ``quantization_config`` describes it."""

    method: str  # "gptq", "awq", "compressed-tensors"
    bits: int
    group: int | None  # None: one scale per output channel (or per tensor)
    symmetric: bool
    act_order: bool
    #: gptq: "gptq" (v1 zeros, z - 1 stored) or "gptq_v2"; awq: "gemm"; compressed-tensors: its format
    variant: str
    strategy: str = "group"  # compressed-tensors: group, channel or tensor
    double_quant: bool = False  # bitsandbytes: the config asks for double-quantized absmax
    block_rows: int | None = None  # fp8: the output rows of a scale block (weight_block_size[0])

    @property
    def leaves(self) -> tuple[str, ...]:
        return LEAVES[self.method if self.method != "compressed-tensors" else self.variant]

    def split(self, key: str) -> tuple[str, str]:
        """A tensor's name -> (its module, its leaf): bitsandbytes' quant state hangs off the weight
        (``q_proj.weight.absmax``), every other format's tensors off the module (``q_proj.qweight``)."""
        if self.method == "bitsandbytes" and ".weight." in key:
            module, _, rest = key.partition(".weight.")
            return module, f"weight.{rest}"
        module, _, leaf = key.rpartition(".")
        return module, leaf

    def label(self) -> str:
        """``GPTQ 4-bit, group 128, symmetric, act order (v1 zeros)``."""
        if self.method == "fp8":
            return f"FP8 e4m3, {f'{self.block_rows}x{self.group} blocks' if self.group else 'per tensor or channel'}"
        if self.method == "mxfp4":
            return "MXFP4 experts (E2M1 in blocks of 32, E8M0 scales)"
        if self.method == "bitsandbytes":
            return f"bitsandbytes 4-bit NormalFloat{', double-quantized absmax' if self.double_quant else ''}"
        name = {"gptq": "GPTQ", "awq": "AWQ", "compressed-tensors": "compressed-tensors"}[self.method]
        group = f"group {self.group}" if self.group else f"per {'tensor' if self.strategy == 'tensor' else 'channel'}"
        parts = [f"{name} {self.bits}-bit", group, "symmetric" if self.symmetric else "zero points"]
        if self.act_order:
            parts.append("act order")
        extra = {"gptq": " (v1 zeros)", "gptq_v2": " (v2 zeros)", "gemm": " (GEMM)"}.get(self.variant, f" ({self.variant})")
        return ", ".join(parts) + extra

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "label": self.label()}

    def scheme(self, in_features: int) -> QuantScheme:
        """The localllm scheme a linear of ``in_features`` inputs lands on exactly."""
        if self.method == "fp8":
            return fp8_scheme(self.group)
        if self.method == "mxfp4":
            return gguf_scheme("MXFP4")
        return hub_formats.int_scheme(self.bits, self.group, self.symmetric, in_features, self.act_order)


def read_hub_quant(hf_config: dict[str, Any]) -> HubQuant | None:
    """The format ``config.json``'s ``quantization_config`` names (None: a float checkpoint); raises a
    one-line refusal for a format localllm does not read."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise LocalLLMError("config.json's quantization_config is not an object", "the checkpoint is damaged")
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(qc, hf_config)
    if method == "awq":
        return _awq(qc, hf_config)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, hf_config)
    if method == "bitsandbytes":
        return _bitsandbytes(qc, hf_config)
    if method == "fp8":
        return _fp8(qc, hf_config)
    if method == "mxfp4":
        return HubQuant("mxfp4", 4, 32, True, False, "e2m1")
    if method in REFUSED:
        raise refuse(REFUSED[method], hf_config)
    raise refuse(f"'{method or 'unnamed'}'-quantized (a format localllm does not know)", hf_config)


def _group(value: Any) -> int | None:
    g = int(value) if value is not None else -1
    return None if g <= 0 else g


def _fp8(qc: dict[str, Any], hf_config: dict[str, Any]) -> HubQuant:
    """transformers' fine-grained FP8 (Qwen3-*-FP8, DeepSeek): e4m3 weights, ``weight_scale_inv`` per
    ``weight_block_size`` block, or per tensor / channel without one. Activations are quantized
    dynamically by the format, which localllm leaves in float; static activation scales are refused."""
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise refuse(f"FP8 {fmt}", hf_config)
    if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise refuse("FP8 with static activation scales", hf_config)
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or int(block[0]) <= 0 or int(block[1]) <= 0):
        raise LocalLLMError(f"FP8 weight_block_size {block} is not two sizes", "the checkpoint is damaged")
    rows, group = (int(block[0]), int(block[1])) if block else (None, None)
    return HubQuant("fp8", 8, group, True, False, "e4m3", "block" if block else "tensor", block_rows=rows)


def _bitsandbytes(qc: dict[str, Any], hf_config: dict[str, Any]) -> HubQuant:
    """Serialized 4-bit NormalFloat (``load_in_4bit``, ``bnb_4bit_quant_type: nf4``); whether its absmax
    is double-quantized is read from each weight's own quant state (the config's flag names it only)."""
    if not (qc.get("load_in_4bit") or qc.get("_load_in_4bit")):
        raise refuse("bitsandbytes 8-bit (LLM.int8)", hf_config)
    kind = str(qc.get("bnb_4bit_quant_type", "fp4")).lower()
    if kind != "nf4":
        raise refuse(f"bitsandbytes 4-bit {kind}", hf_config)
    return HubQuant("bitsandbytes", 4, None, True, False, "nf4",
                    double_quant=bool(qc.get("bnb_4bit_use_double_quant", False)))


def _gptq(qc: dict[str, Any], hf_config: dict[str, Any]) -> HubQuant:
    bits = int(qc.get("bits", 4))
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if qc.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"GPTQ ({fmt if fmt != 'gptq' else 'marlin'}-packed)", hf_config)
    if bits not in (4, 8):
        raise refuse(f"{bits}-bit GPTQ", hf_config)
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise refuse(f"GPTQ packed in {qc.get('pack_dtype')}", hf_config)
    return HubQuant("gptq", bits, _group(qc.get("group_size", 128)), bool(qc.get("sym", True)),
                    bool(qc.get("desc_act", False)), fmt)


def _awq(qc: dict[str, Any], hf_config: dict[str, Any]) -> HubQuant:
    version = str(qc.get("version", "gemm")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if version != "gemm":
        raise refuse(f"AWQ ({version} packing)", hf_config)
    if bits != 4 or not qc.get("zero_point", True):
        raise refuse(f"AWQ {bits}-bit{'' if qc.get('zero_point', True) else ' without zero points'}", hf_config)
    return HubQuant("awq", 4, _group(qc.get("group_size", qc.get("q_group_size", 128))), False, False, "gemm")


def _compressed_tensors(qc: dict[str, Any], hf_config: dict[str, Any]) -> HubQuant:
    groups = list((qc.get("config_groups") or {}).values())
    if qc.get("sparsity_config"):
        raise refuse("sparse compressed-tensors", hf_config)
    if not groups:
        raise LocalLLMError("compressed-tensors config has no config_groups", "the checkpoint is damaged")
    weights = [g.get("weights") or {} for g in groups]
    if any(w != weights[0] for w in weights[1:]):
        raise refuse("compressed-tensors with several weight schemes", hf_config)
    w = weights[0]
    fmt = str(groups[0].get("format") or qc.get("format") or "").lower()
    kind = str(w.get("type", "int")).lower()
    if kind != "int":
        raise refuse(f"compressed-tensors {kind} ({fmt})", hf_config)
    if any(g.get("input_activations") for g in groups):
        raise refuse(f"compressed-tensors with quantized activations ({fmt})", hf_config)
    if fmt not in ("pack-quantized", "naive-quantized"):
        raise refuse(f"compressed-tensors {fmt}", hf_config)
    bits = int(w.get("num_bits", 4))
    strategy = str(w.get("strategy", "group")).lower()
    if bits not in (4, 8) or strategy not in ("group", "channel", "tensor"):
        raise refuse(f"compressed-tensors {bits}-bit with {strategy} scales", hf_config)
    group = _group(w.get("group_size")) if strategy == "group" else None
    if strategy == "group" and group is None:
        raise LocalLLMError("compressed-tensors group strategy without a group size", "the checkpoint is damaged")
    act_order = str(w.get("actorder") or "").lower() == "group"
    return HubQuant("compressed-tensors", bits, group, bool(w.get("symmetric", True)), act_order, fmt, strategy)


def layer_canonical(hq: HubQuant, t: dict[str, torch.Tensor], scheme: QuantScheme,
                    what: str) -> dict[str, torch.Tensor]:
    """One quantized linear's tensors (by leaf name) -> ``scheme``'s canonical tensors, exactly."""
    if hq.method == "bitsandbytes":
        state = json.loads(bytes(t["weight.quant_state.bitsandbytes__nf4"].tolist()).decode())
        return hub_formats.bnb_nf4_canonical(t["weight"], t["weight.absmax"], t["weight.quant_map"],
                                             t.get("weight.nested_absmax"), t.get("weight.nested_quant_map"), state, what)
    if hq.method == "fp8":
        return hub_formats.fp8_canonical(t["weight"], t["weight_scale_inv"], scheme, hq.block_rows, what)
    if hq.method == "gptq":
        q, z, s = hub_formats.gptq_codes(t["qweight"], t["qzeros"], t["scales"], hq.bits, hq.variant == "gptq")
        g_idx = t.get("g_idx")
    elif hq.method == "awq":
        q, z, s = hub_formats.awq_codes(t["qweight"], t["qzeros"], t["scales"])
        g_idx = None
    else:
        packed = hq.variant == "pack-quantized"
        values = t["weight_packed"] if packed else t["weight"]
        shape = tuple(int(v) for v in t["weight_shape"]) if packed else tuple(values.shape)
        q, z, s = hub_formats.ct_codes(values, t["weight_scale"], t.get("weight_zero_point"), hq.bits,
                                       shape, packed)  # type: ignore[arg-type]
        g_idx = t.get("weight_g_idx")
    inp = q.shape[1]
    if inp % s.shape[1]:
        raise LocalLLMError(f"{what}: {s.shape[1]} scale groups do not divide {inp} inputs", "the checkpoint is damaged")
    perm = hub_formats.group_order(g_idx, inp, inp // s.shape[1], what)
    return hub_formats.to_canonical(q, z, s, scheme, hq.bits, perm, what)


@dataclass
class _Packed:
    """One quantized linear of the file: its tensors' leaf names, its width, and our names for it."""

    leaves: set[str]
    scheme: QuantScheme  # the grid its tensors land on exactly
    ours: list[tuple[str, int]] = field(default_factory=list)  # (our module, output rows), in row order


class HubQuantCheckpoint(HFCheckpoint):
    """A Hugging Face folder whose linears are quantized in a Hub format (:func:`read_hub_quant`)."""

    def __init__(self, folder: Path, hub: HubQuant) -> None:
        self.hub = hub  # before the config check, which reads :meth:`_shapes`
        super().__init__(folder)
        if self.config.is_moe:  # its experts are named one by one, the stacked projections are not
            raise refuse(f"Mixture-of-Experts {hub.label()}", self.hf_config)
        self.packed = self._scan()
        if not self.packed:
            raise LocalLLMError(f"{folder}: config.json says {hub.label()}, but no tensor is quantized",
                                "the checkpoint does not match its config")

    def _shapes(self) -> Iterator[tuple[str, str, tuple[int, ...]]]:
        """The float tensors' shapes for the config check: a quantized linear's packed tensors
        (bitsandbytes' ``weight`` is a column of bytes) are checked when they are unpacked."""
        marked = set()
        for path in self.files:
            header, _ = read_header(path)
            marked |= {self.hub.split(k)[0] for k in header if self.hub.split(k)[1] == self.hub.leaves[0]}
        for ours, key, shape in super()._shapes():
            module, leaf = self.hub.split(key)
            if module not in marked or leaf not in self.hub.leaves:
                yield ours, key, shape

    def _scan(self) -> dict[str, _Packed]:
        """The quantized linears, from the headers alone: module -> its leaves, width, our names."""
        leaves: dict[str, dict[str, tuple[int, ...]]] = {}
        states: dict[str, dict[str, Any]] = {}  # bitsandbytes: each weight's quant state (shape, blocks)
        for path in self.files:
            header, start = read_header(path)
            for key, info in header.items():
                module, leaf = self.hub.split(key)
                if leaf == _BNB_OTHER_STATE:
                    raise refuse("bitsandbytes 4-bit fp4", self.hf_config)
                if leaf in self.hub.leaves:
                    leaves.setdefault(module, {})[leaf] = tuple(info["shape"])
                if leaf == LEAVES["bitsandbytes"][0] and self.hub.method == "bitsandbytes":
                    states[module] = json.loads(_read_bytes(path, start, info))
        first = self.hub.leaves[0]
        packed: dict[str, _Packed] = {}
        for module, found in leaves.items():
            if first not in found:
                continue  # a float linear's plain weight (naive-quantized shares the name)
            if module in states:
                scheme = parse_scheme("nf4", int(states[module]["blocksize"]))
            else:
                scheme = self.hub.scheme(self._width(found))
            packed[module] = _Packed(set(found), scheme, self._ours(module))
        return packed

    def _width(self, shapes: dict[str, tuple[int, ...]]) -> int:
        h = self.hub
        if h.method == "gptq":
            return shapes["qweight"][0] * 32 // h.bits
        if h.method == "awq":
            return shapes["qweight"][0]
        if h.method == "fp8":
            return shapes["weight"][1]
        if h.variant == "pack-quantized":
            return shapes["weight_packed"][1] * 32 // h.bits
        return shapes["weight"][1]

    def _ours(self, module: str) -> list[tuple[str, int]]:
        m = module.split(".")
        suffix = ".".join(m[3:]) + ".weight" if len(m) > 3 else ""
        if suffix in FUSED:
            c = self.config
            rows = [c.q_dim, c.kv_dim, c.kv_dim] if len(FUSED[suffix]) == 3 else [c.intermediate_size] * 2
            layer = ".".join(m[1:3])
            return [(f"{layer}.{p.rpartition('.')[0]}", r) for p, r in zip(FUSED[suffix], rows)]
        ours = map_hf_name(f"{module}.weight", self.config.arch)
        return [] if ours is None else [(ours.rpartition(".")[0], 0)]

    def module_schemes(self) -> dict[str, QuantScheme]:
        """Our module -> the scheme its tensors land on exactly."""
        return {ours: p.scheme for p in self.packed.values() for ours, _ in p.ours}

    # -------------------------------------------------------------- the Checkpoint interface
    def default_scheme(self) -> QuantScheme | None:
        """The scheme most of the quantized linears land on (the others are the plan's overrides)."""
        schemes = list(self.module_schemes().values())
        return max(dict.fromkeys(schemes), key=schemes.count)  # a tie: the first seen, never the set's order

    def default_head(self, scheme: QuantScheme | None) -> QuantScheme | None:
        """A quantized head (GPTQ's ``lm_head: true``) keeps its grid; a float one stays float in the
        repo's own scheme (:meth:`exact_plan`) and becomes int8 when re-quantized with the rest
        (:func:`loaders.checkpoint.float_head_scheme`)."""
        if scheme is None:
            return None
        return self.module_schemes().get("output") or float_head_scheme(self.config, scheme)

    def exact_plan(self, plan: Plan) -> Plan:
        """Each planned module in the scheme its own tensors import into exactly; a module the file
        keeps in float stays float (never rounded onto a grid it does not have)."""
        own = self.module_schemes()
        return {m: own[m] for m in plan if m in own}

    def iter_tensors(self, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        """(our name, tensor) pairs, each quantized linear as its exact fp32 weight; ``keep``: only the
        tensors whose name in the file it accepts."""
        return self._stream({}, keep)

    def iter_canonical(self, plan: Plan, tied_head: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors for a model holding ``plan``'s schemes: a quantized linear planned in the scheme it
        lands on exactly comes as its canonical tensors; one planned in another scheme (``--quant``
        naming it) is quantized from its exact values; everything else as it is."""
        return quantize_stream(self._stream(plan), plan, tied_head)

    def _stream(self, plan: Plan, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for path in self.files:
            for key, tensor in iter_safetensors(path):
                if keep is not None and not keep(key):
                    continue
                module, leaf = self.hub.split(key)
                p = self.packed.get(module)
                if p is None or leaf not in p.leaves:
                    yield from self._plain(key, tensor)
                    continue
                parts = pending.setdefault(module, {})
                parts[leaf] = tensor
                del tensor
                if set(parts) == p.leaves:
                    yield from self._layer(module, p, pending.pop(module), plan)
        if pending:
            raise LocalLLMError(f"{self.folder}: quantized layer {next(iter(pending))} lacks tensors",
                                "download the model again")

    def _plain(self, key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        parts = split_fused(key, tensor, self.config)
        if parts is not None:
            yield from parts
            return
        ours = map_hf_name(key, self.config.arch)
        if ours is not None:
            yield ours, tensor

    def _layer(self, module: str, p: _Packed, tensors: dict[str, torch.Tensor],
               plan: Plan) -> Iterator[tuple[str, torch.Tensor]]:
        scheme = p.scheme
        canonical = layer_canonical(self.hub, tensors, scheme, module)
        del tensors
        start = 0
        for ours, rows in p.ours:
            n = rows or next(iter(canonical.values())).shape[0]
            part = {k: (v if k == "perm" else v[start : start + n]) for k, v in canonical.items()}
            start += n
            if plan.get(ours) == scheme:
                yield from ((f"{ours}.{k}", v.contiguous()) for k, v in part.items())
            else:
                yield f"{ours}.weight", dequantize_weight(part, scheme)  # exact, in fp32


#: gpt-oss's MXFP4 experts, after ``model.layers.N.``: (projection, tensor) of ``*_blocks`` / ``*_scales``.
_MXFP4_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")


class MXFP4Checkpoint(HFCheckpoint):
    """gpt-oss as OpenAI publishes it (``quant_method: mxfp4``): each layer's experts in MXFP4,
    ``mlp.experts.gate_up_proj_blocks`` uint8 (E, 2F, D / 32, 16) with ``_scales`` (E, 2F, D / 32), gate
    and up interleaved by row (gate the even rows, up the odd ones), and ``down_proj_blocks`` (E, D,
    F / 32, 16); every other tensor (attention, router, biases, sinks) bf16, read as a float
    checkpoint's. The experts are repacked exactly into GGUF's MXFP4 blocks (the ``gguf`` scheme's,
    :func:`quant.hub_formats.mxfp4_blocks`): one expert's rows at a time, gate and up a gather of
    whole rows, so the native block kernels multiply the checkpoint's own values. An expert planned
    in another scheme (``--quant int4``) is quantized from those exact values."""

    def __init__(self, folder: Path, hub: HubQuant) -> None:
        self.hub = hub
        super().__init__(folder)
        if self.config.arch != "gpt_oss":
            raise LocalLLMError(f"{folder}: MXFP4 experts are read for gpt-oss only, not in a {self.config.arch} model",
                                _instead(self.hf_config))
        self.scheme = gguf_scheme("MXFP4")

    def _shapes(self) -> Iterator[tuple[str, str, tuple[int, ...]]]:
        """The float tensors' shapes, and each expert projection's (out, in) from its blocks' shape."""
        for ours, key, shape in super()._shapes():
            yield ours, key, shape
        for path in self.files:
            header, _ = read_header(path)
            for key, info in header.items():
                m = _MXFP4_EXPERTS.match(key)
                if m is None or m.group(3) != "blocks" or len(info["shape"]) != 4:
                    continue
                E, rows, groups, _ = info["shape"]
                proj, rows = ("gate", rows // 2) if m.group(2) == "gate_up_proj" else ("down", rows)
                yield f"layers.{m.group(1)}.mlp.experts.{E - 1}.{proj}.weight", key, (rows, groups * 32)

    def expert_modules(self) -> list[str]:
        """Our stacked expert projections (``layers.0.mlp.experts.gate``), the plan's names for them."""
        return [f"layers.{i}.mlp.experts.{p}" for i in range(self.config.n_layers) for p in ("gate", "up", "down")]

    # -------------------------------------------------------------- the Checkpoint interface
    def default_scheme(self) -> QuantScheme | None:
        """The experts' own MXFP4 blocks; every other linear stays in its float dtype."""
        return self.scheme

    def default_head(self, scheme: QuantScheme | None) -> QuantScheme | None:
        """gpt-oss's head is bf16: float in the experts' own MXFP4 (:meth:`exact_plan`), int8 when
        re-quantized with the rest (:func:`loaders.checkpoint.float_head_scheme`)."""
        return float_head_scheme(self.config, scheme)

    def exact_plan(self, plan: Plan) -> Plan:
        """The experts in MXFP4 blocks where the plan has them; every other module float."""
        return {m: self.scheme for m in plan if m in set(self.expert_modules())}

    def iter_tensors(self, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        """(our name, tensor) pairs, each expert's projections as their exact fp32 weights."""
        return self._stream({}, keep)

    def iter_canonical(self, plan: Plan, tied_head: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Experts planned in MXFP4 as their blocks, in another scheme quantized from their exact
        values; everything else as a float checkpoint's."""
        return quantize_stream(self._stream(plan), plan, tied_head)

    def _stream(self, plan: Plan, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        float_keep = (lambda k: _MXFP4_EXPERTS.match(k) is None and (keep is None or keep(k)))
        yield from super().iter_tensors(float_keep)
        pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for path in self.files:
            for key, tensor in iter_safetensors(path, lambda k: _MXFP4_EXPERTS.match(k) is not None and
                                                (keep is None or keep(k))):
                m = _MXFP4_EXPERTS.match(key)
                parts = pending.setdefault((m.group(1), m.group(2)), {})  # type: ignore[union-attr]
                parts[m.group(3)] = tensor  # type: ignore[union-attr]
                del tensor
                if len(parts) == 2:
                    yield from self._experts(m.group(1), m.group(2), pending.pop((m.group(1), m.group(2))), plan)  # type: ignore[union-attr]
        if pending:
            layer, proj = next(iter(pending))
            raise LocalLLMError(f"{self.folder}: layer {layer}'s {proj} lacks its MXFP4 blocks or scales",
                                "download the model again")

    def _experts(self, layer: str, proj: str, t: dict[str, torch.Tensor], plan: Plan) -> Iterator[tuple[str, torch.Tensor]]:
        """One layer's stacked projection -> each expert's gate and up (or down), blocks or fp32."""
        c = self.config
        gate_up = proj == "gate_up_proj"
        rows, width = (2 * c.expert_size, c.dim) if gate_up else (c.dim, c.expert_size)  # type: ignore[operator]
        want = (c.n_experts, rows, width // 32, 16)
        what = f"model.layers.{layer}.mlp.experts.{proj}"
        if tuple(t["blocks"].shape) != want:
            raise LocalLLMError(f"{what}_blocks has shape {tuple(t['blocks'].shape)}, the config implies {want}",
                                "the checkpoint does not match its config")
        parts = (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))) if gate_up else (("down", slice(None)),)
        for e in range(c.n_experts):  # type: ignore[arg-type]
            blocks = hub_formats.mxfp4_blocks(t["blocks"][e], t["scales"][e], what)  # (rows, width / 32 * 17)
            for name, sel in parts:
                ours = f"layers.{layer}.mlp.experts.{e}.{name}"
                held = blocks[sel].contiguous()
                if plan.get(f"layers.{layer}.mlp.experts.{name}") == self.scheme:
                    yield f"{ours}.blocks", held
                else:
                    yield f"{ours}.weight", dequantize_weight({"blocks": held}, self.scheme)  # exact, fp32
            del blocks


def _read_bytes(path: Path, start: int, info: dict[str, Any]) -> bytes:
    """One small tensor's bytes, read from the file (a quant state's JSON)."""
    begin, end = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + begin)
        return f.read(end - begin)


def open_hf_folder(folder: Path) -> HFCheckpoint:
    """A Hugging Face model folder: float, or quantized in a Hub format its config names."""
    config = folder / "config.json"
    try:
        hf_config = json.loads(config.read_text())
    except (OSError, ValueError):
        return HFCheckpoint(folder)  # which names a missing or unreadable config
    if not isinstance(hf_config, dict):
        return HFCheckpoint(folder)
    try:
        hub = read_hub_quant(hf_config)
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # the fields' types are the file's
        raise LocalLLMError(f"{folder}: config.json's quantization_config cannot be read ({e})",
                            "the checkpoint is damaged: download it again") from None
    if hub is None:
        return HFCheckpoint(folder)
    return MXFP4Checkpoint(folder, hub) if hub.method == "mxfp4" else HubQuantCheckpoint(folder, hub)


def source_format(ckpt: Any) -> dict[str, Any]:
    """``{"format": {...}}`` for a Hub-quantized checkpoint (what a manifest's ``source`` records:
    method, bits, group, symmetric, act order, variant, label), else nothing."""
    return {"format": ckpt.hub.to_dict()} if isinstance(ckpt, (HubQuantCheckpoint, MXFP4Checkpoint)) else {}
