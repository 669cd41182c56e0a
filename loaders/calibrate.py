"""Data-aware int4 for float checkpoints: AWQ scales from a calibration text, one decoder layer at a time.

The calibration text shipped with localllm (``localllm/data/calibration.txt``; not the bench's
evaluation text) runs through the float model layer by layer: the hidden states of all calibration
tokens are held (tokens x dim, fp32), one layer's float weights are read from the checkpoint, its
linears' inputs are recorded, :func:`quant.awq.apply_awq` rewrites the layer (scales searched,
their inverse folded into the norms and into v's and up's rows, weight groups clipped), the layer is
quantized to canonical int4 and yielded, and the QUANTIZED layer's output becomes the next layer's
input (so each layer's scales see the error of the layers before, as AWQ does). The layer runs one
calibration sequence at a time, each linear's input added to its statistics as it comes. Memory: the
hidden states, one layer's fp32 weights, one sequence's activations and the inputs' statistics (the
tokens, or their Gram matrices when there are more tokens than channels), beside the embedding
while the first inputs are made.

Only int4 from float weights (a Hugging Face folder of float safetensors) is calibrated; GGUF files
and stored or otherwise quantized sources keep their values (``--calibration none`` is plain
round-to-nearest everywhere).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch

from localllm.errors import LocalLLMError
from localllm.loaders.checkpoint import HFCheckpoint
from localllm.quant.awq import Fold, ScaleGroup, StatsAccumulator, apply_awq
from localllm.quant.convert import Plan, quantize_stream
from localllm.quant.formats import QuantScheme, dequantize, quantize
from localllm.runtime.config import ModelConfig
from localllm.runtime.model import Block, rope_tables, round_to
from localllm.runtime.tokenizer import Tokenizer

#: The ``--calibration`` choices: ``awq`` (data-aware, for int4 from float weights), ``none`` (round
#: to nearest) and ``auto`` (:func:`resolve_calibration`).
CALIBRATIONS = ("auto", "awq", "none")
#: A pull's default: the model is calibrated once, when it is stored, where that takes minutes.
PULL_CALIBRATION = "auto"
#: ``auto`` calibrates models up to this many parameters. The calibration runs on the CPU and its time
#: grows with the weights: minutes for SmolLM2-135M on two cores, so about an hour at this size and
#: hours for a 7B model, against seconds for round to nearest (docs/quantization.md).
AUTO_AWQ_PARAMETERS = 1_000_000_000
#: A load's default (``run FOLDER --quant int4``, ``load_model``): a load quantizes again every time,
#: so it rounds to nearest unless asked.
DEFAULT_CALIBRATION = "none"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: Unquantized parameters are stored (and run) in bf16 beside int4 blocks (loaders.convert): the next
#: layer's calibration input is made with them rounded so.
_STORED_FLOAT = torch.bfloat16


def calibration_text() -> str:
    """The calibration text shipped with localllm."""
    return (resources.files("localllm") / "data" / "calibration.txt").read_text(encoding="utf-8")


@dataclass
class Calibration:
    """How to calibrate (the settings) and, once the stream has run, what it did (the outcome)."""

    method: str = DEFAULT_CALIBRATION
    text: str | None = None  # None: the shipped calibration text
    seq_len: int = 512  # tokens a calibration sequence
    max_tokens: int = 2048  # tokens used at most
    clip: bool = True  # also search each weight group's clipping
    # the outcome
    tokens: int = 0
    seconds: float = 0.0
    alphas: dict[str, list[float]] = field(default_factory=dict)  # group input -> alpha per layer
    error_ratio: float | None = None  # summed output error: data-aware / round-to-nearest (calibration data)

    def __post_init__(self) -> None:
        if self.method not in CALIBRATIONS:
            raise LocalLLMError(f"unknown calibration '{self.method}'", f"use one of {', '.join(CALIBRATIONS)}")

    @property
    def ran(self) -> bool:
        return self.tokens > 0

    def to_manifest(self) -> dict[str, Any]:
        """What the manifest records of a calibrated artifact."""
        return {"method": self.method, "text": "built-in" if self.text is None else "custom",
                "tokens": self.tokens, "clip": self.clip, "seconds": round(self.seconds, 2),
                "error_ratio": None if self.error_ratio is None else round(self.error_ratio, 4),
                "alphas": {k: [round(a, 3) for a in v] for k, v in self.alphas.items()}}

    def summary(self) -> str:
        ratio = f", output error {self.error_ratio:.2f}x round-to-nearest's" if self.error_ratio is not None else ""
        return f"data-aware int4 (AWQ): calibrated on {self.tokens} tokens in {self.seconds:.1f}s{ratio}"


def calibrates(ckpt: object, plan: Plan, calibration: Calibration | None) -> bool:
    """Whether this load or conversion runs the data-aware path: asked for, float weights from a
    Hugging Face folder of a dense model (the layer-by-layer calibration runs dense blocks only: a
    MoE's int4 is rounded to nearest), and int4 blocks in the plan."""
    return (calibration is not None and calibration.method == "awq" and isinstance(ckpt, HFCheckpoint)
            and ckpt.default_scheme() is None and not ckpt.config.is_moe
            and any(s.name == "int4" for s in plan.values()))


def resolve_calibration(method: str, config: ModelConfig) -> str:
    """``auto`` made concrete for a model: ``awq`` up to :data:`AUTO_AWQ_PARAMETERS` parameters, else
    ``none``; ``awq`` and ``none`` as they are."""
    if method != "auto":
        return method
    return "awq" if config.num_parameters() <= AUTO_AWQ_PARAMETERS else "none"


def calibrates_to(ckpt: object, scheme: QuantScheme, method: str) -> bool:
    """:func:`calibrates` for a conversion of ``ckpt`` to ``scheme`` with ``--calibration method``
    (what a pull says before it starts)."""
    return calibrates(ckpt, {"": scheme}, Calibration(method))


def _layer_of(key: str) -> int | None:
    m = _LAYER.search(key)
    return int(m.group(1)) if m else None


def scale_groups(config: ModelConfig, plan: Plan, prefix: str) -> list[ScaleGroup]:
    """The block's linears that share an input, in AWQ's order, with where each input is made:
    q/k/v after the attention norm, o after v (through attention), gate/up after the MLP norm, down
    after up (through the gated product). A group whose linears are not all int4 is left out."""
    off = config.norm_offset
    heads = (config.n_kv_heads, config.n_heads // config.n_kv_heads, config.head_dim)
    groups = [
        ScaleGroup(("attn.q", "attn.k", "attn.v"), "attn.q", Fold("norm", "attn_norm.weight", off), ("attn.v",)),
        ScaleGroup(("attn.o",), "attn.o", Fold("rows", "attn.v", heads=heads), ("attn.o",)),
        ScaleGroup(("mlp.gate", "mlp.up"), "mlp.gate", Fold("norm", "mlp_norm.weight", off), ("mlp.gate", "mlp.up")),
        ScaleGroup(("mlp.down",), "mlp.down", Fold("rows", "mlp.up"), ("mlp.down",)),
    ]

    def int4(name: str) -> bool:
        s = plan.get(prefix + name)
        return s is not None and s.name == "int4"

    keep = []
    for g in groups:
        if all(int4(n) for n in g.linears) and (g.fold.kind == "norm" or int4(g.fold.target)):
            keep.append(g)
    return keep


def _tokens(tokenizer: Tokenizer, calibration: Calibration, max_seq_len: int) -> torch.Tensor:
    """The calibration token ids as (sequences, seq_len), each sequence starting with BOS when the
    model's prompts do, none longer than the model's context."""
    text = calibration.text if calibration.text is not None else calibration_text()
    ids = tokenizer.encode(text, add_special=False)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    body = min(calibration.seq_len, max_seq_len) - len(bos)
    n = min(len(ids), calibration.max_tokens) // body
    if n == 0:
        raise LocalLLMError(f"the calibration text has {len(ids)} tokens, fewer than one sequence of {body}",
                            "give a longer text, or --calibration none")
    return torch.tensor([bos + ids[i * body:(i + 1) * body] for i in range(n)])  # (B, T)


def _block(config: ModelConfig, layer: int, tensors: dict[str, torch.Tensor]) -> Block:
    """A float (fp32) decoder block over ``tensors`` (fp32, its own names), sharing them (no copy)."""
    with torch.device("meta"):
        block = Block(config, layer)
    block.load_state_dict(tensors, strict=True, assign=True)
    return block.eval().requires_grad_(False)


def _record_inputs(block: Block, names: list[str], n_tokens: int) -> tuple[dict[str, StatsAccumulator], list[Any]]:
    """Forward pre-hooks that add the input of each named linear to its statistics, call after call."""
    seen: dict[str, StatsAccumulator] = {}
    handles = []
    for name in names:
        module = block.get_submodule(name)
        seen[name] = StatsAccumulator(n_tokens, module.weight.shape[1])

        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
            seen[name].add(args[0].detach())
        handles.append(module.register_forward_pre_hook(hook))
    return seen, handles


def _forward_inplace(block: Block, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``x`` (B, T, D) replaced by the block's output, one sequence at a time: the block's activations
    (attention's scores, the MLP's intermediate) are those of one sequence, not of all B."""
    for b in range(x.shape[0]):
        x[b:b + 1] = block(x[b:b + 1], None, *rope)


def calibrated_stream(ckpt: HFCheckpoint, plan: Plan, tied_head: bool,
                      calibration: Calibration) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the artifact's tensors (as :func:`quant.convert.quantize_stream` would, in another order)
    with each block's int4 linears made data-aware; fills ``calibration``'s outcome at the end."""
    t0 = time.perf_counter()
    config = ckpt.config
    tokens = _tokens(Tokenizer.from_folder(ckpt.folder), calibration, config.max_seq_len)  # (B, T)
    B, T = tokens.shape
    # The top-level tensors (embedding, final norm, head) first: the embedding makes the first inputs.
    top = dict(ckpt.iter_tensors(keep=lambda key: _layer_of(key) is None))
    if "embed.weight" not in top:
        raise LocalLLMError(f"{ckpt.describe()}: no embedding in the checkpoint", "download the model again")
    x = top["embed.weight"][tokens].float()  # (B, T, D)
    if config.embed_scale is not None:
        x = x * round_to(config.embed_scale, x.dtype)
    yield from quantize_stream(_popping(top), plan, tied_head)
    rope = {local: rope_tables(config, T, torch.device("cpu"), local) for local in (False, True)}
    errors = [0.0, 0.0]  # summed output errors on the calibration data: round-to-nearest, data-aware
    for i in range(config.n_layers):
        prefix = f"layers.{i}."
        raw = {name[len(prefix):]: t for name, t in ckpt.iter_tensors(keep=lambda key, i=i: _layer_of(key) == i)}
        out = _calibrate_layer(config, i, raw, x, rope, plan, calibration, errors)  # empties raw, updates x
        yield from ((prefix + name, t) for name, t in out)
        del out
    calibration.tokens = B * T
    calibration.error_ratio = errors[1] / errors[0] if errors[0] > 0 else None
    calibration.seconds = time.perf_counter() - t0


@torch.no_grad()
def _calibrate_layer(config: ModelConfig, i: int, raw: dict[str, torch.Tensor], x: torch.Tensor,
                     rope: dict[bool, tuple[torch.Tensor, torch.Tensor]], plan: Plan, calibration: Calibration,
                     errors: list[float]) -> list[tuple[str, torch.Tensor]]:
    """Layer ``i`` (its float tensors ``raw`` by their names in the block, taken out of the dict as
    they are widened to fp32) made data-aware and quantized: returns its artifact tensors (block
    names) and replaces the inputs ``x`` (B, T, D) by the quantized layer's outputs.

    Held at once: the layer's fp32 weights, ``x``, one sequence's activations and each group's input
    statistics (tokens x width, or width x width when there are more tokens than channels)."""
    prefix = f"layers.{i}."
    groups = scale_groups(config, plan, prefix)
    tensors = {k: raw.pop(k).float() for k in list(raw)}
    block = _block(config, i, tensors)
    rope_i = rope[block.attn.local_rope]
    seen, handles = _record_inputs(block, [g.input for g in groups], x.shape[0] * x.shape[1])
    for b in range(x.shape[0]):
        block(x[b:b + 1], None, *rope_i)
    for h in handles:
        h.remove()
    stats = {name: acc.stats() for name, acc in seen.items()}
    del seen, block
    if groups:
        results = apply_awq(tensors, groups, stats, plan[prefix + groups[0].linears[0]], calibration.clip)
        for name, r in results.items():
            calibration.alphas.setdefault(name, []).append(r.alpha)
            errors[0] += r.rtn_error
            errors[1] += r.error
    del stats
    # Quantized as stored; the next layer's input is this one's output with the stored values.
    out: list[tuple[str, torch.Tensor]] = []
    stored: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        module, _, leaf = name.rpartition(".")
        w = tensors.pop(name)
        if leaf == "weight" and prefix + module in plan:
            scheme: QuantScheme = plan[prefix + module]
            parts = quantize(w, scheme)
            stored[name] = dequantize(parts, scheme)
            out.extend((f"{module}.{k}", t) for k, t in parts.items())
        else:
            stored[name] = w.to(_STORED_FLOAT).float()
            out.append((name, w))
    _forward_inplace(_block(config, i, stored), x, rope_i)
    return out


def _popping(d: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The items of ``d``, each dropped from it as it is handed out (not held after its consumer is done)."""
    while d:
        name = next(iter(d))
        yield name, d.pop(name)
