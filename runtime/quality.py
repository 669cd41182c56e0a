"""How far a model's predictions move from a reference's: perplexity, KL divergence, top-1 agreement.

Both models read the same tokens in windows of ``window`` positions (no cache: a model holds no
sequence state, so this runs beside live generators of the same models without touching them); per
position we compare the next-token distributions. Nothing but running sums is kept, so long texts and large
vocabularies need no more memory than one window's logits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from localllm.runtime.model import Transformer


@dataclass
class Quality:
    """Of one model against the reference, over ``tokens`` predicted positions."""

    tokens: int
    perplexity: float
    ref_perplexity: float
    kld: float  # mean KL(reference || model), nats
    top1: float  # fraction of positions where both models' most likely token agree

    @property
    def ppl_ratio(self) -> float:
        return self.perplexity / self.ref_perplexity

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "ppl_ratio": self.ppl_ratio}


@torch.inference_mode()
def _window_logprobs(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    return model(ids.to(model.device)).float().log_softmax(-1).cpu()  # (1, T, V)


def compare(
    reference: Transformer, models: dict[str, Transformer], ids: list[int], window: int = 512
) -> dict[str, Quality]:
    """Quality of each of ``models`` against ``reference`` on the token ids ``ids``.

    The text is cut into non-overlapping windows of ``window`` tokens; within each, position t
    predicts token t+1.
    """
    sums = {name: {"nll": 0.0, "kld": 0.0, "top1": 0.0} for name in models}
    ref_nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window + 1]])
        if chunk.shape[1] < 2:
            break
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        ref = _window_logprobs(reference, inputs)  # (1, T, V)
        ref_nll -= ref.gather(-1, targets[..., None]).sum().item()
        ref_top = ref.argmax(-1)
        ref_p = ref.exp()
        for name, model in models.items():
            lp = _window_logprobs(model, inputs)
            s = sums[name]
            s["nll"] -= lp.gather(-1, targets[..., None]).sum().item()
            # Each position's KL summed in float64 and floored at 0: it is never negative, but a model
            # whose logits equal the reference's up to rounding (the same weights on another kernel
            # path) sums to a few -1e-9 in fp32 over a large vocabulary.
            s["kld"] += (ref_p * (ref - lp)).sum(-1, dtype=torch.float64).clamp(min=0).sum().item()
            s["top1"] += (lp.argmax(-1) == ref_top).sum().item()
        count += targets.numel()
    ref_ppl = float(torch.tensor(ref_nll / count).exp())
    return {
        name: Quality(count, float(torch.tensor(s["nll"] / count).exp()), ref_ppl, s["kld"] / count, s["top1"] / count)
        for name, s in sums.items()
    }
