"""The Llama-family transformer (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3).

Parameter names (the checkpoint loaders map to these)::

    embed.weight
    layers.{i}.attn_norm.weight
    layers.{i}.attn.{q,k,v}.weight  (+ .bias when config.attention_bias)
    layers.{i}.attn.{q,k}_norm.weight  (config.qk_norm: Qwen3, Gemma 3)
    layers.{i}.attn.o.weight
    layers.{i}.post_attn_norm.weight   (config.post_norms: Gemma 3)
    layers.{i}.mlp_norm.weight
    layers.{i}.mlp.{gate,up,down}.weight
    layers.{i}.post_mlp_norm.weight    (config.post_norms)
    norm.weight
    output.weight                   (the same tensor as embed.weight when tied)

A layer with a sliding window (Mistral, Phi-3: every layer; Gemma 3: five of every six) attends to
the last ``window`` positions only (the paged pool keeps only those blocks: :mod:`runtime.kv_pool`).

No device or dtype is hard-wired: build on ``meta``, ``load_state_dict(assign=True)``.

The model holds no per-sequence state. Every generation runs in the batch engine
(:mod:`runtime.batch`), which passes each forward a :class:`runtime.paged.PagedStep`: the step's
sequences, their block tables in the engine's paged KV pool and where the new keys/values go
(:func:`paged_attention`). Without one, a forward is one whole sequence from position 0 that reads and
writes nothing outside the call (perplexity windows, the transformers comparison).
"""

from __future__ import annotations

import math
import struct

import torch
import torch.nn.functional as F
from torch import nn

from localllm.runtime import pointwise
from localllm.runtime.cache import QuantKV, quantize_pair, rotate_qk
from localllm.runtime.config import SLIDING, ModelConfig
from localllm.runtime.kv_pool import gather
from localllm.runtime.paged import PagedLayer, PagedStep

