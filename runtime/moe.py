"""The Mixture-of-Experts block: a router picks ``n_active`` of ``n_experts`` gated MLPs for each row,
and their outputs are summed with the routing weights (Qwen3-MoE, Qwen2-MoE with its shared expert,
Mixtral).

Parameter names (beside a dense block's, in place of its ``mlp.{gate,up,down}``)::

    layers.{i}.mlp.router.weight                 (E, D), float: never quantized (+ .bias (E,): gpt-oss)
    layers.{i}.mlp.experts.{gate,up}.<tensors>   (E, F, ...) stacked experts (quant.experts.QuantExperts)
    layers.{i}.mlp.experts.down.<tensors>        (E, D, ...)
    layers.{i}.mlp.shared.{gate,up,down}.weight  Qwen2-MoE's shared expert (a dense MLP)
    layers.{i}.mlp.shared_gate.weight            (1, D), its sigmoid gate, float
    layers.{i}.mlp.experts.{gate,up}_bias        (E, F) gpt-oss's expert biases, float
    layers.{i}.mlp.experts.down_bias             (E, D)

gpt-oss routes by a softmax over the top-k logits (``config.topk_softmax``: the same weights as a
softmax over all, top-k and renormalised, up to rounding) and runs its experts' clamped SwiGLU
(:class:`quant.experts.ClampedSwiGLU`) with their biases, in the same one call.

Routing works on the flattened rows of the step (prefill chunks, decode rows, speculation's verify
rows alike): nothing here knows about sequences. The router's logits are computed in the activation
dtype, the softmax and top-k in fp32 (as transformers does), and the experts run through
:func:`quant.experts.experts_ffn` by the kernel chosen when the model was prepared.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from localllm.quant.experts import ClampedSwiGLU, ExpertBiases, QuantExperts, experts_ffn, prepare_experts
from localllm.quant.formats import QuantScheme
from localllm.quant.target import Target
from localllm.runtime.config import CLAMPED_SWIGLU, ModelConfig


class Router(nn.Module):
    """The router's (E, D) weight (and gpt-oss's (E,) bias); not an ``nn.Linear``, so no quantization
    plan takes it."""

    def __init__(self, dim: int, n_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Experts(nn.Module):
    """A layer's experts: ``gate``, ``up`` and ``down`` projections of all of them, or ``gate_up`` and
    ``down`` once :func:`loaders.build.fuse_projections` stacked gate and up (one product fewer)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E, D, F_ = config.n_experts, config.dim, config.expert_size
        placeholder = QuantScheme("fp32")  # float experts until a plan swaps them (quant.experts.swap_experts)
        self.gate: QuantExperts | None = QuantExperts(E, D, F_, placeholder)  # type: ignore[arg-type]
        self.up: QuantExperts | None = QuantExperts(E, D, F_, placeholder)  # type: ignore[arg-type]
        self.down = QuantExperts(E, F_, D, placeholder)  # type: ignore[arg-type]
        self.gate_up: QuantExperts | None = None
        self.act: str | ClampedSwiGLU = config.mlp_act
        if config.mlp_act == CLAMPED_SWIGLU:
            self.act = ClampedSwiGLU(float(config.swiglu_limit), float(config.swiglu_alpha))  # type: ignore[arg-type]
        #: gpt-oss's biases, float (never quantized): gate's and up's (E, F), down's (E, D).
        self.gate_bias = self.up_bias = self.down_bias = None
        if config.expert_bias:
            self.gate_bias = nn.Parameter(torch.empty(E, F_), requires_grad=False)  # type: ignore[arg-type]
            self.up_bias = nn.Parameter(torch.empty(E, F_), requires_grad=False)  # type: ignore[arg-type]
            self.down_bias = nn.Parameter(torch.empty(E, D), requires_grad=False)  # type: ignore[arg-type]

    def biases(self) -> ExpertBiases | None:
        """What :func:`quant.experts.experts_ffn` takes as ``biases`` (None: the experts have none)."""
        if self.gate_bias is None:
            return None
        return ExpertBiases(self.gate_bias, self.up_bias, self.down_bias)  # type: ignore[arg-type]

    def projections(self) -> QuantExperts | tuple[QuantExperts, QuantExperts]:
        """What :func:`quant.experts.experts_ffn` takes as ``gate_up``."""
        if self.gate_up is not None:
            return self.gate_up
        return self.gate, self.up  # type: ignore[return-value]

    def prepare(self, act_dtype: torch.dtype, kernel: str | None = None, target: Target | None = None,
                check: bool = True, verdicts: dict[tuple, bool] | None = None) -> str:
        for bias in (self.gate_bias, self.up_bias, self.down_bias):
            if bias is not None and bias.dtype != torch.float32 and bias.device.type != "meta":
                bias.data = bias.data.float()  # as the kernels add them: once here, not a copy every step
        return prepare_experts(self.projections(), self.down, act_dtype, kernel, target, check, self.act, verdicts,
                               self.biases())

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        home = self.down.device
        if x.device == home:
            return experts_ffn(x, ids, weights, self.projections(), self.down, self.act, self.biases())
        # Experts kept in CPU RAM (loaders.placement) while the hidden states are on the GPU: the rows,
        # their routed ids and weights go to the host (the copies wait for the router: the one sync),
        # the experts' kernel runs there, and the sum comes back without blocking.
        y = experts_ffn(x.to(home), ids.to(home), weights.to(home), self.projections(), self.down, self.act,
                        self.biases())  # (N, D) on the host
        return y.to(x.device, non_blocking=True)


