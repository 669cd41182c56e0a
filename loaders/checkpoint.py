"""Local Hugging Face model folders: ``config.json`` + safetensors shards, read one tensor at a time."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from localllm.errors import LocalLLMError
from localllm.loaders.safetensors_stream import iter_safetensors, read_header, tensor_dtypes
from localllm.quant.convert import Plan, quantize_stream
from localllm.quant.formats import QuantScheme, parse_scheme
from localllm.runtime.config import MOE_ARCHITECTURES, ModelConfig, hf_keys
from localllm.runtime.config_checks import check_tensors

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

# HF Llama/Mistral/Qwen2 parameter names -> ours (see runtime/model.py).
LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.q_proj.bias": "attn.q.bias",
    "self_attn.k_proj.bias": "attn.k.bias",
    "self_attn.v_proj.bias": "attn.v.bias",
    "self_attn.o_proj.weight": "attn.o.weight",
    "self_attn.o_proj.bias": "attn.o.bias",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
TOP_MAP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
#: q/k norms (Qwen3, Gemma 3: per head; OLMoE: over the whole projection).
_QK_NORM_MAP = {"self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight"}
#: Gemma 3's four norms: its ``post_attention_layernorm`` follows attention (Llama's precedes the MLP).
_GEMMA3_MAP = {
    **{k: v for k, v in LAYER_MAP.items() if k != "post_attention_layernorm.weight"},
    **_QK_NORM_MAP,
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "pre_feedforward_layernorm.weight": "mlp_norm.weight",
    "post_feedforward_layernorm.weight": "post_mlp_norm.weight",
}
#: Per-architecture layer tables (the others use LAYER_MAP).
_ARCH_LAYER_MAPS = {"qwen3": {**LAYER_MAP, **_QK_NORM_MAP}, "qwen3_moe": {**LAYER_MAP, **_QK_NORM_MAP},
                    "olmoe": {**LAYER_MAP, **_QK_NORM_MAP},  # its q/k norms span the whole projection
                    "gemma3": _GEMMA3_MAP,
                    # gpt-oss: attention sinks, a router with a bias
                    "gpt_oss": {**LAYER_MAP, "self_attn.sinks": "attn.sinks", "mlp.router.weight": "mlp.router.weight",
                                "mlp.router.bias": "mlp.router.bias"}}
#: Phi-3's fused projections -> the parts they stack, in row order (split as they are read).
FUSED = {"self_attn.qkv_proj.weight": ("attn.q.weight", "attn.k.weight", "attn.v.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate.weight", "mlp.up.weight")}
#: The fused projections' names as the config check knows them (:func:`runtime.config_checks.check_tensors`).
FUSED_NAMES = {"self_attn.qkv_proj.weight": "attn.qkv.weight", "mlp.gate_up_proj.weight": "mlp.gate_up.weight"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: A MoE layer's tensors (runtime/moe.py): the router, a shared expert and its gate (Qwen2-MoE), and
#: each expert's projection, Qwen's ``mlp.experts.E.gate_proj`` or Mixtral's ``block_sparse_moe.experts.E.w1``.
_MOE_MAP = {"mlp.gate.weight": "mlp.router.weight", "block_sparse_moe.gate.weight": "mlp.router.weight",
            "mlp.shared_expert_gate.weight": "mlp.shared_gate.weight",
            **{f"mlp.shared_expert.{p}_proj.weight": f"mlp.shared.{p}.weight" for p in ("gate", "up", "down")}}
_EXPERT_RE = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
#: transformers 5's fused experts, (E, 2F, D) gate then up, and (E, D, F): split into each expert's.
#: gpt-oss's are transposed, (E, D, 2F) with gate and up in alternate columns and (E, F, D), and
#: have biases (E, 2F) interleaved alike and (E, D): :func:`split_experts`.
_FUSED_EXPERTS = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_OSS_EXPERT_BIAS = re.compile(r"^mlp\.experts\.(gate_up_proj_bias|down_proj_bias)$")
# Buffers some checkpoints carry that we compute ourselves.
_IGNORED_RE = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")
# A multimodal Gemma 3 checkpoint: its language model's names under a prefix (transformers 4.x / 5.x),
# beside a vision tower and projector that a text runtime leaves out.
_NESTED = (("language_model.model.", "model."), ("model.language_model.", "model."),
           ("language_model.lm_head.", "lm_head."))
_VISION_RE = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")


def rename(name: str, top: dict[str, str], layer_re: re.Pattern[str], layer: dict[str, str]) -> str | None:
    """Our name for a checkpoint name through a format's tables (top-level names, and per-layer
    suffixes after ``layer_re``'s layer number); None when the tables do not know it."""
    if name in top:
        return top[name]
    m = layer_re.match(name)
    if m and m.group(2) in layer:
        return f"layers.{m.group(1)}.{layer[m.group(2)]}"
    return None


