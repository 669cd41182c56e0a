"""A Mixture-of-Experts layer's experts: their stacked quantized weights (:class:`QuantExperts`), and
the one call that runs a layer's whole expert FFN over a flattened batch (:func:`experts_ffn`).

Tensor layouts
--------------

:class:`QuantExperts` is ONE projection of all ``E`` experts of a layer (``gate``, ``up``, ``down``, or
``gate_up``: gate and up stacked along the output). Its canonical tensors are those of
:mod:`quant.formats` for an (out, in) weight with a leading expert dim, expert ``e``'s at ``[e]``:

* ``int4``  ``qweight`` uint8 (E, out, in/2) low nibble first; ``scales``, ``offsets`` fp16 (E, out, in/group)
* ``int8``  ``qweight`` int8 (E, out, in); ``scales`` fp16 (E, out) per channel or (E, out, in/group)
* ``nf4``   ``qweight`` uint8 (E, out, in/2) high nibble first; ``absmax`` fp32 (E, out, in/block)
* ``gguf``  ``blocks`` uint8 (E, out, row bytes): the file's blocks of each expert row, as they are
* ``fp32`` / ``fp16`` / ``bf16``: ``weight`` (E, out, in)

so ``{name: t[e] for name, t in proj.canonical().items()}`` is expert ``e``'s weight in the canonical
format of one layer (:meth:`QuantExperts.expert`), which :func:`quant.formats.dequantize` reads.
A fused ``gate_up`` holds gate's rows ``[0, F)`` then up's ``[F, 2F)`` of each expert (F: the expert
intermediate size), as :func:`quant.linear.concat_linears` stacks a dense MLP's.

The FFN contract
----------------

``experts_ffn(x, ids, weights, gate_up, down, act, biases=None) -> y``:

* ``x``        (N, D) activations in the kernel's activation dtype: every routed row of the step (prefill
  chunks, decode rows, verify rows of speculation alike; the caller flattens the batch);
* ``ids``      (N, k) int64: the k experts chosen for each row (any order, each in ``[0, E)``; a row
  names an expert at most once);
* ``weights``  (N, k) float32: each chosen expert's routing weight (already softmaxed / renormalised
  by the router: the kernel only multiplies by it);
* ``gate_up``  one fused :class:`QuantExperts` (E, 2F, D), or the pair ``(gate, up)`` each (E, F, D);
* ``down``     :class:`QuantExperts` (E, D, F);
* ``act``      ``"silu"`` (SwiGLU: Qwen-MoE, Mixtral, OLMoE) or ``"gelu_tanh"`` (GeGLU), on the gate; or
  a :class:`ClampedSwiGLU` (gpt-oss): ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``,
  ``g = clamp(gate, max=l)`` in place of ``act(gate) * up``;
* ``biases``   None, or an :class:`ExpertBiases` (gpt-oss): each expert's gate and up biases (E, F),
  added before the activation, and down's (E, D), added to each expert's output before its weight;

``y[n] = sum_j weights[n, j] * down_e(act(gate_e(x[n])) * up_e(x[n]))`` with ``e = ids[n, j]``, (N, D) in
``x``'s dtype (the reference sums in fp32). The router, the top-k and any shared expert are not the
kernel's: :mod:`runtime.moe` owns them.

Kernels
-------

:data:`EXPERT_KERNELS` lists the expert kernels in order of preference, :class:`ReferenceExperts`
last. :func:`prepare_experts` picks, once a layer when the model is prepared, the first that
``supports`` all the layer's projections on the target with the activation dtype and agrees with the
reference on a small random batch (a kernel that disagrees is dropped with a warning, as a dense
layer's is), has it ``prepare`` each projection's tensors (replacing the canonical ones: never both),
and records it on each projection (``proj.kernel``). :func:`experts_ffn` then calls that kernel's
``ffn``. A kernel class (subclass :class:`ExpertKernel`) has:

* ``name`` (str), ``opt_in`` (taken only when named), ``device_type`` (None: any);
* ``unsupported(projs, target, act_dtype) -> str | None`` (why not, in a few words; ``supports`` wraps it);
* ``prepare(proj) -> dict[str, Tensor]``: its layout of one projection, made from ``proj.canonical()``;
* ``ffn(x, ids, weights, gate_up, down, act) -> Tensor``: the contract above.

A native kernel appends itself to :data:`EXPERT_KERNELS` before the reference (the list is the
registry; nothing else needs to change).

Loading
-------

Float experts (a model not quantized) hold ``weight`` as an ``nn.Parameter`` (E, out, in) in the
model's dtype, as a float linear does; :attr:`QuantExperts.scheme` then names that dtype. A stream
fills a stacked tensor whole (``layers.3.mlp.experts.gate.qweight``) or one expert at a time under
:func:`expert_name` (``layers.3.mlp.experts.17.gate.qweight``, parsed by :func:`split_expert_name`):
the loader (:func:`loaders.build.load_weights`), the store's writer and the quantizing stream
(:func:`quant.convert.quantize_stream`) all take both. :func:`loaders.build.fuse_projections` stacks
gate and up into ``gate_up`` (:func:`concat_experts`) when their schemes agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import re

import torch
import torch.nn.functional as F
from torch import nn

from localllm.quant.formats import FLOAT_SCHEMES, QuantScheme, canonical_shapes
from localllm.quant.kernels import warn_once
from localllm.quant.reference import reference_linear
from localllm.quant.target import Target

#: The activations :func:`experts_ffn` takes on the gate by name (and a :class:`ClampedSwiGLU`).
ACTIVATIONS = ("silu", "gelu_tanh")


class QuantExperts(nn.Module):
    """One projection (an (out, in) weight) of all ``n_experts`` experts of a layer, in ``scheme``:
    the canonical tensors of :mod:`quant.formats` stacked along a leading expert dim (see the module
    docstring). Built on ``meta`` by the model; the loader assigns each tensor, filled one expert at a
    time as the checkpoint streams (:meth:`expert` views are writable).

    A float scheme (the model's experts before :func:`swap_experts`) holds ``weight`` as a parameter,
    as a float ``nn.Linear`` does: it loads in the model's dtype, and :attr:`scheme` follows it."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, scheme: QuantScheme) -> None:
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self._scheme = scheme
        for name, (shape, dtype) in canonical_shapes(scheme, out_features, in_features).items():
            if scheme.is_float:
                self.weight = nn.Parameter(torch.empty((n_experts, *shape), dtype=dtype), requires_grad=False)
            else:
                self.register_buffer(name, torch.empty((n_experts, *shape), dtype=dtype))
        self.bias = None  # none of the families' experts has one (the fusion of gate and up asks)
        #: The kernel :func:`prepare_experts` chose (None: not prepared yet).
        self.kernel: type[ExpertKernel] | None = None
        self.act_dtype = torch.bfloat16

    @property
    def scheme(self) -> QuantScheme:
        """The weights' scheme (a float one names the dtype the weight holds now)."""
        if self._scheme.is_float:
            return QuantScheme(next(n for n, d in FLOAT_SCHEMES.items() if d == self.weight.dtype))
        return self._scheme

    def canonical_names(self) -> tuple[str, ...]:
        return tuple(canonical_shapes(self.scheme, self.out_features, self.in_features))

    def canonical(self) -> dict[str, torch.Tensor]:
        """The stacked canonical tensors (valid until a kernel's layout replaces them)."""
        return {n: getattr(self, n) for n in self.canonical_names()}

    def expert(self, e: int) -> dict[str, torch.Tensor]:
        """Expert ``e``'s canonical tensors, as a dense layer of this scheme holds them (views)."""
        return {n: t[e] for n, t in self.canonical().items()}

    @property
    def device(self) -> torch.device:
        return next(iter([*self._parameters.values(), *self._buffers.values()])).device

    def extra_repr(self) -> str:
        kernel = self.kernel.name if self.kernel else "unprepared"
        return (f"experts={self.n_experts}, in={self.in_features}, out={self.out_features}, "
                f"{self.scheme.label()}, kernel={kernel}")


def projections(gate_up: "QuantExperts | tuple[QuantExperts, QuantExperts]", down: QuantExperts) -> list[QuantExperts]:
    """The layer's projections as a list: ``[gate_up, down]`` or ``[gate, up, down]``."""
    return [*gate_up, down] if isinstance(gate_up, tuple) else [gate_up, down]


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: gate clamped above at ``limit``, up to ``[-limit, limit]``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)`` (transformers' ``GptOssExperts._apply_gate``)."""

    limit: float
    alpha: float = 1.702


class ExpertBiases(NamedTuple):
    """A layer's expert biases (gpt-oss), float: gate's and up's (E, F), down's (E, D)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def activate(gate: torch.Tensor, up: torch.Tensor, act: "str | ClampedSwiGLU") -> torch.Tensor:
    """``act(gate) * up`` (gate and up (n, F)); gpt-oss's clamped form for a :class:`ClampedSwiGLU`."""
    if isinstance(act, ClampedSwiGLU):
        g = gate.clamp(max=act.limit)
        return (up.clamp(-act.limit, act.limit) + 1) * (g * torch.sigmoid(g * act.alpha))
    if act == "silu":
        return F.silu(gate) * up
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unknown expert activation {act!r} (known: {', '.join(ACTIVATIONS)})")


class ExpertKernel:
    """A way to run a layer's expert FFN. Subclasses set ``name`` and override :meth:`unsupported`,
    :meth:`prepare` and :meth:`ffn` (see the module docstring for the contract)."""

    name = "base"
    opt_in = False
    device_type: str | None = None

    @classmethod
    def supports(cls, projs: Sequence[QuantExperts], target: "Target | torch.device", act_dtype: torch.dtype) -> bool:
        return cls.unsupported(projs, Target.of(target), act_dtype) is None

    @staticmethod
    def unsupported(projs: Sequence[QuantExperts], target: Target, act_dtype: torch.dtype) -> str | None:
        raise NotImplementedError

    @staticmethod
    def prepare(proj: QuantExperts) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def ffn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            gate_up: "QuantExperts | tuple[QuantExperts, QuantExperts]", down: QuantExperts,
            act: "str | ClampedSwiGLU", biases: ExpertBiases | None = None) -> torch.Tensor:
        raise NotImplementedError


