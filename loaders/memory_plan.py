"""What running a model will take, computed before anything is loaded, against the memory there is.

A plan has five parts (bytes):

* ``weights``: the model as :func:`loaders.load.load_model` will hold it: built on ``meta`` by the same
  code that loads it (:func:`loaders.load.model_tensors`, per-module schemes, a GGUF's exact blocks,
  fused projections, a tied int8 head serving as the embedding), float tensors in the activation dtype;
* ``kv_cache``: the paged KV pool that holds ``concurrency`` sequences of ``ctx`` positions, in the KV
  dtype, as the engine allocates it (:func:`runtime.kv_pool.sequence_pool_plan`: a sliding layer group
  holds its window behind a prefill chunk, a model's layer groups all take blocks of as many layers),
  and the RoPE tables of ``ctx`` positions beside it;
* ``activations``: the largest transient of one forward: a prompt of ``prefill_tokens`` (default: the
  whole context, which ``run``'s one-sequence engine prefills as one chunk: :func:`runtime.engine.sequence_engine`) through an attention
  block or an MLP block, plus each sequence's fp32 logits row (:func:`activation_bytes`);
* ``overhead``: what the runtime adds beyond these (:data:`OVERHEAD_BYTES`, measured);
* ``runtime``: the process itself before any model: interpreter, torch, localllm and its kernels
  (:data:`RUNTIME_BYTES`, measured).

``available`` is the device's free memory: the CPU's available RAM (``psutil``) plus what this process
already holds of its own runtime, or CUDA's free memory (``torch.cuda.mem_get_info``).
``LOCALLLM_AVAILABLE_MEMORY`` (bytes, or a size like ``2GB``, ``1.5GiB``) replaces the probe: a cap for
a user who wants one, and how tests force each branch (on a GPU run it caps the CPU's RAM too).

On a GPU, a Mixture-of-Experts model's experts may stay in CPU RAM (:mod:`loaders.placement`): the
plan puts everything else on the GPU first, then as many layers' experts as fit (or as
``--n-cpu-moe`` / ``--cpu-moe`` say); ``host_weights`` are the experts left in CPU RAM, which the
CPU's available memory must hold beside the process (``host_available``).

A model that does not fit the GPU whole keeps its first blocks in CPU RAM (``--gpu-layers N``, llama.cpp's
``-ngl``: :mod:`loaders.placement`): those blocks' weights (and the embedding table with them) count in
``host_weights`` and the KV pool's tensors allocated in CPU RAM in ``host_kv``, both beside the process
there. Both devices' shares come from :func:`runtime.kv_pool.device_bytes`, which sizes the pool's
allocation too: a model of one layer group shares its pool out by layer, but a layer group's slot whose
layers sit on both sides of the boundary (a split Gemma 3: nearly every slot) keeps a tensor of every
block on each device, so such a split saves no GPU memory on the KV cache and costs as much again in RAM.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from localllm.errors import LocalLLMError
from localllm.format import human_size
from localllm.loaders.placement import (ExpertChoice, LayerChoice, Placement, blocks, expert_layer_bytes,
                                        experts_run_on_host, layer_bytes, own_embed_bytes, weight_bytes)
from localllm.loaders.spec import LoadSpec
from localllm.quant.target import Target
from localllm.runtime.cache import DEFAULT_KV_DTYPE, check_kv_dtype
from localllm.runtime.config import ModelConfig
from localllm.runtime.kv_pool import sequence_pool_device_bytes, sequence_pool_plan

#: The environment variable that replaces the memory probe (bytes or a size such as ``2GB``).
AVAILABLE_ENV = "LOCALLLM_AVAILABLE_MEMORY"

#: The process before any model, per device type. CPU: RSS after importing torch and localllm's
#: commands and building its CPU kernels (243 MB on x86-64 Linux, torch 2.13; ``localllm run smollm2``
#: peaks at 469 MB = this + the int4 model's weights, ctx-4096 cache and transients). CUDA: 0, for the
#: probe (``mem_get_info``) runs after the CUDA context exists, which it then already leaves out.
RUNTIME_BYTES = {"cpu": 243_000_000, "cuda": 0}

#: What the runtime adds beyond weights, KV cache and the forward's activations: load-time conversion
#: buffers (a tensor dequantized and requantized as it streams in), the first forward's workspaces and
#: thread pools, allocator slack. CPU: about the median residual of SmolLM2's measured peak growth
#: (``python -m localllm.bench.memprobe smollm2 --quant S --prompt-tokens 512 --gen-tokens 4 --ctx 520``,
#: x86-64, torch 2.13) over weights + KV cache + activations as computed here: fp32 55, bf16 68, int8 76,
#: int4 67 MB (int8/int4 with fp32 activations; 48 and 43 MB with bf16 ones). CUDA: not measured yet,
#: taken as the same (the caching allocator's rounding and cuBLAS workspaces are of that order).
OVERHEAD_BYTES = {"cpu": 64_000_000, "cuda": 64_000_000}

#: The context ``localllm run`` gives a model when ``--ctx`` is not given (at most the model's own).
RUN_DEFAULT_CTX = 4096

#: Context lengths ``show`` plans for (those below the model's own, and the model's own).
SHOW_CONTEXTS = (2048, 8192, 32768)

#: The smallest context a ``--ctx`` suggestion goes down to.
MIN_SUGGESTED_CTX = 256

#: Smaller weight schemes suggested when a plan does not fit, largest (most faithful) first.
SMALLER_SCHEMES = ("bf16", "int8", "int4")

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class MemoryPlan:
    """What a run needs and what there is (bytes)."""

    scheme: str
    ctx: int
    concurrency: int
    kv_dtype: str
    device: str
    #: The activation dtype (fp32, bf16...): float weights, the "16bit" KV cache and activations are in it.
    dtype: str
    weights: int
    kv_cache: int
    activations: int
    overhead: int
    runtime: int
    available: int
    #: Where ``available`` came from: "psutil", "cuda", or the environment variable's name.
    available_source: str
    #: Of ``weights``, the experts kept in CPU RAM on a GPU run (:mod:`loaders.placement`), and the
    #: CPU's available memory they are checked against (0: nothing placed there).
    host_weights: int = 0
    host_available: int = 0
    #: Where each part lives on a GPU run (None: a CPU run).
    placement: Placement | None = None
    #: Of ``kv_cache``, the CPU blocks' share, in CPU RAM (``--gpu-layers``: :mod:`loaders.placement`).
    host_kv: int = 0

    @property
    def total(self) -> int:
        """What the run needs on its device (weights and KV cache in CPU RAM not counted)."""
        return (self.weights - self.host_weights + self.kv_cache - self.host_kv + self.activations + self.overhead
                + self.runtime)

    @property
    def host_total(self) -> int:
        """What a GPU run with parts in CPU RAM needs there: those weights, the CPU blocks' KV cache and
        the process itself."""
        return self.host_weights + self.host_kv + RUNTIME_BYTES["cpu"] if self.host_weights or self.host_kv else 0

    @property
    def n_cpu_moe(self) -> int:
        """How many first layers' experts are in CPU RAM (0: none)."""
        return self.placement.n_cpu_moe if self.placement is not None and self.placement.split else 0

    @property
    def n_gpu_layers(self) -> int | None:
        """How many last blocks are on the GPU (None: all of them, or a CPU run)."""
        where = self.placement
        return where.n_gpu_layers if where is not None and where.split and where.cpu_layers else None

    @property
    def fits(self) -> bool:
        return self.total <= self.available and self.host_total <= self.host_available

    def breakdown(self) -> str:
        """``int4 weights 97 MB + KV cache 191 MB for ctx 4096 + activations 139 MB + runtime 307 MB``."""
        seqs = f" x {self.concurrency} sequences" if self.concurrency > 1 else ""
        text = (f"{self.scheme} weights {human_size(self.weights - self.host_weights)} + KV cache "
                f"{human_size(self.kv_cache - self.host_kv)} for ctx {self.ctx}{seqs} + activations "
                f"{human_size(self.activations)} "
                f"+ runtime {human_size(self.runtime + self.overhead)}")
        where = self.placement
        if self.host_weights and where is not None and where.cpu_layers:
            more = len([i for i in where.host_layers if i not in where.cpu_layers])  # experts of GPU blocks
            experts = f" and experts of {more} more layer{'s' if more > 1 else ''}" if more else ""
            embed = f" (embedding table {human_size(where.embed_bytes)} of it)" if where.embed_on_host else ""
            text += (f" on {self.device}; {blocks(where.cpu_layers)}{experts} {human_size(self.host_weights)}"
                     f"{embed} + their KV cache {human_size(self.host_kv)} + runtime "
                     f"{human_size(RUNTIME_BYTES['cpu'])} in CPU RAM ({human_size(self.host_available)} available)")
        elif self.host_weights:
            text += (f" on {self.device}; experts of {len(where.host_layers) if where else 0} "
                     f"layers {human_size(self.host_weights)} + runtime {human_size(RUNTIME_BYTES['cpu'])} in CPU RAM "
                     f"({human_size(self.host_available)} available)")
        return text

    def to_dict(self) -> dict[str, Any]:
        out = {**asdict(self), "total": self.total, "fits": self.fits}
        out["placement"] = self.placement.describe() if self.placement is not None else None
        return out