def map_hf_name(name: str, arch: str = "llama") -> str | None:
    """Our parameter name for an HF checkpoint name of an ``arch`` model; None for entries we recompute
    (rope buffers) or do not run (a multimodal checkpoint's vision tower)."""
    if _VISION_RE.match(name):
        return None
    for prefix, plain in _NESTED:
        if name.startswith(prefix):
            name = plain + name[len(prefix):]
            break
    ours = rename(name, TOP_MAP, _LAYER_RE, _ARCH_LAYER_MAPS.get(arch, LAYER_MAP))
    if ours is not None:
        return ours
    m = _LAYER_RE.match(name)
    if m is not None and arch in MOE_ARCHITECTURES:
        if m.group(2) in _MOE_MAP:
            return f"layers.{m.group(1)}.{_MOE_MAP[m.group(2)]}"
        e = _EXPERT_RE.match(m.group(2))
        if e is not None:
            return f"layers.{m.group(1)}.mlp.experts.{e.group(1)}.{_EXPERT_PROJ[e.group(2)]}.weight"
    if _IGNORED_RE.search(name):
        return None
    raise LocalLLMError(f"unexpected tensor '{name}' in the checkpoint", f"is this really a {arch} model?")


def split_fused(name: str, tensor: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]] | None:
    """A fused projection (Phi-3's ``qkv_proj``, ``gate_up_proj``) as our separate ones: row slices
    (views, no copy); None for any other tensor."""
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) not in FUSED:
        return None
    parts = FUSED[m.group(2)]
    rows = [config.q_dim, config.kv_dim, config.kv_dim] if len(parts) == 3 else [config.intermediate_size] * 2
    if tensor.shape[0] != sum(rows):
        raise LocalLLMError(f"tensor '{name}' has {tensor.shape[0]} rows, the config implies {sum(rows)}",
                            "the checkpoint does not match its config")
    return [(f"layers.{m.group(1)}.{p}", t) for p, t in zip(parts, tensor.split(rows, dim=0))]


def split_experts(name: str, tensor: torch.Tensor,
                  config: ModelConfig) -> Iterable[tuple[str, torch.Tensor]] | None:
    """transformers 5's fused experts (``mlp.experts.gate_up_proj`` (E, 2F, D), ``down_proj`` (E, D, F))
    as each expert's projections (views, no copy); None for any other tensor. gpt-oss's go through
    :func:`split_gpt_oss_experts`."""
    if config.arch == "gpt_oss":
        return split_gpt_oss_experts(name, tensor, config)
    m = _LAYER_RE.match(name)
    f = _FUSED_EXPERTS.match(m.group(2)) if m is not None and config.is_moe else None
    if f is None:
        return None
    E, D, F_ = config.n_experts, config.dim, config.expert_size
    gate_up = f.group(1) == "gate_up_proj"
    want = (E, 2 * F_, D) if gate_up else (E, D, F_)  # type: ignore[operator]
    if tuple(tensor.shape) != want:
        raise LocalLLMError(f"tensor '{name}' has shape {tuple(tensor.shape)}, the config implies {want}",
                            "the checkpoint does not match its config")
    prefix = f"layers.{m.group(1)}.mlp.experts"  # type: ignore[union-attr]
    if not gate_up:
        return [(f"{prefix}.{e}.down.weight", tensor[e]) for e in range(E)]  # type: ignore[arg-type]
    return [(f"{prefix}.{e}.{p}.weight", t) for e in range(E)  # type: ignore[arg-type]
            for p, t in zip(("gate", "up"), tensor[e].split(F_, dim=0))]


