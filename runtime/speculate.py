"""Speculative decoding without a draft model: n-gram prompt lookup, and when it pays.

A decode step reads every weight to produce one token per sequence; a step that also checks a few
proposed tokens of a sequence (its *drafts*, as extra query rows of its chunk) costs little more while
the step is bound by reading weights. What agents, editors and summaries write largely copies spans
of their own context, so the drafts come from the sequence itself: the tokens that followed the
latest earlier occurrence of its last ``n`` tokens (:class:`NgramIndex`). The engine verifies them in
its batched step (:class:`runtime.sampler.Sampler`) and keeps the longest accepted prefix plus one
token of its own, so the output is exactly what decoding one token at a time gives (greedy: the same
tokens; sampling: the same distribution).

Whether a draft pays is decided per step (:func:`plan_drafts`): each sequence's acceptance so far (per
match length: a long match is a safer bet than a short one) gives the expected number of tokens a
draft of ``k`` adds, and the engine's measured step times (:class:`StepCosts`, by the number of query
rows in a decode step) give what the extra rows cost. Drafts go where the expected tokens per second
of the whole step rise; where steps are compute-bound (large batches) the extra rows cost as much as
they return, and nothing is drafted.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localllm.runtime.sequence import Sequence as SequenceState

#: Longest draft per sequence and step.
MAX_DRAFT = 8
#: Match lengths tried, longest first: the last MAX_NGRAM .. MIN_NGRAM tokens are looked up.
MAX_NGRAM = 4
MIN_NGRAM = 2


class NgramIndex:
    """Where each n-gram of a sequence's tokens (prompt and output) last occurred, for ``n`` in
    ``MIN_NGRAM .. MAX_NGRAM``: the position of the token that followed it. Kept up to date as tokens
    are appended (a few dictionary updates per token), so a lookup costs O(MAX_NGRAM)."""

    def __init__(self) -> None:
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_NGRAM, MAX_NGRAM + 1)}
        self._indexed = 0  # n-grams ending before this position are in the index

    def _extend(self, tokens: Sequence[int]) -> None:
        # The n-gram ending at the last token is the query, not an entry: it has no follower yet.
        for end in range(self._indexed, len(tokens) - 1):
            for n, table in self._last.items():
                if end + 1 >= n:
                    table[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self._indexed = max(self._indexed, len(tokens) - 1)

    def propose(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
        ``tokens`` found, and that suffix's length (0 and no tokens: no match)."""
        self._extend(tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(tokens) <= n:
                continue
            at = self._last[n].get(tuple(tokens[-n:]))
            if at is not None:
                return list(tokens[at : at + k]), n
        return [], 0


@dataclass
class Acceptance:
    """A sequence's record of its drafts, per match length: how often a drafted token was accepted,
    given the ones before it were (a geometric model: a draft of ``k`` is expected to add
    ``a + a^2 + ... + a^k`` tokens). Starts from a prior of one acceptance in two trials, and forgets
    slowly (a text moves between copying and writing)."""

    accepted: dict[int, float] = field(default_factory=dict)
    trials: dict[int, float] = field(default_factory=dict)

    PRIOR_ACCEPTED = 1.0
    PRIOR_TRIALS = 2.0
    DECAY = 0.9

    def start(self, weight: float = 0.5) -> "Acceptance":
        """A new sequence's record: this one's (an engine's, over every sequence it ran) at ``weight``,
        so that a new request starts from what drafts of its kind got, and its own soon outweigh it."""
        return Acceptance({n: a * weight for n, a in self.accepted.items()},
                          {n: t * weight for n, t in self.trials.items()})

    def rate(self, n: int) -> float:
        return (self.accepted.get(n, 0.0) + self.PRIOR_ACCEPTED) / (self.trials.get(n, 0.0) + self.PRIOR_TRIALS)

    def record(self, n: int, drafted: int, accepted: int) -> None:
        # Bernoulli trials seen: every accepted token, and the first rejected one if any.
        trials = accepted + (1 if accepted < drafted else 0)
        self.accepted[n] = self.accepted.get(n, 0.0) * self.DECAY + accepted
        self.trials[n] = self.trials.get(n, 0.0) * self.DECAY + trials


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a draft of ``k`` adds on average, each accepted with probability ``rate`` given the ones
    before it were: ``rate + rate^2 + ... + rate^k``."""
    return sum(rate**i for i in range(1, k + 1))


class StepCosts:
    """Measured durations of decode steps (no prompt chunk in them) by their number of query rows: the
    median of each row count's last few. A row count not measured yet is estimated from the nearest
    one below it, each extra row costing what a row cost between the two nearest measured row counts,
    and at least ``GUESS_PER_ROW`` of that step's time per row in it (a step bound by reading weights
    adds little per row; the first measurement replaces the guess).
    Until a row count has ``TRUSTED`` measurements, the lower of guess and measurement is used, so
    that one slow step (the machine busy elsewhere) does not rule it out for good."""

    KEEP = 7
    TRUSTED = 3
    GUESS_PER_ROW = 0.1

    def __init__(self) -> None:
        self._times: dict[int, deque[float]] = {}

    def record(self, rows: int, seconds: float) -> None:
        self._times.setdefault(rows, deque(maxlen=self.KEEP)).append(seconds)

    def measured(self, rows: int) -> float | None:
        times = self._times.get(rows)
        return statistics.median(times) if times else None

    def estimate(self, rows: int) -> float | None:
        """Seconds of a decode step of ``rows`` query rows (None: no decode step measured at or below)."""
        below = sorted(r for r in self._times if r < rows)
        guess = None
        if below:
            base = below[-1]
            t = self.measured(base)
            assert t is not None
            slope = self.GUESS_PER_ROW * t / base
            if len(below) > 1:  # measured rows' own cost: a compute-bound step's rows cost their share
                prev = below[-2]
                slope = max(slope, (t - self.measured(prev)) / (base - prev))  # type: ignore[operator]
            guess = t + slope * (rows - base)
        got = self.measured(rows)
        if got is None:
            return guess
        if len(self._times[rows]) < self.TRUSTED and guess is not None:
            return min(got, guess)
        return got

    def table(self) -> dict[int, float]:
        """Row count -> median seconds, of those measured."""
        return {r: statistics.median(t) for r, t in sorted(self._times.items()) if t}


@dataclass
class Proposal:
    """One sequence's candidate draft: its tokens (longest first usable), the match length that found
    them and that length's acceptance rate."""

    tokens: list[int]
    ngram: int
    rate: float


