"""``QuantLinear``: a linear layer holding quantized weights, and the module walk that swaps it in."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from localllm.quant import kernels
from localllm.quant.formats import QuantScheme, canonical_shapes, dequantize
from localllm.quant.kernel_base import Layout
from localllm.quant.target import Target


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with W kept in a quantized format.

    Built with the scheme's canonical buffers (see :mod:`quant.formats`), usually on ``meta`` so a
    checkpoint can assign them without allocation. :meth:`prepare` then picks the kernel for the
    device and activation dtype and replaces the canonical buffers by the kernel's layout, which it
    records in :attr:`layout` where the kernel has several.
    """

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        for name, (shape, dtype) in canonical_shapes(scheme, out_features, in_features).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel: type[kernels.Kernel] | None = None
        #: The layout :meth:`prepare` laid the tensors out in, for a kernel with several (a GGUF layer's
        #: blocks, or the tiles they are repacked into): what the kernel's products are picked by.
        self.layout: Layout | None = None
        #: A tied model's embedding reads this head's rows (:class:`TiedHeadEmbedding`): its kernel
        #: keeps them readable.
        self.serves_embedding = False
        self.act_dtype = torch.bfloat16

    def canonical(self) -> dict[str, torch.Tensor]:
        """The canonical tensors of the weight (valid until :meth:`prepare` drops them for a kernel
        layout). An act-order layer's ``perm`` is not among them: it stays, and :meth:`forward` applies it."""
        names = canonical_shapes(self.scheme, self.out_features, self.in_features)
        return {n: getattr(self, n) for n in names if n != "perm"}

    def prepare(self, act_dtype: torch.dtype, kernel: str | None = None,
                verdicts: dict[tuple, bool] | None = None, target: Target | None = None,
                check: bool = True) -> str:
        """Choose the kernel for this device/dtype (or the one named, where it can run this layer: a
        forced int4 kernel leaves an int8 head to the automatic choice, but an opt-in one passes it to
        its family's int8 member), repack, and return its name.

        ``verdicts`` carries the reference checks across the layers of a model: a kernel's layout is
        right or wrong for a shape, not for particular weights, so one layer of each shape is checked
        (4 checks rather than 120 for a 30-layer model, a quarter of a second of every start).

        ``target``: the device kernels are chosen for, with a CUDA device's capability
        (:class:`quant.target.Target`; default: read from the device the layer's tensors are on). It
        must be the device they are on. ``check=False`` skips the check against the reference, for a
        caller that cannot compute numbers (the CUDA dry run's fake tensors): the first kernel that
        supports the layer is taken unchecked.

        A layer that ends on the slow reference while fast kernels exist for its scheme says so, once
        a process for each reason (see :func:`kernels.warn_once`). A prepared layer is prepared already: asked
        again for the same activation dtype it returns its kernel's name (the canonical tensors are gone).
        """
        if self.kernel is not None:
            if act_dtype != self.act_dtype:
                raise ValueError(f"layer already prepared for {self.act_dtype} activations, not {act_dtype}")
            return self.kernel.name
        device = self.device
        if target is None:
            target = Target.of(device)
        elif target.type != device.type:
            raise ValueError(f"layer on {device} prepared for {target.describe()}")
        self.act_dtype = act_dtype
        named = kernels.BY_NAME[kernel] if kernel is not None else None
        # the kernel named, and for an opt-in one the other members of its family
        named_family = [k for k in kernels.KERNELS if k is named or (
            named is not None and named.opt_in and k.opt_in and k.family == named.family)]
        choices = [k for k in named_family if k.supports(self, target, act_dtype)][:1]
        if not choices:
            choices = kernels.candidates(self, target, act_dtype)
            for k in named_family:
                if k.scheme == self.scheme.name:  # named for this scheme, and it cannot run here: say so
                    kernels.warn_once(f"kernel {k.name} cannot run {self.scheme.label()} layers here: it "
                                      f"{k.unsupported(self, target, act_dtype)}; they take the default kernel")
        verdicts = {} if verdicts is None else verdicts
        disagreeing = []
        for k in choices:
            caveat = k.caveat(self)
            if caveat is not None:
                kernels.warn_once(caveat)
            tensors = k.prepare(self)
            if k is kernels.Reference:
                break
            if not check:
                break
            key = (k.name, self.scheme, self.out_features, self.in_features, act_dtype, target)
            if key not in verdicts:
                verdicts[key] = kernels.agrees_with_reference(self, k, tensors)
            if verdicts[key]:
                break
            disagreeing.append(k.name)
            del tensors  # the next choice's layout is made from the canonical tensors, not beside this one
        else:
            k, tensors = kernels.Reference, kernels.Reference.prepare(self)
        if k is kernels.Reference and kernel != kernels.Reference.name:
            why = [f"{name} disagrees with the reference here" for name in disagreeing]
            why += kernels.why_not_fast(self, target, act_dtype)
            if why:
                kernels.warn_once(f"{self.scheme.label()} layers run on the slow reference kernel (it dequantizes "
                          f"the weight at every call): {'; '.join(why)}")
        elif disagreeing:
            kernels.warn_once(f"kernel {', '.join(disagreeing)} disagrees with the reference on {self.scheme.label()} "
                      f"layers here; they run on {k.name}")
        for name in set(self.canonical()) - set(tensors):
            delattr(self, name)  # the kernel's layout replaces it: never hold both
        for name, t in tensors.items():
            if name in self._buffers:
                self._buffers[name] = t
            else:
                self.register_buffer(name, t)
        self.kernel = k
        self.layout = k.layout_for(self)
        return k.name

    @property
    def device(self) -> torch.device:
        return next(iter(self._buffers.values())).device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError("QuantLinear used before prepare()")
        shape = x.shape
        if self.scheme.act_order:  # the stored columns are the input's in act order (quant.formats)
            x = x.index_select(-1, self.perm)
        y = self.kernel.matmul(self, x.reshape(-1, shape[-1]).to(self.act_dtype))
        y = y.view(*shape[:-1], self.out_features).to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        kernel = self.kernel.name if self.kernel else "unprepared"
        return f"in={self.in_features}, out={self.out_features}, {self.scheme.label()}, kernel={kernel}"


