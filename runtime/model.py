"""The Llama-family transformer (Llama, Mistral, Qwen2).

Parameter names (the checkpoint loaders map to these)::

    embed.weight
    layers.{i}.attn_norm.weight
    layers.{i}.attn.{q,k,v}.weight  (+ .bias when config.attention_bias)
    layers.{i}.attn.o.weight
    layers.{i}.mlp_norm.weight
    layers.{i}.mlp.{gate,up,down}.weight
    norm.weight
    output.weight                   (the same tensor as embed.weight when tied)

No device or dtype is hard-wired: build on ``meta``, ``load_state_dict(assign=True)``.

The model holds no per-sequence state: a sequence's keys/values live in a
:class:`runtime.cache.SequenceCache` (made by :meth:`Transformer.new_cache` on the weights' device),
which the caller owns and passes to every forward. A batch of sequences over the batch engine's
paged KV pool passes a :class:`runtime.paged.PagedStep` instead (:func:`paged_attention`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from localllm.runtime.cache import KVCache, SequenceCache
from localllm.runtime.config import ModelConfig
from localllm.runtime.kv_pool import gather
from localllm.runtime.paged import PagedLayer, PagedStep

#: One-query attention: q (B, KV, G, hd), the G query heads sharing each kv head; k, v (B, KV, L, hd).
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype (as the reference implementations do).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in fp32, with a GGUF's frequency factors, llama3 or linear
    scaling applied."""
    hd = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if config.rope_freq_factors is not None:  # llama.cpp: theta_i = pos * base^(-2i/d) / factors[i]
        inv = inv / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    s = config.rope_scaling
    if s is None:
        return inv.float()
    if s["rope_type"] == "linear":
        return (inv / float(s["factor"])).float()
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