def plan_drafts(proposals: Sequence[Proposal | None], costs: StepCosts) -> list[int]:
    """How many of each sequence's proposed tokens to verify this step (0: it decodes one token), for
    a decode step of ``len(proposals)`` sequences. Draft tokens are handed out one at a time where the
    expected gain is largest (the next token of the sequence whose draft is likeliest to hold); of
    every total so handed out, the one with the most expected tokens per second of step
    (:class:`StepCosts`) is taken, none if no total beats the plain step. Every total is weighed, not
    only the first that stops paying: a step of a few rows may cost more per row than one of many
    (eager against compiled, or a kernel that takes rows in groups). With no decode step measured at
    this batch size yet, nothing is drafted."""
    rows = len(proposals)
    k = [0] * rows
    base = costs.estimate(rows) if rows else None
    if base is None:
        return k
    expected = float(rows)  # tokens the step yields: one per sequence, plus the accepted drafts
    best, best_rate = list(k), expected / base
    while True:
        gains = [(p.rate ** (k[i] + 1), i) for i, p in enumerate(proposals) if p is not None and k[i] < len(p.tokens)]
        if not gains:
            return best
        gain, i = max(gains)
        k[i] += 1
        expected += gain
        t = costs.estimate(rows + sum(k))
        if t is None:
            return best
        if expected / t > best_rate:
            best, best_rate = list(k), expected / t


def propose_drafts(running: Sequence["SequenceState"], costs: StepCosts) -> None:
    """Set the draft of each of ``running`` (a step in which every sequence decodes one token): its
    n-gram proposal, as far as :func:`plan_drafts` finds it pays, within the tokens it may still add
    (the step adds one of its own) and only what its grammar takes (a refused draft could not be kept)."""
    proposals: list[Proposal | None] = []
    for seq in running:
        room = min(MAX_DRAFT, seq.max_len - len(seq.token_ids))
        if seq.max_tokens is not None:
            room = min(room, seq.max_tokens - seq.generated - 1)
        if seq.forced is not None or room < 1 or seq.cancelled:
            proposals.append(None)
            continue
        if seq.index is None:
            seq.index = NgramIndex()
        tokens, n = seq.index.propose(seq.token_ids, room)
        if seq.constraint is not None:
            tokens = tokens[: seq.constraint.valid_prefix(tokens)]
        proposals.append(Proposal(tokens, n, seq.acceptance.rate(n)) if tokens else None)
    for seq, p, k in zip(running, proposals, plan_drafts(proposals, costs)):
        seq.draft = p.tokens[:k] if p is not None and k else []
        if p is not None and seq.draft:
            seq.ngram = p.ngram