# --------------------------------------------------------------------------- sizes and the probe
def parse_size(text: str) -> int:
    """``2GB``, ``1.5GiB``, ``512m``, ``1000000`` -> bytes (1000-based unless ``iB``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise LocalLLMError(f"cannot read {AVAILABLE_ENV}='{text}'", "write it like 2GB, 1.5GiB or 800000000")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _own_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes a run may use on ``device``, and where the figure comes from.

    The CPU's available RAM counts what this process already holds of its runtime (up to
    :data:`RUNTIME_BYTES`) as available to it, since the plan's total counts the runtime too."""
    override = os.environ.get(AVAILABLE_ENV)
    if override:
        return parse_size(override), AVAILABLE_ENV
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), "cuda"
    import psutil

    return int(psutil.virtual_memory().available) + min(_own_rss(), RUNTIME_BYTES["cpu"]), "psutil"


# --------------------------------------------------------------------------- the parts
def kv_cache_bytes(config: ModelConfig, ctx: int, concurrency: int, kv_dtype: str, act_dtype: torch.dtype) -> int:
    """The KV pool a run of ``concurrency`` sequences of ``ctx`` positions allocates
    (:func:`runtime.kv_pool.sequence_pool_plan`: sliding layers' groups at their window behind a prefill
    chunk), and the RoPE tables (:func:`rope_bytes`)."""
    return sequence_pool_plan(config, act_dtype, ctx, kv_dtype, concurrency).bytes + rope_bytes(config, ctx, act_dtype)