def rope_tables(config: ModelConfig, max_seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (max_seq, head_dim) in fp32, in the half-split (rotate_half) layout."""
    inv = rope_inv_freq(config).to(device)
    t = torch.arange(max_seq, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)  # (S, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (S, hd)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, hd); cos/sin (T, hd) already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q = Linear(config.dim, config.q_dim, bias=bias)
        self.k = Linear(config.dim, config.kv_dim, bias=bias)
        self.v = Linear(config.dim, config.kv_dim, bias=bias)
        self.o = Linear(config.q_dim, config.dim, bias=False)
        #: q, k and v as one matmul, set by loaders.build.fuse_projections (then q, k, v are removed).
        self.qkv: nn.Module | None = None
        self.q_dim, self.kv_dim = config.q_dim, config.kv_dim
        #: Attention of one query position, ``fn(q (B, KV, G, hd), k, v (B, KV, kv_len, hd)) -> (B, KV, G, hd)``,
        #: used instead of SDPA when set (see Transformer.set_decode_attention).
        self.decode_kernel: DecodeAttention | None = None

    def forward(
        self,
        x: torch.Tensor,  # (B, T, D)
        cos: torch.Tensor,  # (T, hd)
        sin: torch.Tensor,  # (T, hd)
        kv: KVCache | PagedLayer | None,  # this layer's cache, None = no cache
        input_pos: torch.Tensor | None,  # (T,) positions (with a cache)
        kv_len: int,  # keys to attend to: positions [0, kv_len)
        mask: torch.Tensor | None,  # (T, kv_len) bool, or None for "causal from 0" / "all"
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)  # (B, T, (H + 2 KV) hd)
            # q and k are adjacent: rotate them in one go.
            qk = apply_rope(qkv[..., : (H + KV) * hd].view(B, T, H + KV, hd).transpose(1, 2), cos, sin)
            q, k = qk[:, :H], qk[:, H:]  # (B, H, T, hd), (B, KV, T, hd)
            v = qkv[..., (H + KV) * hd :].view(B, T, KV, hd).transpose(1, 2)
        else:
            q = apply_rope(self.q(x).view(B, T, H, hd).transpose(1, 2), cos, sin)  # (B, H, T, hd)
            k = apply_rope(self.k(x).view(B, T, KV, hd).transpose(1, 2), cos, sin)  # (B, KV, T, hd)
            v = self.v(x).view(B, T, KV, hd).transpose(1, 2)
        if isinstance(kv, PagedLayer):
            return self.o(paged_attention(q, k, v, kv))
        if kv is not None and input_pos is not None:
            k_all, v_all = kv.update(input_pos, k, v)
            k, v = k_all[:, :, :kv_len], v_all[:, :, :kv_len]  # (B, KV, kv_len, hd)
        gqa = self.n_heads != self.n_kv_heads
        if T == 1:
            # One query: fold the query heads of each kv group into the "sequence" axis so GQA
            # needs no expanded keys; a (1, kv_len) mask, if any, applies to every folded row.
            g = self.n_heads // self.n_kv_heads
            qg = q.reshape(B, self.n_kv_heads, g, self.head_dim)  # (B, KV, G, hd)
            if self.decode_kernel is not None and mask is None:
                y = self.decode_kernel(qg, k, v)
            else:
                y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
            y = y.view(B, self.n_heads, 1, self.head_dim)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
            )  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o(y)


def paged_attention(
    q: torch.Tensor,  # (1, H, N, hd): the step's queries, every sequence's rows in turn
    k: torch.Tensor,  # (1, KV, N, hd): their new keys
    v: torch.Tensor,  # (1, KV, N, hd)
    layer: PagedLayer,
) -> torch.Tensor:
    """Attention of a flattened batch over the paged pool -> (1, N, H * hd).

    The new keys/values are written to their slots first; then each sequence's queries attend over
    its own context: single queries through the step's paged kernel (one call for all of them) when it
    has one, the rest through SDPA over keys/values gathered from their blocks.
    """
    step = layer.step
    _, H, N, hd = q.shape
    KV = k.shape[1]
    kp, vp = layer.k, layer.v  # (n_blocks, KV, block, hd)
    kp[step.write_blocks, :, step.write_rows] = k[0].transpose(0, 1)  # (N, KV, hd) into the slots
    vp[step.write_blocks, :, step.write_rows] = v[0].transpose(0, 1)
    qt = q[0].transpose(0, 1)  # (N, H, hd)
    decode = None
    if step.decode_tables is not None:
        assert step.kernel is not None and step.decode_lens is not None
        qd = qt if step.decode_rows is None else qt.index_select(0, step.decode_rows)  # (S_d, H, hd)
        decode = step.kernel(qd.reshape(-1, KV, H // KV, hd), kp, vp, step.decode_tables, step.decode_lens)
        if step.decode_rows is None:
            return decode.reshape(1, N, H * hd)  # (S_d, KV, G, hd), S_d == N: every row in order
    y = q.new_empty(N, H, hd)
    if decode is not None:
        y.index_copy_(0, step.decode_rows, decode.reshape(-1, H, hd))
    for span in step.sdpa_spans:
        ks, vs = gather(kp, vp, span.blocks, span.context)  # (1, KV, ctx, hd)
        qs = q[:, :, span.row : span.row + span.length]  # (1, H, n, hd)
        mask = step.mask(span)
        if span.length == 1 and mask is None:
            # one query: fold each kv group's heads into the query axis, as the one-sequence decode does
            ys = F.scaled_dot_product_attention(qs.reshape(1, KV, H // KV, hd), ks, vs)  # (1, KV, G, hd)
            y[span.row] = ys.reshape(H, hd)
        else:
            ys = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=KV != H
            )  # (1, H, n, hd)
            y[span.row : span.row + span.length] = ys[0].transpose(0, 1)
    return y.view(1, N, H * hd)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Linear(config.dim, config.intermediate_size, bias=False)
        self.up = Linear(config.dim, config.intermediate_size, bias=False)
        self.down = Linear(config.intermediate_size, config.dim, bias=False)
        #: gate and up as one matmul, set by loaders.build.fuse_projections.
        self.gate_up: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv, input_pos, kv_len, mask):  # type: ignore[no-untyped-def]
        h = x + self.attn(self.attn_norm(x), cos, sin, kv, input_pos, kv_len, mask)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = Linear(config.dim, config.vocab_size, bias=False)

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

    def new_cache(self, max_seq: int, batch: int = 1, cache_dtype: torch.dtype | None = None) -> SequenceCache:
        """A sequence's KV caches and RoPE tables for ``max_seq`` positions on the model's device."""
        c = self.config
        device, dtype = self.device, cache_dtype or self.dtype
        shape = (batch, c.n_kv_heads, max_seq, c.head_dim)
        layers = [KVCache(torch.zeros(shape, dtype=dtype, device=device),
                          torch.zeros(shape, dtype=dtype, device=device)) for _ in self.layers]
        cos, sin = rope_tables(c, max_seq, device)
        return SequenceCache(layers, cos.to(self.dtype), sin.to(self.dtype))

    @property
    def decode_kernel(self) -> DecodeAttention | None:
        """The one-query attention kernel decode steps run (None: SDPA)."""
        return self.layers[0].attn.decode_kernel if len(self.layers) else None

    def set_decode_attention(self, kernel: DecodeAttention | None) -> None:
        """Run ``kernel`` rather than SDPA for one-query attention (decode steps without a mask), in
        every layer: eager and compiled steps alike, so the compiled step stays the eager one fused."""
        for layer in self.layers:
            layer.attn.decode_kernel = kernel

    @contextmanager
    def decode_attention(self, kernel: DecodeAttention | None) -> Iterator[None]:
        """:meth:`set_decode_attention` within the block only (to compare kernels on one model)."""
        saved = self.decode_kernel
        self.set_decode_attention(kernel)
        try:
            yield
        finally:
            self.set_decode_attention(saved)

    def forward(
        self, tokens: torch.Tensor, cache: SequenceCache | PagedStep | None = None,
        input_pos: torch.Tensor | None = None, start: int = 0, static: bool = False, last_only: bool = False,
    ) -> torch.Tensor:
        """Logits (B, T, vocab) for ``tokens`` (B, T); (B, 1, vocab) for the last position alone with
        ``last_only`` (a prompt's prefill needs no more, and the head is the largest matmul).

        With a :class:`runtime.paged.PagedStep` as ``cache``, ``tokens`` (1, N) are the step's flattened
        batch and the logits are those of its ``logits_rows``, (1, S_out, vocab); the other arguments
        are not used (see :meth:`forward_paged`).

        With a ``cache`` the tokens sit at positions ``start`` .. ``start + T - 1`` (``start`` given as
        an int so that no device sync is needed to know it; ``input_pos`` is the same positions as a
        (T,) tensor, made here when not given): their keys/values are written to the cache and every
        position before them is read from it. Without a cache the tokens are one whole sequence from
        position 0 and nothing outside this call is read or written.

        ``static``: attend over the whole cache with a mask built from ``input_pos`` alone, so every
        decode step has the same shapes whatever the position (what CUDA graphs need; ``start`` is
        then ignored). Otherwise only the filled prefix of the cache is read, which is cheaper.
        """
        if isinstance(cache, PagedStep):
            return self.forward_paged(tokens, cache)
        B, T = tokens.shape
        if cache is None:
            start, input_pos = 0, None
            cos, sin = rope_tables(self.config, T, tokens.device)
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)  # (T, hd)
        else:
            if input_pos is None:
                input_pos = torch.arange(start, start + T, device=tokens.device)
            if static:
                return self._forward_static(tokens, cache, input_pos)
            # positions start .. start + T - 1: a view, no gather
            cos, sin = cache.cos[start : start + T], cache.sin[start : start + T]  # (T, hd)
        kv_len = start + T
        mask = self._mask(start, T, kv_len, tokens.device)
        x = self.embed(tokens)  # (B, T, D)
        kvs = cache.layers if cache is not None else [None] * len(self.layers)
        for layer, kv in zip(self.layers, kvs):
            x = layer(x, cos, sin, kv, input_pos, kv_len, mask)
        if last_only:
            x = x[:, -1:]  # (B, 1, D)
        return self.output(self.norm(x))

    def forward_paged(self, tokens: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """Logits (1, S_out, vocab) of ``step.logits_rows`` for the flattened batch ``tokens`` (1, N):
        every linear layer runs once over all N rows, attention per sequence (:func:`paged_attention`)."""
        x = self.embed(tokens)  # (1, N, D)
        for i, layer in enumerate(self.layers):
            x = layer(x, step.cos, step.sin, step.layer(i), None, 0, None)
        x = x[:, step.logits_rows]  # (1, S_out, D)
        return self.output(self.norm(x))

    def _forward_static(self, tokens: torch.Tensor, cache: SequenceCache, input_pos: torch.Tensor) -> torch.Tensor:
        cos, sin = cache.cos[input_pos], cache.sin[input_pos]  # (T, hd)
        k_pos = torch.arange(cache.max_seq, device=tokens.device)[None, :]
        q_pos = input_pos[:, None]
        mask = k_pos <= q_pos  # (T, max_seq)
        if self.config.sliding_window is not None:
            mask &= k_pos > q_pos - self.config.sliding_window
        x = self.embed(tokens)
        for layer, kv in zip(self.layers, cache.layers):
            x = layer(x, cos, sin, kv, input_pos, cache.max_seq, mask)
        return self.output(self.norm(x))

    def _mask(self, start: int, T: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
        """None when SDPA needs no explicit mask; else a (T, kv_len) bool mask (True = attend)."""
        window = self.config.sliding_window
        windowed = window is not None and kv_len > window
        if not windowed and (start == 0 or T == 1):
            return None  # plain causal from position 0, or one query that sees everything
        q_pos = torch.arange(start, start + T, device=device)[:, None]
        k_pos = torch.arange(kv_len, device=device)[None, :]
        mask = k_pos <= q_pos
        if windowed:
            mask &= k_pos > q_pos - window
        return mask