def route_order(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (row, slot) pairs of ``ids`` (N, k) grouped by expert: ``order`` (N*k,) indexes the flattened
    pairs sorted by expert (stable), ``rows`` (N*k,) their row in ``x``, and each expert's count (a
    list: one read back a layer)."""
    flat = ids.reshape(-1)  # (N*k,)
    order = torch.argsort(flat, stable=True)
    rows = order // ids.shape[1]
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    return order, rows, counts


class ReferenceExperts(ExpertKernel):
    """Pure torch on every scheme and device: pairs sorted by expert; each active expert's rows
    multiplied by its weights, dequantized a slice of rows at a time (:func:`quant.reference.reference_linear`);
    results scattered back with their routing weights, summed in fp32."""

    name = "reference"

    @staticmethod
    def unsupported(projs, target, act_dtype):  # type: ignore[no-untyped-def]
        return None

    @staticmethod
    def prepare(proj):  # type: ignore[no-untyped-def]
        return dict(proj.canonical())

    @staticmethod
    def ffn(x, ids, weights, gate_up, down, act, biases=None):  # type: ignore[no-untyped-def]
        N, D = x.shape
        order, rows, counts = route_order(ids, down.n_experts)
        w = weights.reshape(-1)[order].float()  # (N*k,) the sorted pairs' routing weights
        xs = x[rows]  # (N*k, D) each pair's row, grouped by expert
        out = torch.zeros(N, D, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            xe = xs[start : start + n]  # (n, D)
            if isinstance(gate_up, tuple):
                g = reference_linear(gate_up[0].expert(e), gate_up[0].scheme, xe)  # (n, F)
                u = reference_linear(gate_up[1].expert(e), gate_up[1].scheme, xe)
            else:
                g, u = reference_linear(gate_up.expert(e), gate_up.scheme, xe).chunk(2, dim=-1)
            if biases is not None:
                g, u = g + biases.gate[e].to(g), u + biases.up[e].to(u)
            h = reference_linear(down.expert(e), down.scheme, activate(g, u, act))  # (n, D)
            if biases is not None:
                h = h + biases.down[e].to(h)
            out.index_add_(0, rows[start : start + n], h.float() * w[start : start + n, None])
            start += n
        return out.to(x.dtype)


#: Expert kernels in order of preference; the first that supports a layer (and agrees with the
#: reference) runs it. Native kernels insert themselves before :class:`ReferenceExperts`.
EXPERT_KERNELS: list[type[ExpertKernel]] = [ReferenceExperts]
import localllm.quant.expert_kernels  # noqa: E402,F401  (inserts the native moe-blocks-cpu before the reference)


def by_name(name: str) -> type[ExpertKernel]:
    for k in EXPERT_KERNELS:
        if k.name == name:
            return k
    raise ValueError(f"no expert kernel {name!r} (known: {', '.join(k.name for k in EXPERT_KERNELS)})")


def experts_ffn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                gate_up: "QuantExperts | tuple[QuantExperts, QuantExperts]", down: QuantExperts,
                act: "str | ClampedSwiGLU" = "silu", biases: ExpertBiases | None = None) -> torch.Tensor:
    """The layer's expert FFN over ``x`` (N, D) (see the module docstring), by the kernel
    :func:`prepare_experts` chose for it."""
    kernel = down.kernel
    if kernel is None:
        raise RuntimeError("experts used before prepare_experts()")
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    if biases is None:  # a kernel that takes no biases is called as before
        return kernel.ffn(x, ids, weights, gate_up, down, act)
    return kernel.ffn(x, ids, weights, gate_up, down, act, biases)


def _agrees(kernel: type[ExpertKernel], projs: list[QuantExperts], tensors: list[dict[str, torch.Tensor]],
            gate_up: "QuantExperts | tuple[QuantExperts, QuantExperts]", down: QuantExperts,
            act_dtype: torch.dtype, act: "str | ClampedSwiGLU", biases: ExpertBiases | None = None) -> bool:
    """``kernel`` with its prepared ``tensors`` against the reference on 5 random rows routed to a
    spread of experts; True when they agree closely."""
    g = torch.Generator(device="cpu").manual_seed(0)
    E, k = down.n_experts, min(2, down.n_experts)
    n = 5
    x = torch.randn(n, down.out_features, generator=g).to(device=down.device, dtype=act_dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]).to(down.device)
    weights = torch.rand(n, k, generator=g).to(down.device)
    with torch.no_grad():
        want = ReferenceExperts.ffn(x.float(), ids, weights, gate_up, down, act, biases).float()
        saved = [{name: getattr(p, name, None) for name in t} for p, t in zip(projs, tensors)]
        try:
            for p, t in zip(projs, tensors):
                for name, v in t.items():
                    _put(p, name, v)
            got = (kernel.ffn(x, ids, weights, gate_up, down, act) if biases is None else
                   kernel.ffn(x, ids, weights, gate_up, down, act, biases)).float()
        except RuntimeError as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            warn_once(f"expert kernel {kernel.name} fails here ({why})")
            return False
        finally:
            for p, s in zip(projs, saved):
                for name, v in s.items():
                    if v is None:
                        p._buffers.pop(name, None)
                    else:
                        _put(p, name, v)
    err = (got - want).norm() / want.norm().clamp(min=1e-6)
    return bool(err < 2e-2)


def _put(p: QuantExperts, name: str, v: torch.Tensor) -> None:
    """Make ``v`` the projection's tensor ``name``: a kernel's layout is a buffer (in place of a float
    expert's parameter too); a parameter put back stays one."""
    if isinstance(v, nn.Parameter):
        p._buffers.pop(name, None)
        p._parameters[name] = v
        return
    p._parameters.pop(name, None)
    if name in p._buffers:
        p._buffers[name] = v
    else:
        p.register_buffer(name, v)


def prepare_experts(gate_up: "QuantExperts | tuple[QuantExperts, QuantExperts]", down: QuantExperts,
                    act_dtype: torch.dtype, kernel: str | None = None, target: Target | None = None,
                    check: bool = True, act: "str | ClampedSwiGLU" = "silu", verdicts: dict[tuple, bool] | None = None,
                    biases: ExpertBiases | None = None) -> str:
    """Choose the expert kernel for this layer's projections on ``target`` (default: their device) with
    ``act_dtype`` activations (the one ``kernel`` names where it can run them), lay out each projection's
    tensors for it, and return its name. ``verdicts`` carries the check against the reference across
    layers (one check a shape); ``check=False`` takes the first that supports the layer unchecked. A
    prepared layer returns its kernel's name."""
    projs = projections(gate_up, down)
    if down.kernel is not None:
        return down.kernel.name
    target = Target.of(down.device) if target is None else target
    named = [by_name(kernel)] if kernel is not None else []
    choices = [k for k in named if k.supports(projs, target, act_dtype)]
    choices += [k for k in EXPERT_KERNELS if not k.opt_in and k not in choices and k.supports(projs, target, act_dtype)]
    verdicts = {} if verdicts is None else verdicts
    for k in choices:
        tensors = [k.prepare(p) for p in projs]
        if k is ReferenceExperts or not check:
            break
        key = (k.name, tuple((p.scheme, p.out_features, p.in_features, p.n_experts) for p in projs), act_dtype, target,
               act, biases is not None)
        if key not in verdicts:
            verdicts[key] = _agrees(k, projs, tensors, gate_up, down, act_dtype, act, biases)
        if verdicts[key]:
            break
        warn_once(f"expert kernel {k.name} disagrees with the reference here; the experts take the next kernel")
        del tensors
    else:
        k = ReferenceExperts
        tensors = [k.prepare(p) for p in projs]
    for p, t in zip(projs, tensors):
        for name in set(p.canonical_names()) - set(t):
            delattr(p, name)  # the kernel's layout replaces it: never both
        for name, v in t.items():
            if getattr(p, name, None) is not v:  # else kept as it is (the reference's canonical tensors)
                _put(p, name, v)
        p.kernel = k
        p.act_dtype = act_dtype
    return k.name



# ----------------------------------------------------------------------------- names, plans, fusion
#: One expert's tensor in a stream: ``{prefix}.experts.{e}.{proj}.{leaf}`` (``layers.3.mlp.experts.17.gate.weight``),
#: expert ``e``'s slice of the stacked ``{prefix}.experts.{proj}.{leaf}``.
_EXPERT_NAME = re.compile(r"^(.+\.experts)\.(\d+)\.([A-Za-z_]+)\.([A-Za-z_]+)$")


def expert_name(experts: str, e: int, proj: str, leaf: str) -> str:
    """The stream name of expert ``e``'s ``leaf`` of projection ``proj`` under module ``experts``."""
    return f"{experts}.{e}.{proj}.{leaf}"


_STACKED = re.compile(r"^(.+\.experts)\.(gate|up|down|gate_up)$")


def stacked_experts(module: str) -> tuple[str, str] | None:
    """``layers.3.mlp.experts.gate`` -> (``layers.3.mlp.experts``, ``gate``): the module of a MoE
    layer's stacked projection, as the model names it (:class:`runtime.moe.Experts`); None otherwise."""
    m = _STACKED.match(module)
    return (m.group(1), m.group(2)) if m is not None else None


def split_expert_name(name: str) -> tuple[str, int] | None:
    """``layers.3.mlp.experts.17.gate.qweight`` -> (``layers.3.mlp.experts.gate.qweight``, 17); None for
    any other name."""
    m = _EXPERT_NAME.match(name)
    if m is None:
        return None
    return f"{m.group(1)}.{m.group(3)}.{m.group(4)}", int(m.group(2))


def experts_plan(model: nn.Module, scheme: QuantScheme) -> dict[str, QuantScheme]:
    """Every expert projection of ``model`` -> ``scheme`` (a plan's entries beside its linears'); each is
    checked against its final scheme when it is swapped (a GGUF's own types replace ``scheme``'s)."""
    return {name: scheme for name, m in model.named_modules() if isinstance(m, QuantExperts)}


def swap_experts(model: nn.Module, plan: dict[str, QuantScheme]) -> list[str]:
    """Replace each float :class:`QuantExperts` named in ``plan`` by one in its scheme, on ``meta``."""
    swapped = []
    for name, m in list(model.named_modules()):
        if name not in plan or not isinstance(m, QuantExperts):
            continue
        plan[name].check_layer(name, m.in_features)  # one line naming why the scheme cannot hold them
        parent_name, _, child = name.rpartition(".")
        with torch.device("meta"):
            q = QuantExperts(m.n_experts, m.in_features, m.out_features, plan[name])
        setattr(model.get_submodule(parent_name), child, q)
        swapped.append(name)
    return swapped


def concat_experts(parts: list[QuantExperts]) -> QuantExperts:
    """One projection whose experts compute ``cat([p_e(x) for p in parts], -1)``: the parts' rows
    stacked within each expert (gate then up). Unprepared projections of one scheme, on ``meta`` or
    loaded."""
    first = parts[0]
    if any(p.kernel is not None or p.scheme != first.scheme or p.n_experts != first.n_experts for p in parts):
        raise ValueError("only unprepared expert projections of one scheme can be concatenated")
    with torch.device("meta"):
        fused = QuantExperts(first.n_experts, first.in_features, sum(p.out_features for p in parts), first._scheme)
    for name in first.canonical_names():
        ts = [getattr(p, name) for p in parts]
        if ts[0].device.type == "meta":
            t = torch.empty((ts[0].shape[0], sum(x.shape[1] for x in ts), *ts[0].shape[2:]), dtype=ts[0].dtype,
                            device="meta")
        else:
            t = torch.cat(ts, dim=1)
        if isinstance(ts[0], nn.Parameter):
            setattr(fused, name, nn.Parameter(t, requires_grad=False))
        else:
            setattr(fused, name, t)
    return fused