def split_gpt_oss_experts(name: str, tensor: torch.Tensor,
                          config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]] | None:
    """gpt-oss's float experts as localllm's: ``gate_up_proj`` (E, D, 2F), gate in the even columns and
    up in the odd ones (``x @ W``: transposed against a linear's weight), -> each expert's ``gate`` and
    ``up`` (F, D); ``down_proj`` (E, F, D) -> each expert's ``down`` (D, F); the biases
    ``gate_up_proj_bias`` (E, 2F), interleaved alike, -> ``gate_bias`` and ``up_bias`` (E, F), and
    ``down_proj_bias`` (E, D) -> ``down_bias``. Exact (a column selection), one expert's copy at a
    time; None for any other tensor."""
    m = _LAYER_RE.match(name)
    if m is None:
        return None
    E, D, F_ = config.n_experts, config.dim, config.expert_size
    prefix = f"layers.{m.group(1)}.mlp.experts"
    b = _OSS_EXPERT_BIAS.match(m.group(2))
    f = _FUSED_EXPERTS.match(m.group(2))
    if b is None and f is None:
        return None
    gate_up = (b or f).group(1).startswith("gate_up")  # type: ignore[union-attr]
    want = ((E, 2 * F_) if gate_up else (E, D)) if b is not None else (E, D, 2 * F_) if gate_up else (E, F_, D)  # type: ignore[operator]
    if tuple(tensor.shape) != want:
        raise LocalLLMError(f"tensor '{name}' has shape {tuple(tensor.shape)}, the config implies {want}",
                            "the checkpoint does not match its config")
    if b is not None:
        if not gate_up:
            return iter([(f"{prefix}.down_bias", tensor)])
        return iter([(f"{prefix}.gate_bias", tensor[:, 0::2].contiguous()),
                     (f"{prefix}.up_bias", tensor[:, 1::2].contiguous())])
    if not gate_up:  # a generator: one expert's copy at a time
        return ((f"{prefix}.{e}.down.weight", tensor[e].t().contiguous()) for e in range(E))  # type: ignore[arg-type]
    return ((f"{prefix}.{e}.{p}.weight", tensor[e][:, j::2].t().contiguous())  # type: ignore[arg-type]
            for e in range(E) for j, p in ((0, "gate"), (1, "up")))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LocalLLMError(f"cannot read {path}: {e}", "the model folder looks damaged; download it again") from e