def concat_linears(modules: list[nn.Module]) -> nn.Module:
    """One layer computing ``cat([m(x) for m in modules], -1)``: their weights stacked along the output.

    Works on float ``nn.Linear`` and on unprepared ``QuantLinear`` of one scheme (the canonical
    formats keep each output row's codes and scales on that row, so rows stack as they are), loaded
    or on ``meta`` (a model fused before its weights arrive: see :func:`loaders.build.load_weights`).
    """
    first = modules[0]
    out = sum(m.out_features for m in modules)
    biases = [m.bias for m in modules if m.bias is not None]
    if isinstance(first, QuantLinear):
        if first.kernel is not None or any(not isinstance(m, QuantLinear) or m.scheme != first.scheme for m in modules):
            raise ValueError("only unprepared QuantLinear layers of one scheme can be concatenated")
        with torch.device("meta"):
            fused = QuantLinear(first.in_features, out, first.scheme, bias=bool(biases))
        for name in first.canonical():
            setattr(fused, name, _cat([getattr(m, name) for m in modules]))
    else:
        with torch.device("meta"):
            fused = type(first)(first.in_features, out, bias=bool(biases))  # the model's Linear: no random init
        fused.weight = nn.Parameter(_cat([m.weight for m in modules]), requires_grad=False)
    if biases:  # a layer without bias contributes zeros
        ref = biases[0]
        fused.bias = nn.Parameter(_cat([m.bias if m.bias is not None else ref.new_zeros(m.out_features)
                                        for m in modules]), requires_grad=False)
    return fused


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Rows stacked; on ``meta`` only the shape (torch.cat's meta kernel imports torch._dynamo, 0.8 s)."""
    first = tensors[0]
    if first.device.type == "meta":
        return torch.empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), dtype=first.dtype, device="meta")
    return torch.cat(tensors, dim=0)


def default_filter(name: str, module: nn.Module) -> bool:
    """Quantize every linear layer of the blocks; leave the output head (and the embedding) in 16-bit."""
    return isinstance(module, nn.Linear) and name.startswith("layers.")


def make_plan(model: nn.Module, scheme: QuantScheme, head: QuantScheme | None = None,
              keep: Callable[[str, nn.Module], bool] = default_filter) -> dict[str, QuantScheme]:
    """Which linear layers get which scheme: ``scheme`` for those ``keep`` selects (the blocks'),
    ``head`` for the output head (None: the head stays float)."""
    plan = {name: scheme for name, m in model.named_modules() if keep(name, m)}
    if head is not None and isinstance(getattr(model, "output", None), nn.Linear):
        plan["output"] = head
    return plan


def swap_linears(model: nn.Module, plan: dict[str, QuantScheme] | QuantScheme) -> list[str]:
    """Replace each ``nn.Linear`` named in ``plan`` by a :class:`QuantLinear` of its scheme (a bare
    scheme means :func:`make_plan`'s default: every block linear, head left float).

    Works on a model on ``meta`` (nothing is allocated). Returns the names of swapped layers.
    """
    if isinstance(plan, QuantScheme):
        plan = make_plan(model, plan)
    swapped = []
    for name, module in list(model.named_modules()):
        if name not in plan or not isinstance(module, nn.Linear):
            continue
        scheme = plan[name]
        scheme.check_layer(name, module.in_features)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.device("meta"):
            q = QuantLinear(module.in_features, module.out_features, scheme, bias=module.bias is not None)
        setattr(parent, child, q)
        swapped.append(name)
    return swapped


