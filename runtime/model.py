"""The Llama-family transformer (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3; and with sparse MLP
layers, :class:`runtime.moe.MoE`, Qwen3-MoE, Qwen2-MoE and Mixtral).

Parameter names (the checkpoint loaders map to these)::

    embed.weight
    layers.{i}.attn_norm.weight
    layers.{i}.attn.{q,k,v}.weight  (+ .bias when config.attention_bias)
    layers.{i}.attn.{q,k}_norm.weight  (config.qk_norm: Qwen3, Gemma 3; OLMoE's (q_dim,), (kv_dim,))
    layers.{i}.attn.o.weight  (+ .bias when config.o_bias: gpt-oss)
    layers.{i}.attn.sinks      (H,) config.attn_sinks (gpt-oss): each head's sink logit (activation dtype)
    layers.{i}.post_attn_norm.weight   (config.post_norms: Gemma 3)
    layers.{i}.mlp_norm.weight
    layers.{i}.mlp.{gate,up,down}.weight  (a sparse layer's router and experts: see runtime/moe.py)
    layers.{i}.post_mlp_norm.weight    (config.post_norms)
    norm.weight
    output.weight                   (the same tensor as embed.weight when tied)

A layer with a sliding window (Mistral, Phi-3: every layer; Gemma 3: five of every six) attends to
the last ``window`` positions only (the paged pool keeps only those blocks: :mod:`runtime.kv_pool`).

No device or dtype is hard-wired: build on ``meta``, ``load_state_dict(assign=True)``.

The model holds no per-sequence state. Every generation runs in the batch engine
(:mod:`runtime.batch`), which passes each forward a :class:`runtime.paged.PagedStep`: the step's
sequences, their block tables in the engine's paged KV pool and where the new keys/values go.
Attention itself is :func:`runtime.attention.attend`'s. Without one, a forward is one whole sequence from position 0 that reads and
writes nothing outside the call (perplexity windows, the transformers comparison).
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable

import torch
from torch import nn

from localllm.runtime import attention, pointwise
from localllm.runtime.config import SLIDING, ModelConfig
from localllm.runtime.moe import MoE
from localllm.runtime.paged import PagedLayer, PagedStep

class Linear(nn.Linear):
    """``nn.Linear`` without random initialisation: every weight comes from a checkpoint.

    (Initialising on ``meta`` is not only wasted work: it goes through torch's reference ops, whose
    first use imports ``torch._dynamo``, some 0.8 s of a cold start.)
    """

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """``nn.Embedding`` without random initialisation (see :class:`Linear`). Its table loads in the
    activation dtype, like every float parameter, unless :meth:`hold_table` sets it apart."""

    def reset_parameters(self) -> None:
        pass

    def hold_table(self, dtype: torch.dtype) -> None:
        """Hold the table in ``dtype`` whatever the activations' dtype (a 16-bit table beside fp32
        activations on the CPU, where widening a looked-up row costs nothing and a table in fp32 would
        double the model's largest tensor). On ``meta``, before loading: the table becomes a buffer, as
        a quantized layer's tensors are, which the loader fills and the weight counts take in its own
        dtype. The rows it looks up come out in ``dtype``; the model casts them."""
        weight = self._parameters.pop("weight")
        self.register_buffer("weight", torch.empty(weight.shape, dtype=dtype, device=weight.device))


class RMSNorm(nn.Module):
    """RMSNorm in fp32. ``offset`` 0: Llama's ``w * x`` (cast before the product); 1: Gemma's
    ``x * (1 + w)`` (product in fp32, then cast)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pointwise.rms_norm(x, self.weight, self.eps, self.offset)


def _uses_local_rope(config: ModelConfig, layer: int) -> bool:
    """Whether ``layer`` takes the sliding layers' RoPE base (Gemma 3's local layers)."""
    return config.rope_local_theta is not None and config.layer_types is not None and \
        config.layer_types[layer] == SLIDING


def rope_inv_freq(config: ModelConfig, local: bool = False, max_seq: int | None = None) -> torch.Tensor:
    """Inverse frequencies (rotary_dim/2,) in fp32, with a GGUF's frequency factors, llama3, linear or
    longrope scaling applied. ``local``: the sliding layers' base (Gemma 3), never scaled.
    ``max_seq``: the longest sequence the table serves; longrope takes its long factors beyond the
    original context (as transformers does for such a sequence), its short ones otherwise."""
    hd = config.rotary_dim
    base = config.rope_local_theta if local and config.rope_local_theta is not None else config.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if local and config.rope_local_theta is not None:
        return inv.float()
    if config.rope_freq_factors is not None:  # llama.cpp: theta_i = pos * base^(-2i/d) / factors[i]
        inv = inv / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    s = config.rope_scaling
    if s is None:
        return inv.float()
    if s["rope_type"] == "linear":
        return (inv / float(s["factor"])).float()
    if s["rope_type"] == "yarn":
        return yarn_inv_freq(config)
    if s["rope_type"] == "longrope":
        long = max_seq is not None and max_seq > int(s["original_max_position_embeddings"])
        factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float64)
        return (inv / factors).float()
    # llama3: leave high frequencies, divide low ones by `factor`, blend in between.
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, blended, out).float()