def refuse_pickles(folder: Path) -> None:
    """Raise if a folder holds weights only as pickles: loading a pickle can run arbitrary code."""
    if any(folder.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise LocalLLMError(
            f"{folder} has weights only as pickle files ({', '.join(pickles[:3])}), which localllm refuses to load "
            "because unpickling can run arbitrary code",
            "use a safetensors export of the model (many repos have one), or convert it yourself in a sandbox",
        )


def float_head_scheme(config: ModelConfig, scheme: QuantScheme | None) -> QuantScheme | None:
    """The output head's scheme when a float head is quantized into ``scheme``: int8 with a scale per
    32 inputs (per channel where the width is not a multiple of 32), which is near-lossless and, tied,
    serves as the embedding table too; an int8 ``scheme`` itself; None (16-bit) for a float scheme.

    The head is the widest layer of a small model (SmolLM2's is 46% of its int4 bytes when kept 16-bit)
    and is read whole at every token, so a 16-bit head made a quantized model's decode read at half the
    rate of its other layers; a 16-bit table also held the CPU's activations in bf16, off the native
    quantized kernels. llama.cpp's Q4 and Q8 files likewise hold it in 6 or 8 bits."""
    if scheme is None or scheme.is_float:
        return None
    if scheme.name == "int8":
        return scheme
    return parse_scheme("int8", 32 if config.dim % 32 == 0 else None)


class HFCheckpoint:
    """A local HF-format model folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        if not folder.is_dir():
            raise LocalLLMError(f"model folder not found: {folder}", "check the path")
        refuse_pickles(folder)
        if not (folder / "config.json").is_file():
            raise LocalLLMError(f"{folder} has no config.json", "point at a Hugging Face model folder or a .gguf file")
        gen_path = folder / "generation_config.json"
        self.hf_config = _read_json(folder / "config.json")
        gen = _read_json(gen_path) if gen_path.is_file() else None
        self.config = ModelConfig.from_hf(self.hf_config, gen)
        self.files = self._weight_files()
        # Before anything is built for it: the config against the shards' headers.
        check_tensors(self.config, self._shapes(), "config.json", hf_keys(self.hf_config))

    def _shapes(self) -> Iterator[tuple[str, str, tuple[int, ...]]]:
        """(our name, the file's name, shape) of every tensor this runtime reads, from the headers."""
        for path in self.files:
            header, _ = read_header(path)
            for key, info in header.items():
                name = key
                for nested, plain in _NESTED:
                    name = plain + name[len(nested):] if name.startswith(nested) else name
                m = _LAYER_RE.match(name)
                if m is not None and m.group(2) in FUSED_NAMES:
                    yield f"layers.{m.group(1)}.{FUSED_NAMES[m.group(2)]}", key, tuple(info["shape"])
                    continue
                f = _FUSED_EXPERTS.match(m.group(2)) if m is not None else None
                if f is not None and len(info["shape"]) == 3:  # fused experts: their count, each expert's shape
                    E, rows, cols = info["shape"]
                    if self.config.arch == "gpt_oss":  # transposed: (E, D, 2F) and (E, F, D)
                        rows, cols = cols, rows
                    proj, rows = ("gate", rows // 2) if f.group(1) == "gate_up_proj" else ("down", rows)
                    yield f"layers.{m.group(1)}.mlp.experts.{E - 1}.{proj}.weight", key, (rows, cols)
                    continue
                try:
                    ours = map_hf_name(name, self.config.arch)
                except LocalLLMError:
                    continue  # an unknown tensor: the load names it
                if ours is not None:
                    yield ours, key, tuple(info["shape"])

    def _weight_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(_read_json(index)["weight_map"].values()))
            files = [self.folder / n for n in names]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise LocalLLMError(
                    f"{self.folder} lacks shard(s) {', '.join(missing)} named by its index", "download the model again"
                )
            return files
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise LocalLLMError(f"{self.folder} has no *.safetensors weights", "point at a folder with safetensors weights")
        return files

    def iter_tensors(self, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, tensor) pairs, one tensor in memory at a time. ``keep``: read only the tensors
        whose name in the file it accepts (one layer's, for a calibration: loaders.calibrate)."""
        arch = self.config.arch
        for path in self.files:
            for key, tensor in iter_safetensors(path, keep):
                for nested, plain in _NESTED:
                    key = plain + key[len(nested):] if key.startswith(nested) else key
                parts = split_fused(key, tensor, self.config)
                if parts is None:
                    parts = split_experts(key, tensor, self.config)
                if parts is not None:
                    yield from parts
                    continue
                ours = map_hf_name(key, arch)
                if ours is not None:
                    yield ours, tensor

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The dtype the files hold the tensor ``name`` (ours) in; None where they hold no float tensor
        of that name (a packed one, or none at all). From the headers alone, read once."""
        return self._float_dtypes.get(name)

    @functools.cached_property
    def _float_dtypes(self) -> dict[str, torch.dtype]:
        dtypes: dict[str, torch.dtype] = {}
        for path in self.files:
            dtypes.update(tensor_dtypes(path))
        return {ours: dtypes[key] for ours, key, _ in self._shapes() if key in dtypes and dtypes[key].is_floating_point}

    def default_scheme(self) -> QuantScheme | None:
        """Float checkpoints run as they are unless a scheme is asked for."""
        return None

    def default_head(self, scheme: QuantScheme | None) -> QuantScheme | None:
        """Quantized, a float checkpoint's head becomes int8 (:func:`float_head_scheme`)."""
        return float_head_scheme(self.config, scheme)

    def exact_plan(self, plan: Plan) -> Plan:
        """Float weights quantize into any scheme asked for: the plan stands."""
        return plan

    def iter_canonical(self, plan: Plan, tied_head: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors with the modules in ``plan`` quantized on the fly, one tensor at a time."""
        return quantize_stream(self.iter_tensors(), plan, tied_head)

    def describe(self) -> str:
        return str(self.folder)