def prepare_model(model: nn.Module, act_dtype: torch.dtype, kernel: str | None = None,
                  verdicts: dict[tuple, bool] | None = None, target: Target | None = None,
                  check: bool = True) -> Counter[str]:
    """Prepare every QuantLinear not prepared yet (a streaming load prepares each as its tensors
    arrive); returns how many layers use each kernel (for ``--verbose``). ``target`` and ``check``
    as in :meth:`QuantLinear.prepare`."""
    used: Counter[str] = Counter()
    verdicts = {} if verdicts is None else verdicts
    for module in model.modules():
        if isinstance(module, QuantLinear):
            used[module.prepare(act_dtype, kernel, verdicts, target, check)] += 1
    return used



class TiedHeadEmbedding(nn.Module):
    """The token embedding read from a quantized output head, for models that tie the two.

    The head's rows are the embedding table quantized, so a tied model keeps one table at the head's
    bits instead of a 16-bit embedding beside it: an int8 head's codes with their scales (one per row,
    or one per group of a row), or a GGUF head's blocks as the file has them (a Q4_K_M file's tied
    Q6_K ``token_embd``). Each looked-up row is formed in fp32, where it is exact (``q * scale``, or
    the block decoder's values, bit for bit ``gguf.quants.dequantize``), then rounded once to the
    activation dtype: the values a 16-bit table made from the same tensor holds (but for a K-quant head
    under the opt-in ``gguf-q8-cpu`` kernel, whose rows carry the scales that kernel rounds to fp16).
    """

    def __init__(self, head: QuantLinear) -> None:
        super().__init__()
        if not head_serves_embedding(head.scheme):
            raise ValueError(f"a {head.scheme.label()} head does not serve as an embedding")
        self._head = [head]  # a plain list: not a submodule, so its tensors are not listed twice
        head.serves_embedding = True  # its kernel keeps the rows readable (a GGUF head keeps its blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        rows_of = head.kernel.rows_of if head.kernel is not None else None
        if rows_of is not None:  # a kernel that keeps the codes in a layout of its own
            rows = rows_of(head, tokens.reshape(-1))  # (B*T, D) fp32
            return rows.view(*tokens.shape, head.in_features).to(head.act_dtype)
        if head.scheme.is_float:  # a 16-bit head (quant.float_kernels): its weight is the table
            return F.embedding(tokens, head.weight).to(head.act_dtype)
        if head.scheme.name == "gguf":
            rows = self._block_rows(head, tokens.reshape(-1))  # (B*T, D) fp32
            return rows.view(*tokens.shape, head.in_features).to(head.act_dtype)
        rows = head.qweight[tokens].float()  # (B, T, D): the canonical int8 codes
        s = head.scales[tokens].float()  # (B, T) or (B, T, D / group)
        if s.dim() == rows.dim():  # per group: each scale covers `group` consecutive columns
            out = (rows.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)
        else:
            out = rows * s.unsqueeze(-1)
        return out.to(head.act_dtype)

    @staticmethod
    def _block_rows(head: QuantLinear, tokens: torch.Tensor) -> torch.Tensor:
        """(N,) ids -> (N, D) fp32: the head's GGUF block rows of ``tokens``, decoded (only these rows)."""
        blocks = head.blocks.index_select(0, tokens)  # (N, row bytes) uint8
        if blocks.device.type == "cpu" and head.kernel is not kernels.Reference:
            return kernels.gguf_dequantize(blocks, head.scheme.gguf_type, head.in_features)
        return dequantize({"blocks": blocks}, head.scheme, torch.float32)


def head_serves_embedding(head: QuantScheme | None) -> bool:
    """Whether a tied model's output head in scheme ``head`` also serves as its token embedding (kept
    once, :class:`TiedHeadEmbedding`): an int8 head's rows and scales, or a GGUF head's blocks, are
    the table itself, as is a 16-bit head's weight (a float model on the CPU). Other heads (int4,
    nf4: re-rounded) keep a 16-bit embedding beside them."""
    return head is not None and head.name in ("int8", "gguf", "fp16", "bf16")


def share_tied_embedding(model: nn.Module) -> bool:
    """Replace a tied model's 16-bit embedding by :class:`TiedHeadEmbedding` when its head serves as
    one (:func:`head_serves_embedding`: the table is then stored once). Returns whether it did.

    Done on the ``meta`` model before loading, the embedding is never allocated: the model's state
    dict then has no ``embed.weight``, and the head's tensors fill both."""
    head = getattr(model, "output", None)
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    if isinstance(getattr(model, "embed", None), TiedHeadEmbedding):
        return True
    if not (tied and isinstance(head, QuantLinear) and head_serves_embedding(head.scheme)):
        return False
    model.embed = TiedHeadEmbedding(head)
    return True
