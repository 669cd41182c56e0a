"""Attention, behind one interface: :func:`attend`.

The model hands each layer's queries, new keys and values to :func:`attend` with its view of the step
(:class:`runtime.paged.PagedLayer`), and knows no kernel. Its implementations:

* :func:`reference`: softmax attention through SDPA (written out for soft-capped scores and for sinks),
  over one whole sequence (a forward without a step) or keys/values gathered out of the paged pool:
  the tested reference, and what soft-capped scores and sinks always take;
* the step's paged kernels, reading the pool's blocks in place: on the CPU the decode kernel for single
  queries and the chunk kernel for prefill chunks (:mod:`runtime.cpu_attention`); on CUDA the span
  kernel for every row (:mod:`runtime.cuda_attention`). :class:`runtime.paged.PagedStep` says which
  spans each one takes (its kernel share and :attr:`runtime.paged.PagedStep.sdpa_spans`).

New keys and values are written to their slots of the pool (quantized for an int8 pool) before any
query attends.

Sinks (gpt-oss): a learned logit per query head joins each query's softmax as one more column, whose
probability is then dropped: ``out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))``. The CPU decode
and chunk kernels take them (kernels with ``takes_sinks``: the sink joins the softmax's max and sum, or
starts the online softmax); CUDA's span kernel does not, so on CUDA every row attends through
:func:`reference` over gathered keys; the compiled step and CUDA graphs refuse such a model
(:attr:`runtime.model.Attention.takes_kernels`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localllm.runtime.cache import QuantKV, quantize_pair, rotate_qk
from localllm.runtime.kv_pool import gather
from localllm.runtime.paged import PagedLayer, PagedStep


def attend(
    q: torch.Tensor,  # (B, H, T, hd)
    k: torch.Tensor,  # (B, KV, T, hd): the new keys
    v: torch.Tensor,  # (B, KV, T, hd)
    kv: PagedLayer | None,  # this layer's view of the step's paged pool; None: a whole sequence alone (B any)
    window: int | None,  # the layer's attention window (None: the whole context)
    q_prescale: float = 1.0,  # what q is multiplied by before a kernel that scales by hd ** -0.5
    scale: float | None = None,  # None: hd ** -0.5
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,) each head's sink logit (gpt-oss), or None
) -> torch.Tensor:
    """Attention of a layer -> (B, T, H * hd): over the step's paged pool (:func:`paged`), or, without a
    step, over the sequence's own keys from position 0 (:func:`reference`)."""
    if kv is not None:
        return paged(q, k, v, kv, q_prescale, scale, softcap, sinks)
    B, H, T, hd = q.shape
    y = reference(q, k, v, window_mask(T, window, q.device), scale, softcap, sinks)  # (B, H, T, hd)
    return y.transpose(1, 2).reshape(B, T, H * hd)


def reference(
    q: torch.Tensor,  # (B, H, T, hd)
    k: torch.Tensor,  # (B, KV, L, hd)
    v: torch.Tensor,  # (B, KV, L, hd)
    mask: torch.Tensor | None,  # (T, L) bool, True = attend; None: causal from 0 (T > 1) / all (T == 1)
    scale: float | None,  # None: hd ** -0.5
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # (H,) sink logits, or None
) -> torch.Tensor:
    """Softmax attention -> (B, H, T, hd): SDPA, or written out when the scores are soft-capped or
    have sinks (a sink is one more column of each head's softmax, dropped after it)."""
    H, KV, T = q.shape[1], k.shape[1], q.shape[2]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                              scale=scale, enable_gqa=H != KV)
    if H != KV:
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap  # (B, H, T, L)
    if mask is None and T > 1:
        mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(-1).to(v.dtype) @ v
    sink = sinks.float().view(1, H, 1, 1).expand(scores.shape[0], H, T, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]  # (B, H, T, L): the sink's dropped
    return probs.to(v.dtype) @ v