class Linear(nn.Linear):
    """``nn.Linear`` without random initialisation: every weight comes from a checkpoint.

    (Initialising on ``meta`` is not only wasted work: it goes through torch's reference ops, whose
    first use imports ``torch._dynamo``, some 0.8 s of a cold start.)
    """

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """``nn.Embedding`` without random initialisation (see :class:`Linear`)."""

    def reset_parameters(self) -> None:
        pass


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


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor longrope multiplies cos and sin by (1 for every other RoPE)."""
    s = config.rope_scaling
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


def attend(
    q: torch.Tensor,  # (B, H, T, hd)
    k: torch.Tensor,  # (B, KV, L, hd)
    v: torch.Tensor,  # (B, KV, L, hd)
    mask: torch.Tensor | None,  # (T, L) bool, True = attend; None: causal from 0 (T > 1) / all (T == 1)
    scale: float | None,  # None: hd ** -0.5
    softcap: float | None,
) -> torch.Tensor:
    """Softmax attention -> (B, H, T, hd): SDPA, or written out when the scores are soft-capped."""
    H, KV, T = q.shape[1], k.shape[1], q.shape[2]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                              scale=scale, enable_gqa=H != KV)
    if H != KV:
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap  # (B, H, T, L)
    if mask is None and T > 1:
        mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).to(v.dtype) @ v


def attention_mask(T: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Mask of a whole sequence's T queries over its own keys (positions 0 .. T - 1): None for plain
    causal attention (SDPA's own), else (T, T) bool, True = attend; a key is seen when
    ``q - window < k <= q``."""
    if window is None or T <= window:
        return None
    pos = torch.arange(T, device=device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)


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
        self.o = Linear(config.q_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_offset) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_offset) if config.qk_norm else None
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

    def _project(self, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, hd), k, v (B, KV, T, hd): projected, q/k-normed per head, rotated."""
        B, T, _ = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)  # (B, T, (H + 2 KV) hd)
            if self.q_norm is None:  # q and k are adjacent: rotate them in one go.
                qk = pointwise.rope(qkv[..., : (H + KV) * hd].view(B, T, H + KV, hd).transpose(1, 2), cos, sin)
                v = qkv[..., (H + KV) * hd :].view(B, T, KV, hd).transpose(1, 2)
                return qk[:, :H], qk[:, H:], v
            q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k = q.view(B, T, H, hd), k.view(B, T, KV, hd)
        if self.q_norm is not None and self.k_norm is not None:
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
        B, T, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        if kv is not None:
            return self.o(paged_attention(q, k, v, kv, self.q_prescale, self.scale, self.softcap))
        y = attend(q, k, v, attention_mask(T, self.window, x.device), self.scale, self.softcap)  # (B, H, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


def round_to(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded (to nearest, ties to even) to ``dtype``'s precision, as a Python float: worked
    out on the host, so a forward makes no tensor (and reads none back) for it."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]  # fp32 first, as torch.tensor(value) would
    if dtype == torch.bfloat16:
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    elif dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", struct.unpack("<f", struct.pack("<I", bits))[0]))[0]
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def paged_attention(
    q: torch.Tensor,  # (1, H, N, hd): the step's queries, every sequence's rows in turn
    k: torch.Tensor,  # (1, KV, N, hd): their new keys
    v: torch.Tensor,  # (1, KV, N, hd)
    layer: PagedLayer,
    q_prescale: float = 1.0,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of a flattened batch over the paged pool -> (1, N, H * hd).

    The new keys/values are written to their slots first; then each sequence's queries attend over
    its own context: single queries through the step's paged kernel (one call for all of them) when it
    has one, each prefill chunk through the step's chunk kernel (fp32 queries over a float pool) when it
    has one, the rest through SDPA over keys/values gathered from their blocks. In a sliding-window
    layer a sequence whose context the window cuts reads only the blocks that hold its window (the pool
    has given back the blocks before them: :mod:`runtime.kv_pool`); SDPA takes a mask there.
    Soft-capped scores (Gemma 2 style) never take a kernel.
    """
    if isinstance(layer.k, QuantKV):  # an int8 pool holds keys rotated (runtime.cache.key_rotation)
        out_dtype = q.dtype
        q, k = rotate_qk(q, k, layer.step.rotation)  # fp32: attention over an int8 pool runs in fp32
        return _paged_attention(q, k, v, layer, q_prescale, scale, softcap).to(out_dtype)
    return _paged_attention(q, k, v, layer, q_prescale, scale, softcap)


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: PagedLayer, q_prescale: float,
                     scale: float | None, softcap: float | None) -> torch.Tensor:
    """:func:`paged_attention` once q and k are as the pool's keys want them -> (1, N, H * hd) in q's dtype."""
    step = layer.step
    split = step.split(softcap is None)
    _, H, N, hd = q.shape
    KV = k.shape[1]
    kp, vp = layer.k, layer.v  # (n_blocks, KV, block, hd), or int8 codes + (n_blocks, KV, block) scales
    _write_slots(kp, vp, step, k[0].transpose(0, 1), v[0].transpose(0, 1))  # (N, KV, hd) into the slots
    qt = q[0].transpose(0, 1)  # (N, H, hd)
    if split.tiles is not None:  # a span kernel: every row of the step in one call
        assert step.kernel is not None and split.decode_tables is not None and split.decode_lens is not None
        qs = qt * q_prescale if q_prescale != 1.0 else qt
        out = step.kernel(qs.reshape(N, KV, H // KV, hd), kp, vp, split.decode_tables, split.decode_lens,
                          layer.window, split.tiles, split.tile_rows)  # type: ignore[call-arg]
        return out.reshape(1, N, H * hd)
    decode = None
    if split.decode_tables is not None:
        assert step.kernel is not None and split.decode_lens is not None
        qd = qt if split.decode_rows is None else qt.index_select(0, split.decode_rows)  # (S_d, H, hd)
        if q_prescale != 1.0:
            qd = qd * q_prescale
        decode = step.kernel(qd.reshape(-1, KV, H // KV, hd), kp, vp, split.decode_tables, split.decode_lens,
                             layer.window)
        if split.decode_rows is None:
            return decode.reshape(1, N, H * hd)  # (S_d, KV, G, hd), S_d == N: every row in order
    y = q.new_empty(N, H, hd)
    if decode is not None:
        y.index_copy_(0, split.decode_rows, decode.reshape(-1, H, hd))
    # the step's chunk kernel reads float pools in place for fp32 queries (SDPA rounds 16-bit ones its own way)
    chunk = step.chunk if softcap is None and isinstance(kp, torch.Tensor) and q.dtype == torch.float32 else None
    for span in split.sdpa_spans:
        first = step.first_block(span, layer.window)  # blocks before it hold no key the queries see
        if chunk is not None:
            rows = qt[span.row : span.row + span.length].reshape(span.length, KV, H // KV, hd)
            y[span.row : span.row + span.length] = chunk(
                rows, kp, vp, span.blocks[first:], first, span.context - span.length, layer.window,
                scale if scale is not None else hd ** -0.5).view(span.length, H, hd)
            continue
        ks, vs = gather(kp, vp, span.blocks[first:], span.context - first * step.pool.block_size, q.dtype)
        qs = q[:, :, span.row : span.row + span.length]  # (1, H, n, hd)
        mask = step.mask(span, layer.window, first)
        if span.length == 1 and mask is None and softcap is None:
            # one query: fold each kv group's heads into the query axis (no expanded keys)
            ys = F.scaled_dot_product_attention(qs.reshape(1, KV, H // KV, hd), ks, vs, scale=scale)  # (1, KV, G, hd)
            y[span.row] = ys.reshape(H, hd)
        else:
            ys = attend(qs, ks, vs, mask, scale, softcap)  # (1, H, n, hd)
            y[span.row : span.row + span.length] = ys[0].transpose(0, 1)
    return y.view(1, N, H * hd)


def _write_slots(kp: torch.Tensor | QuantKV, vp: torch.Tensor | QuantKV, step: PagedStep, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    """New keys and values (N, KV, hd) into their slots of the pools, quantized for an int8 pool."""
    if isinstance(kp, QuantKV) and isinstance(vp, QuantKV):
        for pool, q in zip((kp, vp), quantize_pair(k, v)):  # codes (N, KV, hd), scales (N, KV)
            pool.codes[step.write_blocks, :, step.write_rows] = q.codes
            pool.scales[step.write_blocks, :, step.write_rows] = q.scales
    else:
        assert isinstance(kp, torch.Tensor) and isinstance(vp, torch.Tensor)
        kp[step.write_blocks, :, step.write_rows] = k.to(kp.dtype)  # an fp16 pool rounds them here
        vp[step.write_blocks, :, step.write_rows] = v.to(vp.dtype)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Linear(config.dim, config.intermediate_size, bias=False)
        self.up = Linear(config.dim, config.intermediate_size, bias=False)
        self.down = Linear(config.intermediate_size, config.dim, bias=False)
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
        self.mlp = MLP(config)
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

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (that of the norms, which are never quantized)."""
        return self.norm.weight.dtype

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
        cos, sin = cache_rope_tables(self.config, T, tokens.device)
        rope = self._split_rope(cos.to(self.dtype), sin.to(self.dtype))  # (T, rot) each
        x = self._embed(tokens)  # (B, T, D)
        for layer in self.layers:
            x = layer(x, None, *rope[layer.attn.local_rope])
        return x

    def _split_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """local? -> (cos, sin) from tables that carry the local ones beside the global ones."""
        if not self._local_rope:
            return {False: (cos, sin)}
        rot = self.config.rotary_dim
        return {False: (cos[..., :rot], sin[..., :rot]), True: (cos[..., rot:], sin[..., rot:])}

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings (B, T, D), times Gemma's sqrt(dim) rounded to the activation dtype first."""
        x = self.embed(tokens)
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
        every linear layer runs once over all N rows, attention per sequence (:func:`paged_attention`).
        Each layer attends with its own window and RoPE rows (the step carries rows of
        :func:`cache_rope_tables`: the local layers' beside the global ones)."""
        x = self._embed(tokens)  # (1, N, D)
        rope = self._split_rope(step.cos, step.sin)  # rows of cache_rope_tables: the local ones beside
        for i, layer in enumerate(self.layers):
            x = layer(x, step.layer(i, layer.attn.window), *rope[layer.attn.local_rope])
        x = x[:, step.logits_rows]  # (1, S_out, D)
        return self._head(x)