def rope_bytes(config: ModelConfig, ctx: int, act_dtype: torch.dtype) -> int:
    """The RoPE tables beside the KV cache: cos and sin, ``ctx`` x rotary dims, local ones beside global
    ones when a model has both."""
    tables = 2 if config.rope_local_theta is not None else 1
    return tables * 2 * ctx * config.rotary_dim * act_dtype.itemsize


def activation_bytes(config: Any, tokens: int, concurrency: int, act_size: int) -> int:
    """The largest transient of a forward over ``tokens`` positions (all sequences' together).

    Attention block: the residual, its norm, the fused q|k|v, rotated q|k, the attention output and its
    reshaped copy, the projection. MLP block: the residual and its sum, the norm, gate|up, the activated
    gate, the product, the projection. Plus each sequence's logits row in fp32 and sampling's copy.
    (Causal SDPA on the CPU runs in tiles: no tokens x tokens score matrix; soft-capped attention
    writes its scores out, so those count when a model has it.)
    """
    d, q, kv, inter = config.dim, config.q_dim, config.kv_dim, config.intermediate_size
    attn = 3 * d + (q + 2 * kv) + (q + kv) + 2 * q
    mlp = 4 * d + 4 * inter
    per_token = max(attn, mlp) * act_size
    if config.is_moe:  # a sparse layer: the router's fp32 logits and weights, the expert kernel's fp32
        # gathered rows and results (k of each), their gate|up and activated product, the sum; beside
        # the residual and its norm, and a shared expert's MLP
        k, inter_e = config.n_active, config.expert_size
        routed = 4 * (2 * config.n_experts + k * (2 * d + 3 * inter_e) + d)
        shared = 4 * (config.shared_expert_size or 0) * act_size
        per_token = max(per_token, 3 * d * act_size + routed + shared)
    scores = 0
    if config.attn_softcap is not None:
        scores = 2 * config.n_heads * tokens * tokens * 4
    logits = 2 * concurrency * config.vocab_size * 4
    return tokens * per_token + scores + logits


