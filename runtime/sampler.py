"""A step's logits to each sequence's next tokens: grammar masks, penalties, the pick, log-probabilities
and draft acceptance, for every sequence that samples in the step at once.

Each sampling sequence owns ``1 + len(seq.draft)`` consecutive logits rows (a verify chunk's rows, or
one). Row j of a verify chunk is the distribution after its first j draft tokens: a draft token is
kept while it is the token its row picks (the same seeded draw as without speculation, so exact), and
the first row that differs gives the step's own token. The per-row math (greedy, temperature, top-k,
top-p, min-p, the repeat penalty, seeded draws) is :mod:`runtime.sampling`'s.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from localllm.runtime.constrain import apply_masks
from localllm.runtime.sampling import greedy, sample, top_k, unit_random
from localllm.runtime.sequence import Sequence, TokenLogprob

#: One sampling sequence's result: the tokens it adds (accepted drafts, then its own) and, when it asked
#: for them, their log-probability entries.
Picked = tuple[list[int], list[TokenLogprob] | None]


def row_spans(seqs: Seq[Sequence]) -> list[tuple[int, int]]:
    """Each sequence's logits rows, (first row, rows), in order."""
    spans, row = [], 0
    for s in seqs:
        spans.append((row, 1 + len(s.draft)))
        row += spans[-1][1]
    return spans


class Sampler:
    """Picks the tokens of a step's sampling sequences from its logits (see the module's docstring).

    Grammar masks are made on the host by :mod:`runtime.constrain`: on the CPU before the forward
    (:meth:`masks_before`), while the caches still hold the grammar's state rather than the weights; on
    a GPU after the forward is queued, while the device runs it.
    """

    def __init__(self, device: torch.device) -> None:
        self.early_masks = device.type == "cpu"

    def masks_before(self, seqs: Seq[Sequence]) -> torch.Tensor | None:
        """The grammar masks to make before the forward (on the CPU), or None."""
        return self._masks(seqs) if self.early_masks else None

    @staticmethod
    def _masks(seqs: Seq[Sequence]) -> torch.Tensor | None:
        """The allowed-token bitmask of every row of each constrained sequence, stacked (rows, words)
        int32: a verify chunk's row j is the mask after its first j draft tokens. None: none is
        constrained."""
        which = [s for s in seqs if s.constraint is not None]
        if not which:
            return None
        words = which[0].constraint.words  # type: ignore[union-attr]  # one vocabulary per model
        bits = torch.empty(sum(1 + len(s.draft) for s in which), words, dtype=torch.int32)
        row = 0
        for s in which:
            n = 1 + len(s.draft)
            s.constraint.fill(bits[row : row + n], s.draft)  # type: ignore[union-attr]
            row += n
        return bits

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence], masks: torch.Tensor | None = None) -> list[Picked]:
        """``logits`` (rows, vocab): the step's rows of ``seqs`` in order (:func:`row_spans`); ``masks``:
        :meth:`masks_before`'s. Masks the constrained rows in place."""
        spans = row_spans(seqs)
        if masks is None:
            masks = self._masks(seqs)
        for (at, _), s in zip(spans, seqs):
            if s.forced is not None:
                s.logits.append(logits[at].float().clone())
        rows_of = [logits[at : at + n] for at, n in spans]
        # The model's own distribution, before the masks below change these rows in place.
        scored = {i: torch.log_softmax(rows_of[i].float(), -1) for i, s in enumerate(seqs)
                  if s.top_logprobs is not None}  # (n, V)
        if masks is not None:
            row = 0
            for i, s in enumerate(seqs):
                if s.constraint is not None:
                    n = spans[i][1]
                    apply_masks(rows_of[i], masks[row : row + n])
                    row += n
        picks = self._pick(logits, seqs, spans, rows_of)
        if not picks:
            return []
        chosen = torch.cat(picks).tolist()  # the one transfer to the host per step
        out: list[Picked] = []
        for i, ((at, n), s) in enumerate(zip(spans, seqs)):
            rows, draft = chosen[at : at + n], s.draft
            kept = 0
            while kept < len(draft) and rows[kept] == draft[kept]:
                kept += 1
            tokens = [*draft[:kept], rows[kept]]
            entries = None
            if i in scored:
                entries = self._logprobs(scored[i][: len(tokens)], tokens, s.top_logprobs or 0)
            out.append((tokens, entries))
        return out

    @staticmethod
    def _pick(logits: torch.Tensor, seqs: Seq[Sequence], spans: list[tuple[int, int]],
              rows_of: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each sequence's picked token per row, (n,) on the logits' device."""
        picks: list[torch.Tensor | None] = [None] * len(seqs)
        plain = [i for i, s in enumerate(seqs) if s.params.greedy and s.recent is None and s.constraint is None]
        if plain:  # greedy rows in one argmax, of every row: indexing by a list of rows would upload
            best = greedy(logits)  # it with a blocking copy (a host sync on CUDA)
            for i in plain:
                at, n = spans[i]
                picks[i] = best[at : at + n]
        # What sampling needs from the host (each row's draw, the penalty's recent ids), uploaded in one
        # non-blocking copy for the whole step: a blocking upload waits for the GPU, one per sequence adds up.
        host: list[float] = []
        inputs: dict[int, tuple[tuple[int, int] | None, list[tuple[int, int]] | None]] = {}
        for i, s in enumerate(seqs):
            if picks[i] is not None:
                continue
            n, length = spans[i][1], len(s.token_ids)
            draws = None
            if not s.params.greedy:  # the draw of each row's position
                draws = (len(host), n)
                host += [unit_random(s.seed, length + j) for j in range(n)]
            windows = None
            if s.recent is not None:  # the penalty's window of each row: the drafts before it too
                windows, width = [], s.params.repeat_last_n
                for j in range(n):
                    ids = [*s.recent, *s.draft[:j]][-width:]
                    windows.append((len(host), len(ids)))
                    host += ids  # token ids are exact in float64
            inputs[i] = (draws, windows)
        up = torch.tensor(host, dtype=torch.float64).to(logits.device, non_blocking=True) if host else None
        for i, (draws, windows) in inputs.items():
            u = None if draws is None or up is None else up[draws[0] : draws[0] + draws[1]]
            recent = None if windows is None or up is None else [up[a : a + w].long() for a, w in windows]
            picks[i] = sample(rows_of[i], seqs[i].params, u, recent)  # (n,)
        return picks  # type: ignore[return-value]

    @staticmethod
    def _logprobs(lp: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
        """Each row's entry: ``lp`` (rows, V) log-probabilities, ``tokens`` the token of each row."""
        picked = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
        if top:
            values, ids = top_k(lp, top)
            alts = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            alts = [()] * len(tokens)
        return [TokenLogprob(t, p, a) for t, p, a in zip(tokens, picked, alts)]