class MoE(nn.Module):
    """The sparse MLP of a layer (used by :class:`runtime.model.Block` in place of ``MLP``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        from localllm.runtime.model import MLP  # the shared expert is a dense MLP of its own size

        self.n_active = config.n_active
        self.norm_topk_prob = config.norm_topk_prob
        self.topk_softmax = config.topk_softmax
        #: Qwen rounds the routing weights to the activation dtype before the experts use them.
        self.round_weights = config.arch != "mixtral"
        self.router = Router(config.dim, config.n_experts, config.router_bias)  # type: ignore[arg-type]
        self.experts = Experts(config)
        self.shared: nn.Module | None = None
        self.shared_gate: Router | None = None
        if config.shared_expert_size is not None:
            self.shared = MLP(config, config.shared_expert_size)
            self.shared_gate = Router(config.dim, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, D) -> the chosen experts (N, k) int64 and their weights (N, k) fp32."""
        if self.topk_softmax:  # gpt-oss: the k largest logits, then a softmax over them alone
            logits, ids = torch.topk(self.router(x).float(), self.n_active, dim=-1)  # (N, k)
            return ids, torch.softmax(logits, dim=-1).to(x.dtype).float()
        probs = torch.softmax(self.router(x).float(), dim=-1)  # (N, E)
        weights, ids = torch.topk(probs, self.n_active, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D): every row of the step
        ids, weights = self.route(flat)
        y = self.experts(flat, ids, weights)  # (N, D)
        if self.shared is not None and self.shared_gate is not None:
            y = y + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return y.view(shape)


def prepare_moe(model: nn.Module, act_dtype: torch.dtype, kernel: str | None = None, target: Target | None = None,
                check: bool = True, host: Target | None = None) -> Counter[str]:
    """Choose and lay out the expert kernel of every MoE layer not prepared yet; how many layers use
    each (for ``--verbose``). ``kernel`` names an expert kernel to prefer (where it can run them).
    Experts the loader placed on ``host`` (CPU RAM on a GPU run) get ``host``'s kernel and are counted
    apart (``experts-moe-blocks-cpu on cpu``)."""
    used: Counter[str] = Counter()
    verdicts: dict[tuple, bool] = {}
    for module in model.modules():
        if isinstance(module, Experts):
            apart = host is not None and target is not None and host.device != target.device \
                and module.down.device == host.device
            name = module.prepare(act_dtype, kernel, host if apart else target, check, verdicts)
            used[f"experts-{name}" + (f" on {host.device}" if apart and host is not None else "")] += 1
    return used