#: Of a GPU's free memory after a model is loaded, what a server's KV pool leaves for CUDA graphs'
#: pools, cuBLAS and Triton workspaces and allocator slack (vLLM leaves 10% of the card likewise).
GPU_RESERVE = 0.10


def gpu_kv_budget(config: Any, act_dtype: torch.dtype, kv_dtype: str, parallel: int, chunk_tokens: int,
                  free: int) -> int:
    """The KV pool a server gives a model loaded on a GPU when ``--kv-memory`` is not set: room for
    ``parallel`` sequences of the model's context (at most :data:`RUN_DEFAULT_CTX` positions), as much
    of it as fits in ``free`` (the card's free memory with the model loaded) less a step's activations
    (``chunk_tokens`` prompt tokens beside ``parallel`` decode rows) and :data:`GPU_RESERVE` of it.
    At least one block's worth is asked for: a pool too small for a request refuses it with the fix."""
    act = act_dtype.itemsize
    ctx = min(config.max_seq_len, RUN_DEFAULT_CTX)
    wanted = kv_cache_bytes(config, ctx, parallel, kv_dtype, act_dtype)
    room = int(free * (1 - GPU_RESERVE)) - activation_bytes(config, chunk_tokens + parallel, parallel, act)
    return max(min(wanted, room), kv_cache_bytes(config, 16, 1, kv_dtype, act_dtype))


# --------------------------------------------------------------------------- the model's weights
@dataclass(frozen=True)
class Footprint:
    """What a checkpoint in one scheme is before any context: its config, weights and dtypes."""

    config: Any
    scheme: str
    weights: int
    act_dtype: torch.dtype
    device: torch.device
    #: Each block's experts' bytes (0: a dense block; empty: a dense model), for their placement.
    expert_bytes: tuple[int, ...] = ()
    #: The experts run on the CPU's kernel only (GGUF blocks: :func:`loaders.placement.experts_run_on_host`).
    experts_on_host: bool = False
    #: Each block's bytes, and the embedding table's when it is a table of its own (it goes to CPU RAM
    #: with the first block: :func:`loaders.placement.own_embed_bytes`), for ``--gpu-layers``.
    layer_bytes: tuple[int, ...] = ()
    embed_bytes: int = 0


def meta_weight_bytes(model: torch.nn.Module, act_dtype: torch.dtype) -> int:
    """Bytes of ``model`` (on ``meta``) once loaded: parameters in the activation dtype, buffers in their
    own (a quantized layer's packed tensors), a tied float head counted once with the embedding."""
    total = weight_bytes(model, act_dtype)
    config = getattr(model, "config", None)
    head, embed = getattr(model, "output", None), getattr(model, "embed", None)
    head_w, embed_w = getattr(head, "weight", None), getattr(embed, "weight", None)
    if config is not None and config.tie_embeddings and isinstance(head_w, torch.nn.Parameter) \
            and embed_w is not None and head_w is not embed_w:
        total -= head_w.numel() * act_dtype.itemsize  # tied at load: one tensor
    return total


def footprint(ckpt: Any, spec: LoadSpec) -> Footprint:
    """The weights of ``ckpt`` (``spec``'s checkpoint, opened) as :func:`loaders.load.load_model` would
    hold them loaded as ``spec`` says, from its meta model."""
    from localllm.loaders.build import fuse_projections
    from localllm.loaders.load import dtype_name, meta_model, resolve_device

    dev = spec.device.device if isinstance(spec.device, Target) else resolve_device(spec.device)
    meta = meta_model(ckpt, spec, dev)
    model, act, scheme = meta.model, meta.act, meta.scheme
    del meta  # its stream, unread
    fuse_projections(model)
    label = scheme.name if scheme is not None else dtype_name(act)
    return Footprint(ckpt.config, label, meta_weight_bytes(model, act), act, dev, expert_layer_bytes(model, act),
                     experts_run_on_host(model), layer_bytes(model, act), own_embed_bytes(model, act))