def yarn_inv_freq(config: ModelConfig) -> torch.Tensor:
    """YaRN's inverse frequencies (rotary_dim/2,) fp32, as transformers computes them (in fp32): the
    high frequencies kept (extrapolated), the low ones divided by ``factor`` (interpolated), a linear
    ramp between the dims that make ``beta_fast`` and ``beta_slow`` turns over the original context
    (the ramp's ends floored/ceiled unless ``truncate`` is false)."""
    s = config.rope_scaling
    assert s is not None
    dim, base = config.rotary_dim, config.rope_theta
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(turns: float) -> float:
        return (dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # (rot/2,) 1: keep the frequency, 0: interpolate it
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor longrope and YaRN multiply cos and sin by (1 for every other RoPE)."""
    s = config.rope_scaling
    if s is not None and s["rope_type"] == "yarn":
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        factor, mscale, mscale_all = float(s["factor"]), s.get("mscale"), s.get("mscale_all_dim")

        def get_mscale(m: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        return get_mscale(mscale) / get_mscale(mscale_all) if mscale and mscale_all else get_mscale()
    if s is None or s["rope_type"] != "longrope":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    original = float(s["original_max_position_embeddings"])
    factor = s.get("factor") or float(s.get("max_position_embeddings") or config.max_seq_len) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_rows(config: ModelConfig, positions: torch.Tensor, max_seq: int,
              local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (N, rotary_dim) in fp32 for ``positions`` (N,), in the half-split (rotate_half) layout."""
    inv = rope_inv_freq(config, local, max_seq).to(positions.device, non_blocking=True)  # a blocking upload waits for the GPU
    freqs = torch.outer(positions.float(), inv)  # (N, rot/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (N, rot)
    scale = 1.0 if local else rope_attention_factor(config)
    if scale != 1.0:
        return emb.cos() * scale, emb.sin() * scale
    return emb.cos(), emb.sin()


def rope_tables(config: ModelConfig, max_seq: int, device: torch.device,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (max_seq, rotary_dim) in fp32 (the global layers' unless ``local``)."""
    return rope_rows(config, torch.arange(max_seq, device=device), max_seq, local)


def cache_rope_tables(config: ModelConfig, max_seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global tables, and beside them (last axis) the local ones when the sliding layers have a
    base of their own: what a :class:`runtime.paged.PagedStep` carries (rows of them), split again by :meth:`Transformer._split_rope`."""
    cos, sin = rope_tables(config, max_seq, device)
    if config.rope_local_theta is None:
        return cos, sin
    lcos, lsin = rope_tables(config, max_seq, device, local=True)
    return torch.cat([cos, lcos], dim=-1), torch.cat([sin, lsin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q = Linear(config.dim, config.q_dim, bias=bias)
        self.k = Linear(config.dim, config.kv_dim, bias=bias)
        self.v = Linear(config.dim, config.kv_dim, bias=bias)
        self.o = Linear(config.q_dim, config.dim, bias=config.o_bias)
        full = config.qk_norm_full  # OLMoE: over the whole projection, not per head
        self.q_norm = RMSNorm(config.q_dim if full else config.head_dim, config.norm_eps,
                              config.norm_offset) if config.qk_norm else None
        self.k_norm = RMSNorm(config.kv_dim if full else config.head_dim, config.norm_eps,
                              config.norm_offset) if config.qk_norm else None
        self.qk_norm_full, self.clip_qkv = full, config.clip_qkv
        #: q, k and v as one matmul, set by loaders.build.fuse_projections (then q, k, v are removed).
        self.qkv: nn.Module | None = None
        self.q_dim, self.kv_dim = config.q_dim, config.kv_dim
        #: This layer's attention window (None: the whole context) and RoPE tables (local or global).
        self.window = config.layer_window(layer)
        self.local_rope = _uses_local_rope(config, layer)
        default = config.head_dim ** -0.5  # type: ignore[operator]
        self.scale = config.attn_scale if config.attn_scale not in (None, default) else None
        #: What q is multiplied by before a kernel that scales by head_dim ** -0.5 (1.0: nothing).
        self.q_prescale = (self.scale / default) if self.scale is not None else 1.0
        self.softcap = config.attn_softcap
        #: gpt-oss's sink logits (H,): each joins its head's softmax denominator (runtime.attention).
        self.sinks = nn.Parameter(torch.empty(config.n_heads, dtype=torch.float32), requires_grad=False) \
            if config.attn_sinks else None

    @property
    def takes_kernels(self) -> bool:
        """Whether the paged attention kernels can run this layer: not with soft-capped scores or sinks
        (those take the reference path over gathered keys: :func:`runtime.attention.paged`)."""
        return self.softcap is None and self.sinks is None

    def _project(self, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, hd), k, v (B, KV, T, hd): projected, q/k-normed per head, rotated."""
        B, T, _ = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)  # (B, T, (H + 2 KV) hd)
            if self.q_norm is None and self.clip_qkv is None:  # q and k are adjacent: rotate them in one go.
                qk = pointwise.rope(qkv[..., : (H + KV) * hd].view(B, T, H + KV, hd).transpose(1, 2), cos, sin)
                v = qkv[..., (H + KV) * hd :].view(B, T, KV, hd).transpose(1, 2)
                return qk[:, :H], qk[:, H:], v
            q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        if self.qk_norm_full and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # (B, T, H hd), (B, T, KV hd)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k = q.view(B, T, H, hd), k.view(B, T, KV, hd)
        if not self.qk_norm_full and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = pointwise.rope(q.transpose(1, 2), cos, sin)  # (B, H, T, hd)
        k = pointwise.rope(k.transpose(1, 2), cos, sin)  # (B, KV, T, hd)
        return q, k, v.reshape(B, T, KV, hd).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, D)
        kv: PagedLayer | None,  # this layer's view of the step's paged pool; None: a whole sequence alone
        cos: torch.Tensor,  # (T, rot)
        sin: torch.Tensor,  # (T, rot)
    ) -> torch.Tensor:
        q, k, v = self._project(x, cos, sin)
        return self.o(attention.attend(q, k, v, kv, self.window, self.q_prescale, self.scale, self.softcap,
                                       self.sinks))


def round_to(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded (to nearest, ties to even) to ``dtype``'s precision, as a Python float: worked
    out on the host, so a forward makes no tensor (and reads none back) for it."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]  # fp32 first, as torch.tensor(value) would
    if dtype == torch.bfloat16:
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    elif dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", struct.unpack("<f", struct.pack("<I", bits))[0]))[0]
    return struct.unpack("<f", struct.pack("<I", bits))[0]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, size: int | None = None) -> None:
        super().__init__()
        size = config.intermediate_size if size is None else size  # a MoE's shared expert has its own
        self.gate = Linear(config.dim, size, bias=False)
        self.up = Linear(config.dim, size, bias=False)
        self.down = Linear(size, config.dim, bias=False)
        #: gate and up as one matmul, set by loaders.build.fuse_projections.
        self.gate_up: nn.Module | None = None
        self.gelu = config.mlp_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return self.down(pointwise.glu(self.gate_up(x), self.gelu))
        return self.down(pointwise.activation(self.gate(x), self.gelu) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        norm = config.norm_offset
        self.attn_norm = RMSNorm(config.dim, config.norm_eps, norm)
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps, norm)
        self.mlp: nn.Module = MoE(config) if config.is_moe_layer(layer) else MLP(config)
        self.post_attn_norm = RMSNorm(config.dim, config.norm_eps, norm) if config.post_norms else None
        self.post_mlp_norm = RMSNorm(config.dim, config.norm_eps, norm) if config.post_norms else None

    def forward(self, x: torch.Tensor, kv: PagedLayer | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.attn_norm(x), kv, cos, sin)
        h = x + (self.post_attn_norm(a) if self.post_attn_norm is not None else a)
        m = self.mlp(self.mlp_norm(h))
        return h + (self.post_mlp_norm(m) if self.post_mlp_norm is not None else m)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        self.output = Linear(config.dim, config.vocab_size, bias=False)
        #: Whether any layer rotates with the local base (its tables sit beside the global ones).
        self._local_rope = any(layer.attn.local_rope for layer in self.layers)
        #: :meth:`layer_devices` once the blocks are placed (None: not read yet, or moved since).
        self._layer_devices: tuple[torch.device, ...] | None = None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (that of the norms, which are never quantized)."""
        return self.norm.weight.dtype

    def layer_devices(self) -> tuple[torch.device, ...]:
        """Each block's device: the model's, but for the first blocks of a model split by
        ``--gpu-layers`` (:mod:`loaders.placement`), which live and compute in CPU RAM. Read once the
        blocks are placed (off ``meta``) and kept, for every paged step asks; moving the model
        (``.to()``, ``.cuda()``: :meth:`_apply`) reads it again."""
        if self._layer_devices is not None:
            return self._layer_devices
        devices = tuple(layer.attn_norm.weight.device for layer in self.layers)
        if all(d.type != "meta" for d in devices):
            self._layer_devices = devices
        return devices

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "Transformer":
        self._layer_devices = None  # .to() and the like may move blocks
        return super()._apply(fn, recurse)

    @property
    def split(self) -> bool:
        """Whether some blocks live on another device than the head (their KV cache with them)."""
        return any(d != self.device for d in self.layer_devices())

    def tie_weights(self) -> None:
        """Make the output head share the embedding's tensor (no copy)."""
        self.output.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, step: PagedStep | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits (B, T, vocab) for a whole sequence ``tokens`` (B, T) from position 0, reading and
        writing nothing outside this call; (B, 1, vocab) for the last position alone with
        ``last_only`` (the head is the largest matmul).

        With a :class:`runtime.paged.PagedStep`, ``tokens`` (1, N) are the step's flattened batch and
        the logits are those of its ``logits_rows``, (1, S_out, vocab) (see :meth:`forward_paged`).
        """
        if step is not None:
            return self.forward_paged(tokens, step)
        x = self._layers(tokens)  # (B, T, D)
        if last_only:
            x = x[:, -1:]  # (B, 1, D)
        return self._head(x)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states (B, T, D), after the last norm (what embeddings pool), of whole
        sequences ``tokens`` (B, T) from position 0, with no cache."""
        return self.norm(self._layers(tokens))

    def _layers(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        ropes: dict[torch.device, dict[bool, tuple[torch.Tensor, torch.Tensor]]] = {}
        x = self._embed(tokens.to(self._embed_device()))  # (B, T, D)
        for layer, device in zip(self.layers, self.layer_devices()):
            x = _to(x, device)  # a split model's hidden state crosses between its devices
            if device not in ropes:
                cos, sin = cache_rope_tables(self.config, T, device)
                ropes[device] = self._split_rope(cos.to(self.dtype), sin.to(self.dtype))  # (T, rot) each
            x = layer(x, None, *ropes[device][layer.attn.local_rope])
        return _to(x, self.device)

    def _embed_device(self) -> torch.device:
        """Where the embedding table is: with the first block of a split model, unless it is the head's."""
        table = next(itertools.chain(self.embed.parameters(), self.embed.buffers()), None)
        return table.device if table is not None else self.device

    def _split_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """local? -> (cos, sin) from tables that carry the local ones beside the global ones."""
        if not self._local_rope:
            return {False: (cos, sin)}
        rot = self.config.rotary_dim
        return {False: (cos[..., :rot], sin[..., :rot]), True: (cos[..., rot:], sin[..., rot:])}

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings (B, T, D), times Gemma's sqrt(dim) rounded to the activation dtype first."""
        x = self.embed(tokens).to(self.dtype)  # a table held apart (Embedding.hold_table) is widened here
        if self.config.embed_scale is None:
            return x
        # A Python scalar rounded to x's dtype: the product equals transformers' (a tensor of that dtype).
        return x * round_to(self.config.embed_scale, x.dtype)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the final hidden states (soft-capped when the model says so)."""
        logits = self.output(self.norm(x))
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward_paged(self, tokens: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """Logits (1, S_out, vocab) of ``step.logits_rows`` for the flattened batch ``tokens`` (1, N):
        every linear layer runs once over all N rows, attention per sequence (:func:`runtime.attention.attend`).
        Each layer attends with its own window and RoPE rows (the step carries rows of
        :func:`cache_rope_tables`: the local layers' beside the global ones)."""
        embed = self._embed_device()
        x = self._embed(tokens if embed == tokens.device else step.on(embed).ids)  # (1, N, D)
        ropes: dict[torch.device, dict[bool, tuple[torch.Tensor, torch.Tensor]]] = {}
        for i, (layer, device) in enumerate(zip(self.layers, self.layer_devices())):
            # a split model's CPU blocks read the step's host copy (its pool tensors, kernels, tables)
            s = step.on(device)
            x = _to(x, device)  # the hidden state crosses to the GPU once, at the boundary
            if device not in ropes:
                ropes[device] = self._split_rope(s.cos, s.sin)  # rows of cache_rope_tables: the local ones beside
            x = layer(x, s.layer(i, layer.attn.window), *ropes[device][layer.attn.local_rope])
        x = _to(x, self.device)[:, step.logits_rows]  # (1, S_out, D)
        return self._head(x)


def _to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device``: up to a GPU without blocking (the stream orders it before its readers); down to
    the host blocking, since a non-blocking copy there may be read before it lands."""
    if x.device == device:
        return x
    return x.to(device, non_blocking=device.type != "cpu")
