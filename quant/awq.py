"""Activation-aware int4 (AWQ): per-input-channel scales searched on calibration activations, folded
into the operation before, so the stored weights stay canonical int4 (``quant/formats.py``).

Pure math on named float tensors; it knows no model and no files. A caller describes a transformer
block as :class:`ScaleGroup` s (the linears that read one input, and the operation that makes that
input), gives each input's :class:`InputStats` (from calibration activations) and gets back the
block's tensors rewritten: for a group with scales ``s`` (in,), every linear's columns are multiplied
by ``s`` before round-to-nearest, and the input is divided by ``s`` where it is made (an RMSNorm's
weight, or the rows of the linear before: v for o, up for down). Without quantization the rewritten
block computes exactly what the original does (up to float rounding): it is a reparametrization.

The search, as in AWQ (Lin et al., 2023): ``s = mean|x| ** alpha`` normalised to a geometric mean of
about 1, alpha on a grid over [0, 1] searched coarse to fine (alpha 0 is plain round-to-nearest and
always measured, so the chosen scales never do worse than it on the calibration data), minimising the
summed squared output error of the group's linears. Then each group of weights may be clipped (its
range shrunk) where that lowers the error of its part of the output. Errors are measured with ``X``
itself or its Gram matrix ``X^T X``, whichever is smaller, so all calibration tokens count at a cost
bounded by the layer's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.quant.formats import QuantScheme, dequantize, quantize

#: Alpha grid points and clip ratios (1.0 down to 1 - CLIP_SHRINK) of the search.
SCALE_GRID = 20
CLIP_GRID = 10
CLIP_SHRINK = 0.5
#: Coarse steps of the two searches (coarse to fine: :func:`search_scale`). Clipping measures every
#: ratio: a group's error is not unimodal in its ratio (rounding makes it jump), and a coarse pass
#: measurably misses.
SCALE_STEP = 4
CLIP_STEP = 1
#: Weight elements a search step quantizes and measures at once (bounds its temporaries: a few fp32
#: copies of this many elements, 4 MiB each); a small layer goes whole, a large one some rows at a time.
BLOCK = 1 << 20


def row_block(inp: int) -> int:
    """Output rows of an (out, ``inp``) weight measured at once."""
    return max(1, BLOCK // inp)


@dataclass
class InputStats:
    """What the search needs of one input's calibration activations ``x`` (N, in)."""

    mean_abs: torch.Tensor  # (in,) fp32: mean |x| over the tokens
    x: torch.Tensor | None  # (N, in) fp32 when N <= in, else None
    gram: torch.Tensor | None  # (in, in) fp32 X^T X when N > in, else None

    @classmethod
    def of(cls, x: torch.Tensor) -> "InputStats":
        x = x.reshape(-1, x.shape[-1])  # (N, in)
        acc = StatsAccumulator(x.shape[0], x.shape[1])
        acc.add(x)
        return acc.stats()

    def error(self, dw: torch.Tensor) -> float:
        """Squared output error ``||x dw^T||^2`` summed over the tokens, for a weight error dw (out, in)."""
        if self.x is not None:
            return float((self.x @ dw.T).square().sum())
        return float(((dw @ self.gram) * dw).sum())

    def quant_error(self, w: torch.Tensor, s: torch.Tensor, scheme: QuantScheme) -> float:
        """The output error of ``w`` (out, in) quantized as ``w * s`` with inputs ``x / s``, a
        :func:`row_block` of output rows at a time (the rows' errors add up; the temporaries stay a few
        row blocks)."""
        return sum(self.error(fake_quant(rows * s, scheme).div_(s).sub_(rows))
                   for rows in w.split(row_block(w.shape[1])))

    def blocks(self, group: int) -> torch.Tensor:
        """(in/group, group, group): the Gram matrix's diagonal blocks, one per group of input channels."""
        inp = self.mean_abs.shape[0]
        n = inp // group
        if self.gram is not None:
            return self.gram.view(n, group, n, group).diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous()
        xg = self.x.view(-1, n, group)  # type: ignore[union-attr]  # (N, n, g)
        return torch.einsum("tni,tnj->nij", xg, xg)

    def group_errors(self, dw: torch.Tensor, group: int) -> torch.Tensor:
        """(out, in/group): each group's part of the squared output error, ``d^T H_jj d`` with H_jj the
        Gram matrix's diagonal block of that group's input channels."""
        out, inp = dw.shape
        blocks = self.blocks(group)
        d = dw.view(out, inp // group, group)
        return torch.einsum("oni,nij,onj->on", d, blocks, d)

    def scaled(self, s: torch.Tensor) -> "InputStats":
        """The statistics of ``x / s``."""
        if self.x is not None:
            return InputStats(self.mean_abs / s, self.x / s, None)
        return InputStats(self.mean_abs / s, None, self.gram / s[:, None] / s[None, :])


@dataclass
class GroupBlocks:
    """What clipping needs of an input: the diagonal blocks of its Gram matrix (in/group, group, group),
    a small fraction of the tokens or of the whole Gram matrix, kept per group until the layer is clipped."""

    diag: torch.Tensor
    group: int

    @classmethod
    def of(cls, stats: InputStats, s: torch.Tensor, group: int) -> "GroupBlocks":
        """The blocks of ``x / s``: those of ``x`` divided by ``s_i s_j``."""
        sg = s.view(-1, group)  # (n, g)
        return cls(stats.blocks(group) / sg[:, :, None] / sg[:, None, :], group)

    def group_errors(self, dw: torch.Tensor, group: int) -> torch.Tensor:
        """As :meth:`InputStats.group_errors`."""
        if group != self.group:
            raise ValueError(f"blocks of group {self.group} asked for group {group}")
        out, inp = dw.shape
        d = dw.view(out, inp // group, group)
        return torch.einsum("oni,nij,onj->on", d, self.diag, d)


class StatsAccumulator:
    """:class:`InputStats` of ``n_tokens`` tokens of width ``width`` that arrive a chunk at a time (one
    calibration sequence after another), so a layer's inputs are never all materialised at once
    beside what the statistics keep: the tokens themselves (N, in) when N <= in, else ``X^T X`` (in, in)."""

    def __init__(self, n_tokens: int, width: int) -> None:
        self.width = width
        self.n = 0
        self.sum_abs = torch.zeros(width)  # (in,)
        self.x = torch.empty(n_tokens, width) if n_tokens <= width else None  # (N, in)
        self.gram = None if self.x is not None else torch.zeros(width, width)  # (in, in)

    def add(self, x: torch.Tensor) -> None:
        """Add the tokens ``x`` (..., in)."""
        x = x.reshape(-1, self.width).float()  # (n, in)
        self.sum_abs += x.abs().sum(0)
        if self.x is not None:
            self.x[self.n:self.n + x.shape[0]] = x
        else:
            self.gram.addmm_(x.T, x)  # type: ignore[union-attr]
        self.n += x.shape[0]

    def stats(self) -> InputStats:
        x = self.x[:self.n] if self.x is not None else None
        return InputStats(self.sum_abs / max(self.n, 1), x, self.gram)


@dataclass(frozen=True)
class Fold:
    """Where a group's input is made, so its inverse scale can go there.

    ``kind`` ``norm``: an RMSNorm weight ``target`` computing ``x * (offset + w)`` (offset 0: Llama's,
    1: Gemma's). ``rows``: the output rows (and bias) of linear ``target``, whose outputs reach the
    group's input unchanged per channel (v through attention to o; up through the gated product to
    down). ``heads`` (kv heads, query heads per kv head, head dim): the input is attention's output,
    whose channel (h, d) carries v's channel (h // group, d): the scales are shared across each kv
    head's query heads.
    """

    kind: str
    target: str
    offset: float = 0.0
    heads: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class ScaleGroup:
    """Linears (weight names) that read one input, the input's name, and where its scale folds."""

    linears: tuple[str, ...]
    input: str
    fold: Fold
    clip: tuple[str, ...] = ()  # the linears whose weight groups are also clipped


@dataclass
class GroupResult:
    """What the search chose for one group and the output errors it measured."""

    alpha: float
    rtn_error: float
    error: float


def fake_quant(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``w`` (out, in) through the scheme's round-to-nearest and back: the values the artifact holds.

    int4 is :func:`quant.formats.quantize` then ``dequantize`` without the packing (the same
    operations in the same order, so the same values: tests/test_awq.py checks it); other schemes
    go through both."""
    if scheme.name != "int4":
        return dequantize(quantize(w, scheme), scheme)
    out, inp = w.shape
    g = scheme.group_size
    wg = w.float().view(out, inp // g, g)  # type: ignore[operator]
    if scheme.symmetric:
        scale = (wg.abs().amax(-1) / 7.5).clamp(min=1e-10).half().float()
        offset = -8 * scale
    else:
        lo, hi = torch.aminmax(wg, dim=-1)
        scale = ((hi - lo) / 15).clamp(min=1e-10).half().float()
        offset = lo.half().float()
    q = (wg - offset[..., None]).div_(scale[..., None]).round_().clamp_(0, 15)
    return q.mul_(scale[..., None]).add_(offset[..., None]).view(out, inp)


def _expand(s: torch.Tensor, heads: tuple[int, int, int] | None) -> torch.Tensor:
    """Scales over the fold's channels (kv_dim) -> over the group's input channels (q_dim)."""
    if heads is None:
        return s
    kv, per, hd = heads
    return s.view(kv, 1, hd).expand(kv, per, hd).reshape(-1)


def _reduce(x_mean: torch.Tensor, heads: tuple[int, int, int] | None) -> torch.Tensor:
    """Mean |x| over the input channels (q_dim) -> over the fold's channels (kv_dim)."""
    if heads is None:
        return x_mean
    kv, per, hd = heads
    return x_mean.view(kv, per, hd).mean(1).reshape(-1)


def coarse_points(grid: int, step: int) -> list[int]:
    """The coarse pass of a grid search: every ``step``-th point and the last."""
    return sorted(set(range(0, grid, step)) | {grid - 1})


def refine_steps(step: int) -> list[int]:
    """The offsets tried around the best point after a coarse pass of ``step``: halving down to 1
    (4 -> [2, 1]), which reaches every point between the best coarse point's neighbours."""
    steps = []
    h = step // 2
    while h >= 1:
        steps.append(h)
        h //= 2
    return steps


def search_scale(weights: list[torch.Tensor], stats: InputStats, scheme: QuantScheme,
                 heads: tuple[int, int, int] | None = None, grid: int = SCALE_GRID,
                 step: int = SCALE_STEP) -> tuple[torch.Tensor, GroupResult]:
    """The scales (fold channels,) minimising the summed output error of ``weights`` (each (out, in))
    quantized as ``w * s`` with inputs ``x / s``; and what was measured.

    The grid's alphas are searched coarse to fine (every ``step``-th, then halving steps around the
    best, then neighbours until the best has no unmeasured neighbour): the grid's minimum wherever the
    error is unimodal in alpha (as it is, in practice) with about half the measurements. Alpha 0 (plain
    round to nearest) is always measured, so the result never does worse than it on the calibration data."""
    x_mean = _reduce(stats.mean_abs, heads).clamp(min=1e-6)
    scales: dict[int, torch.Tensor] = {}
    errs: dict[int, float] = {}

    def measure(i: int) -> None:
        if not 0 <= i < grid or i in errs:
            return
        alpha = i / (grid - 1) if grid > 1 else 0.0
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        full = _expand(s, heads)
        errs[i] = sum(stats.quant_error(w, full, scheme) for w in weights)
        scales[i] = s

    def best() -> int:
        return min(errs, key=lambda i: (errs[i], i))

    for i in coarse_points(grid, step):
        measure(i)
    for h in refine_steps(step):
        b = best()
        measure(b - h)
        measure(b + h)
    while True:  # the best point's neighbours measured: a local minimum of the grid
        b = best()
        if all(j in errs or not 0 <= j < grid for j in (b - 1, b + 1)):
            break
        measure(b - 1)
        measure(b + 1)
    alpha = b / (grid - 1) if grid > 1 else 0.0
    s = scales[b] if b else torch.ones_like(x_mean)  # alpha 0: exactly nothing to fold
    return s, GroupResult(alpha, errs[0], errs[b])


def search_clip(w: torch.Tensor, stats: InputStats | GroupBlocks, scheme: QuantScheme,
                grid: int = CLIP_GRID, shrink: float = CLIP_SHRINK, step: int = CLIP_STEP) -> torch.Tensor:
    """``w`` (out, in) with each group's range [min, max] shrunk by the ratio (1 down to 1 - shrink)
    that gives that group's part of the output the least error after round-to-nearest (ratio 1, no
    clipping, is a candidate: never worse on the calibration data). ``step`` > 1 searches the ratios
    coarse to fine as :func:`search_scale`'s alphas, each group around its own best."""
    if isinstance(stats, InputStats):
        stats = GroupBlocks.of(stats, torch.ones(w.shape[1]), scheme.group_size)  # type: ignore[arg-type]
    result = torch.empty_like(w)
    rows = row_block(w.shape[1])
    for part, dst in zip(w.split(rows), result.split(rows)):  # each row's groups are independent
        dst.copy_(_clip_rows(part, stats, scheme, grid, shrink, step))
    return result


def _clip_rows(w: torch.Tensor, stats: InputStats | GroupBlocks, scheme: QuantScheme, grid: int, shrink: float,
               step: int) -> torch.Tensor:
    """:func:`search_clip` on some rows ``w`` (rows, in)."""
    out, inp = w.shape
    g = scheme.group_size
    n = inp // g  # type: ignore[operator]
    wg = w.view(out, n, g)
    lo, hi = torch.aminmax(wg, dim=-1, keepdim=True)  # (out, n, 1)
    best_err = torch.full((out, n), float("inf"))
    best_i = torch.zeros((out, n), dtype=torch.long)
    best = wg.clone()

    def measure(i: torch.Tensor) -> None:  # i: (out, n) grid points, one per group
        nonlocal best_err, best_i, best
        i = i.clamp(0, grid - 1)
        r = (1.0 - shrink * i.float() / grid)[..., None]  # (out, n, 1)
        c = torch.minimum(torch.maximum(wg, lo * r), hi * r)
        errs = stats.group_errors(fake_quant(c.view(out, inp), scheme).sub_(w), g)  # type: ignore[arg-type]
        better = errs < best_err
        best_err = torch.where(better, errs, best_err)
        best_i = torch.where(better, i, best_i)
        best = torch.where(better[..., None], c, best)

    for i in coarse_points(grid, step):
        measure(torch.full((out, n), i))
    for h in refine_steps(step):
        base = best_i.clone()
        measure(base - h)
        measure(base + h)
    return best.view(out, inp)


def fold_inverse(tensors: dict[str, torch.Tensor], fold: Fold, s: torch.Tensor) -> None:
    """Divide the fold's target by ``s`` (its channels) in place in ``tensors``."""
    if fold.kind == "norm":
        w = tensors[fold.target].float()
        tensors[fold.target] = (w + fold.offset) / s - fold.offset
        return
    if fold.kind != "rows":
        raise ValueError(f"unknown fold kind {fold.kind!r}")
    tensors[f"{fold.target}.weight"] = tensors[f"{fold.target}.weight"].float() / s[:, None]
    bias = f"{fold.target}.bias"
    if bias in tensors:
        tensors[bias] = tensors[bias].float() / s


def apply_awq(tensors: dict[str, torch.Tensor], groups: list[ScaleGroup], stats: dict[str, InputStats],
              scheme: QuantScheme, clip: bool = True) -> dict[str, GroupResult]:
    """Rewrite one block's float tensors in place: for each group in order, search its scales, multiply
    its linears' columns by them and fold the inverse; then clip the groups' ``clip`` linears.

    ``tensors``: the block's tensors by name (linears as ``{name}.weight``, norms by their weight's
    name); ``stats``: each group's input statistics of the ORIGINAL block (a fold into a later group's
    linear, v's rows for o, is accounted for here). Returns each group's choice by its input's name.
    """
    results: dict[str, GroupResult] = {}
    scaled: dict[str, GroupBlocks] = {}
    for group in groups:
        weights = [tensors[f"{n}.weight"].float() for n in group.linears]
        st = stats[group.input]
        s, result = search_scale(weights, st, scheme, group.fold.heads)
        results[group.input] = result
        full = _expand(s, group.fold.heads)
        del weights
        for n in group.linears:  # one scaled copy at a time
            tensors[f"{n}.weight"] = tensors[f"{n}.weight"].float() * full
        fold_inverse(tensors, group.fold, s)
        if clip and group.clip:
            scaled[group.input] = GroupBlocks.of(st, full, scheme.group_size)  # type: ignore[arg-type]
    if clip:
        for group in groups:
            for n in group.clip:
                tensors[f"{n}.weight"] = search_clip(tensors[f"{n}.weight"], scaled[group.input], scheme)
    return results