def plan_for(fp: Footprint, ctx: int, *, concurrency: int = 1, kv_dtype: str = DEFAULT_KV_DTYPE,
             prefill_tokens: int | None = None, available: tuple[int, str] | None = None,
             experts: ExpertChoice = ExpertChoice(), host_available: tuple[int, str] | None = None,
             layers: LayerChoice = LayerChoice()) -> MemoryPlan:
    """The plan of a footprint at ``ctx`` (cheap: no model is built).

    On a GPU, a MoE model's experts are placed (:mod:`loaders.placement`) as ``experts`` says; automatic:
    the fewest first layers' experts in CPU RAM whose plan fits the GPU (all of them when none does).
    Then the blocks, as ``layers`` says (``--gpu-layers N``: the last N on the GPU); automatic: all of
    them when that fits, else the most last blocks that fit (none when even that does not); with the
    experts placed by a flag, all of them.
    ``host_available``: the CPU's memory those are checked against (default: probed)."""
    config, act_size = fp.config, fp.act_dtype.itemsize
    kv_dtype = check_kv_dtype(kv_dtype)
    tokens = min(prefill_tokens if prefill_tokens is not None else ctx, ctx)
    avail, source = available if available is not None else available_memory(fp.device)
    dev = fp.device.type
    plan = MemoryPlan(
        scheme=fp.scheme, ctx=ctx, concurrency=concurrency, kv_dtype=kv_dtype, device=str(fp.device),
        dtype=str(fp.act_dtype).removeprefix("torch."),
        weights=fp.weights,
        kv_cache=kv_cache_bytes(config, ctx, concurrency, kv_dtype, fp.act_dtype),
        activations=activation_bytes(config, tokens, concurrency, act_size),
        overhead=OVERHEAD_BYTES.get(dev, OVERHEAD_BYTES["cuda"]),
        runtime=RUNTIME_BYTES.get(dev, 0),
        available=avail, available_source=source,
    )
    if dev != "cuda":
        return plan  # a CPU run: every part in RAM already
    if not any(fp.expert_bytes) and layers.automatic and plan.fits:  # a dense model that fits: placed whole
        whole = Placement(str(fp.device), (0,) * config.n_layers, 0, "automatic", avail, None, fp.layer_bytes,
                          fp.embed_bytes)
        return replace(plan, placement=whole)
    host, _ = host_available if host_available is not None else available_memory(torch.device("cpu"))
    n_layers = config.n_layers
    experts_of = fp.expert_bytes or (0,) * n_layers

    def placed(n: int, chosen_by: str, gpu_layers: int | None = None, layers_by: str = "automatic") -> MemoryPlan:
        where = Placement(str(fp.device), experts_of, n, chosen_by, avail,
                          None if gpu_layers is None or gpu_layers >= n_layers else gpu_layers,
                          fp.layer_bytes, fp.embed_bytes, layers_by)
        cpu = set(where.cpu_layers)
        if not cpu:
            return replace(plan, host_weights=where.host_bytes, host_available=host, placement=where)
        # the pool as allocate makes it on each device (a layer group's slot shared across the
        # boundary has a full tensor on both: runtime.kv_pool.device_bytes)
        host_dev = torch.device("cpu")
        pool = sequence_pool_device_bytes(config, fp.act_dtype, ctx,
                                          [host_dev if i in cpu else fp.device for i in range(n_layers)],
                                          kv_dtype, concurrency)
        kv = rope_bytes(config, ctx, fp.act_dtype) + sum(pool.values())
        return replace(plan, host_weights=where.host_bytes, host_available=host, placement=where,
                       kv_cache=kv, host_kv=pool.get(host_dev, 0))

    def fits_gpu(p: MemoryPlan) -> bool:
        return p.total <= p.available

    if not experts.automatic:
        n = experts.layers(n_layers)
        best = placed(n, experts.flag(n, n_layers))
    elif fp.experts_on_host:
        best = placed(n_layers, "automatic: no GPU kernel multiplies GGUF-block experts yet, the CPU's does")
    else:
        for n in range(n_layers + 1):  # the GPU first: the fewest first layers' experts in CPU RAM that fit
            if n and not experts_of[n - 1]:
                continue  # a dense layer: nothing more moves
            best = placed(n, "automatic")
            if fits_gpu(best) or not any(experts_of):
                break
    assert best.placement is not None
    if len(fp.layer_bytes) != n_layers:
        return best  # blocks' sizes not known (a footprint made by hand): every block on the GPU
    moe = (best.placement.n_cpu_moe, best.placement.chosen_by)
    if not layers.automatic:
        n = layers.layers(n_layers)
        return placed(*moe, n, f"--gpu-layers {layers.gpu_layers}")
    if fits_gpu(best) or not experts.automatic:
        return best  # (experts placed by a flag: blocks move only by --gpu-layers, cheaper fixes first)
    for n in range(n_layers - 1, -1, -1):  # the most last blocks on the GPU that fit beside the head
        best = placed(*moe, n)
        if fits_gpu(best):
            return best
    return best