def window_mask(T: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Mask of a whole sequence's T queries over its own keys (positions 0 .. T - 1): None for plain
    causal attention (SDPA's own), else (T, T) bool, True = attend; a key is seen when
    ``q - window < k <= q``."""
    if window is None or T <= window:
        return None
    pos = torch.arange(T, device=device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)


def paged(
    q: torch.Tensor,  # (1, H, N, hd): the step's queries, every sequence's rows in turn
    k: torch.Tensor,  # (1, KV, N, hd): their new keys
    v: torch.Tensor,  # (1, KV, N, hd)
    layer: PagedLayer,
    q_prescale: float = 1.0,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a flattened batch over the paged pool -> (1, N, H * hd).

    The new keys/values are written to their slots first; then each sequence's queries attend over
    its own context: single queries through the step's paged kernel (one call for all of them) when it
    has one, each prefill chunk through the step's chunk kernel (fp32 queries over a float pool) when it
    has one, the rest through SDPA over keys/values gathered from their blocks. In a sliding-window
    layer a sequence whose context the window cuts reads only the blocks that hold its window (the pool
    has given back the blocks before them: :mod:`runtime.kv_pool`); SDPA takes a mask there.
    Soft-capped scores (Gemma 2 style) and sinks (gpt-oss) never take a kernel.
    """
    if isinstance(layer.k, QuantKV):  # an int8 pool holds keys rotated (runtime.cache.key_rotation)
        out_dtype = q.dtype
        q, k = rotate_qk(q, k, layer.step.rotation)  # fp32: attention over an int8 pool runs in fp32
        return _paged(q, k, v, layer, q_prescale, scale, softcap, sinks).to(out_dtype)
    return _paged(q, k, v, layer, q_prescale, scale, softcap, sinks)


def _paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: PagedLayer, q_prescale: float,
           scale: float | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The paged attention once q and k are as the pool's keys want them -> (1, N, H * hd) in q's dtype."""
    step = layer.step
    plain = softcap is None and sinks is None  # the chunk kernel takes neither soft-capped scores nor sinks
    # a decode kernel with ``takes_sinks`` takes sinks (its span kind, CUDA's, does not)
    sink_kernel = sinks is not None and step.tiles is None and getattr(step.kernel, "takes_sinks", False)
    use_kernel = (plain or (softcap is None and sink_kernel)) and step.tables is not None
    if not use_kernel and not plain and not step.spans:
        raise ValueError("soft-capped or sink attention needs the step's spans: a decode-only step has none")
    _, H, N, hd = q.shape
    KV = k.shape[1]
    kp, vp = layer.k, layer.v  # (n_blocks, KV, block, hd), or int8 codes + (n_blocks, KV, block) scales
    _write_slots(kp, vp, step, k[0].transpose(0, 1), v[0].transpose(0, 1))  # (N, KV, hd) into the slots
    qt = q[0].transpose(0, 1)  # (N, H, hd)
    if use_kernel and step.tiles is not None:  # a span kernel: every row of the step in one call
        assert step.kernel is not None and step.lens is not None
        qs = qt * q_prescale if q_prescale != 1.0 else qt
        out = step.kernel(qs.reshape(N, KV, H // KV, hd), kp, vp, step.tables, step.lens,
                          layer.window, step.tiles, step.tile_rows)  # type: ignore[call-arg]
        return out.reshape(1, N, H * hd)
    decode = None
    if use_kernel:  # a decode kernel: the single queries in one call
        assert step.kernel is not None and step.tables is not None and step.lens is not None
        qd = qt if step.kernel_rows is None else qt.index_select(0, step.kernel_rows)  # (S_d, H, hd)
        if q_prescale != 1.0:
            qd = qd * q_prescale
        if sinks is None:
            decode = step.kernel(qd.reshape(-1, KV, H // KV, hd), kp, vp, step.tables, step.lens, layer.window)
        else:
            decode = step.kernel(qd.reshape(-1, KV, H // KV, hd), kp, vp, step.tables, step.lens, layer.window,
                                 sinks=sinks.float())  # type: ignore[call-arg]
        if step.kernel_rows is None:
            return decode.reshape(1, N, H * hd)  # (S_d, KV, G, hd), S_d == N: every row in order
    y = q.new_empty(N, H, hd)
    if decode is not None:
        y.index_copy_(0, step.kernel_rows, decode.reshape(-1, H, hd))
    # the step's chunk kernel reads float pools in place for fp32 queries (SDPA rounds 16-bit ones its own way)
    chunk = step.chunk if (plain or (softcap is None and getattr(step.chunk, "takes_sinks", False))) and \
        isinstance(kp, torch.Tensor) and q.dtype == torch.float32 else None
    for span in (step.sdpa_spans if use_kernel else step.spans):
        first = step.first_block(span, layer.window)  # blocks before it hold no key the queries see
        if chunk is not None:
            rows = qt[span.row : span.row + span.length].reshape(span.length, KV, H // KV, hd)
            y[span.row : span.row + span.length] = chunk(
                rows, kp, vp, span.blocks[first:], first, span.context - span.length, layer.window,
                scale if scale is not None else hd ** -0.5,
                *(() if sinks is None else (sinks.float(),))).view(span.length, H, hd)
            continue
        ks, vs = gather(kp, vp, span.blocks[first:], span.context - first * step.pool.block_size, q.dtype)
        qs = q[:, :, span.row : span.row + span.length]  # (1, H, n, hd)
        mask = step.mask(span, layer.window, first)
        if span.length == 1 and mask is None and plain:
            # one query: fold each kv group's heads into the query axis (no expanded keys)
            ys = F.scaled_dot_product_attention(qs.reshape(1, KV, H // KV, hd), ks, vs, scale=scale)  # (1, KV, G, hd)
            y[span.row] = ys.reshape(H, hd)
        else:
            ys = reference(qs, ks, vs, mask, scale, softcap, sinks)  # (1, H, n, hd)
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