def plan_memory(spec: LoadSpec | str, quant: str | None = None, ctx: int | None = None, *, concurrency: int = 1,
                prefill_tokens: int | None = None, **options: Any) -> MemoryPlan:
    """The plan for running ``spec`` (a :class:`LoadSpec`, or a reference as ``run`` takes it with
    LoadSpec's other fields as keywords) in ``quant`` (None: as ``spec`` says, else the checkpoint's
    own) with a context of ``ctx`` (None: ``run``'s default)."""
    spec = LoadSpec.of(spec, **options, **({"quant": quant} if quant is not None else {}))
    fp = footprint(_open(spec.ref), spec)
    ctx = ctx if ctx is not None else min(fp.config.max_seq_len, RUN_DEFAULT_CTX)
    return plan_for(fp, ctx, concurrency=concurrency, kv_dtype=spec.kv_dtype, prefill_tokens=prefill_tokens,
                    experts=ExpertChoice(spec.cpu_moe, spec.n_cpu_moe), layers=LayerChoice(spec.gpu_layers))


def _open(ref: str) -> Any:
    from localllm.loaders.load import open_checkpoint

    return open_checkpoint(ref)


# --------------------------------------------------------------------------- not enough memory
def largest_fitting_ctx(fp: Footprint, ctx: int, available: tuple[int, str], **kw: Any) -> int | None:
    """The largest context below ``ctx`` (a multiple of 256, at least :data:`MIN_SUGGESTED_CTX`) whose plan fits."""
    lo, hi = MIN_SUGGESTED_CTX // 256, (ctx - 1) // 256
    if hi < lo or not plan_for(fp, lo * 256, available=available, **kw).fits:
        return None
    while lo < hi:  # the plan grows with ctx: bisect on the multiples of 256
        mid = (lo + hi + 1) // 2
        if plan_for(fp, mid * 256, available=available, **kw).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * 256


def cheapest_fix(ckpt: Any, plan: MemoryPlan, fp: Footprint, spec: LoadSpec, *, kv_cache_flag: bool = False) -> str:
    """The cheapest change that fits: more layers' experts in CPU RAM (``--n-cpu-moe``, where the user
    gave fewer), else fewer blocks on the GPU (``--gpu-layers``, where the user gave more or placed the
    experts by a flag), else a smaller ``--ctx``, else a smaller ``--quant``, else an int8 KV cache (when
    ``kv_cache_flag``: the flag exists), else the smallest scheme at the smallest context."""
    avail = (plan.available, plan.available_source)
    kw: dict[str, Any] = dict(concurrency=plan.concurrency, kv_dtype=plan.kv_dtype)
    where = plan.placement
    if where is not None:
        kw["host_available"] = (plan.host_available, plan.available_source)
        n_layers = len(where.expert_bytes)
        if where.chosen_by != "automatic":
            kw["experts"] = ExpertChoice(n_cpu_moe=where.n_cpu_moe)
            auto = plan_for(fp, plan.ctx, available=avail, **{**kw, "experts": ExpertChoice()})
            if auto.fits and auto.placement is not None and auto.placement.n_cpu_moe > where.n_cpu_moe \
                    and not auto.placement.cpu_layers:
                return f"use {ExpertChoice().flag(auto.placement.n_cpu_moe, n_layers)}, or free memory"
        gpu = where.n_gpu_layers if where.n_gpu_layers is not None else n_layers
        kw["layers"] = LayerChoice(gpu)
        for n in range(gpu - 1, -1, -1) if len(fp.layer_bytes) == n_layers else ():  # the most blocks that fit
            if plan_for(fp, plan.ctx, available=avail, **{**kw, "layers": LayerChoice(n)}).fits:
                return f"use --gpu-layers {n}, or free memory"
    ctx = largest_fitting_ctx(fp, plan.ctx, avail, **kw)
    if ctx is not None:
        return f"use --ctx {ctx} (or less), or free memory"
    smaller = [s for s in SMALLER_SCHEMES if s != plan.scheme]
    # another scheme takes its own default group
    prints = [footprint(ckpt, replace(spec, quant=s, group_size=None, device=plan.device)) for s in smaller]
    prints = [p for p in prints if p.weights < fp.weights]
    for p in prints:
        if plan_for(p, plan.ctx, available=avail, **kw).fits:
            return f"use --quant {p.scheme}, or free memory"
    if kv_cache_flag and plan.kv_dtype != "int8":
        if plan_for(fp, plan.ctx, available=avail, **{**kw, "kv_dtype": "int8"}).fits:
            return "use --kv-cache int8, or free memory"
    for p in prints[::-1]:  # the smallest scheme with a shorter context
        ctx = largest_fitting_ctx(p, plan.ctx, avail, **kw)
        if ctx is not None:
            return f"use --quant {p.scheme} --ctx {ctx}, or free memory"
    return "free memory, or run a smaller model"


def check_memory(spec: LoadSpec, ctx: int | None = None, *, concurrency: int = 1,
                 kv_cache_flag: bool = False) -> MemoryPlan:
    """The plan for running ``spec`` with a context of ``ctx`` (None: ``run``'s default); a
    :class:`LocalLLMError` with its numbers and the cheapest fix when it does not fit."""
    ckpt = _open(spec.ref)
    fp = footprint(ckpt, spec)
    ctx = ctx if ctx is not None else min(fp.config.max_seq_len, RUN_DEFAULT_CTX)
    plan = plan_for(fp, ctx, concurrency=concurrency, kv_dtype=spec.kv_dtype,
                    experts=ExpertChoice(spec.cpu_moe, spec.n_cpu_moe), layers=LayerChoice(spec.gpu_layers))
    if plan.fits:
        return plan
    raise LocalLLMError(refusal(spec.ref, plan), cheapest_fix(ckpt, plan, fp, spec, kv_cache_flag=kv_cache_flag))


def refusal(ref: str, plan: MemoryPlan) -> str:
    """The line a plan that does not fit is refused with: what it needs, and what there is."""
    source = f" ({AVAILABLE_ENV})" if plan.available_source == AVAILABLE_ENV else ""
    text = f"{ref} needs {human_size(plan.total)} ({plan.breakdown()}), {human_size(plan.available)} available{source}"
    if (plan.host_weights or plan.host_kv) and plan.host_total > plan.host_available:
        text += f"; in CPU RAM {human_size(plan.host_total)}, {human_size(plan.host_available)} available{source}"
    return text


def show_plans(ckpt: Any, quant: str | None = None) -> list[dict[str, Any]]:
    """``show``'s plans: the checkpoint's own scheme on the CPU at a few context lengths and its own;
    on the GPU where one is visible, with its experts and blocks placed (:mod:`loaders.placement`)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fp = footprint(ckpt, LoadSpec(ckpt.describe(), device=device, quant=quant))
    top = fp.config.max_seq_len
    contexts = [c for c in SHOW_CONTEXTS if c < top] + [top]
    avail = available_memory(fp.device)
    return [plan_for(fp, c, available=avail).to_dict() for c in contexts]
