"""One request, as the batch engine holds it: a :class:`Sequence`.

A sequence carries everything about one request in one place: its tokens (prompt, then each
generated one) and its blocks in the KV pool, where it stands (:class:`Status`), how its tokens are
picked (sampling parameters, seed, the repeat penalty's window, a grammar, teacher forcing), its
speculative state (the draft in flight, its n-gram index and acceptance record), what it delivers
(tokens not yet taken, log-probabilities, an error) and its figures (:class:`GenerationStats`).

The scheduler reads its tokens, blocks and status; the sampler its picking state; the engine
delivers from it; a :class:`runtime.batch.RequestHandle` only reads what delivery needs.
"""

from __future__ import annotations

import enum
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from localllm.runtime.block_manager import BlockTable
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.speculate import Acceptance, NgramIndex

if TYPE_CHECKING:
    from localllm.runtime.constrain import Constraint


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class GenerationStats:
    """Figures of one generation (times from ``time.perf_counter()``; durations in seconds, as Ollama
    reports them): every request the engine runs has one, and ``run``, the server and the bench read it."""

    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache (first admission)
    generated_tokens: int = 0
    max_tokens: int | None = None
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    #: "stop", "length", "cancelled", "error", or "constraint" (the grammar refused every token the
    #: model could give; :attr:`constraint_error` says why)
    finish_reason: str | None = None
    constraint_error: str | None = None
    stop_string: bool = False  # the reader cut the text at a stop string (and cancelled the rest)
    preemptions: int = 0
    #: Speculative decoding: proposed tokens verified, and those of them kept.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_steps: int = 0  # steps that verified a draft of this request
    #: When each generated token was sampled (its step's end): inter-token latencies are the gaps.
    token_times: list[float] = field(default_factory=list)

    @property
    def mean_accepted(self) -> float:
        """Draft tokens kept per verify step (each such step adds one token more of its own)."""
        return self.accepted_tokens / self.draft_steps if self.draft_steps else 0.0

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens actually run (those the prefix cache served are left out)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from submission (queueing included)."""
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def prompt_s(self) -> float:
        """Submission to the first token (to the end, when none came): the prompt's evaluation."""
        end = self.first_token_at if self.first_token_at is not None else self.finished_at
        return 0.0 if end is None else end - self.submitted_at

    @property
    def prompt_tps(self) -> float:
        return self.prefilled_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def decode_s(self) -> float:
        """From the first generated token to the last."""
        return self.token_times[-1] - self.token_times[0] if len(self.token_times) > 1 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second after the first."""
        return (len(self.token_times) - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def token_latencies_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def stop_reason(self) -> str:
        """Why it ended, in ``run``'s words: "eos", "max_tokens", "context", "stop_string",
        "cancelled", "error" ("" while it runs)."""
        if self.stop_string:
            return "stop_string"
        if self.finish_reason == "length":
            limited = self.max_tokens is not None and self.generated_tokens >= self.max_tokens
            return "max_tokens" if limited else "context"
        return {"stop": "eos", None: ""}.get(self.finish_reason, self.finish_reason or "")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's own distribution (log-softmax of its
    logits: before temperature, top-k/top-p, penalties and grammar masks), and the ``top`` most likely
    tokens there, as (id, log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class Sequence:
    """One request's whole state (see the module's docstring)."""

    id: int  # arrival order: lower is older
    prompt_len: int
    token_ids: list[int]  # the prompt, then every token generated so far
    max_len: int  # positions the sequence may hold (the context): generation ends when it is full
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0))
    max_tokens: int | None = None
    stop: frozenset[int] = frozenset()  # token ids that end it (not delivered)
    #: The grammar its tokens must follow (None: free); one per request, never shared.
    constraint: Constraint | None = None
    #: Log-probabilities: None (not asked), or how many alternatives each token lists (0 to 20).
    top_logprobs: int | None = None
    #: Teacher forcing (:meth:`runtime.batch.BatchEngine.forced_logits`): the tokens fed in place of the
    #: sampled ones; the fp32 logits row of every step that sampled goes to :attr:`logits`.
    forced: deque[int] | None = None

    # The scheduler's ---------------------------------------------------------------------------
    status: Status = Status.WAITING
    computed: int = 0  # tokens whose keys/values are in the pool (0 after a preemption)
    table: BlockTable = field(default_factory=BlockTable)
    #: Set from any thread; the engine retires the sequence at the start of its next step.
    cancelled: bool = False
    #: Proposed tokens to verify after the last one in the next step (speculative decoding): kept
    #: apart from ``token_ids`` until accepted; the step's plan drops them when the pool is short.
    draft: list[int] = field(default_factory=list)

    # Speculation: the n-gram index (made at the first proposal), the record of accepted drafts (started
    # from the engine's at submission), and the match length of the draft in flight.
    index: NgramIndex | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    ngram: int = 0

    # Delivery and figures ------------------------------------------------------------------------
    out: deque[int] = field(default_factory=deque)  # produced, not yet taken by the handle
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # teacher forcing's rows
    error: BaseException | None = None
    stats: GenerationStats = field(init=False)
    #: Fixes the draw of the token at each position (:func:`runtime.sampling.unit_random`).
    seed: int = field(init=False)
    #: The repeat penalty's window of recent tokens (None: no penalty).
    recent: deque[int] | None = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.seed = p.seed if p.seed is not None else secrets.randbits(63)
        n = p.repeat_last_n
        self.recent = deque(self.token_ids[-n:], maxlen=n) if p.repeat_penalty != 1.0 and n > 0 else None
        self.stats = GenerationStats(prompt_tokens=self.prompt_len, max_tokens=self.max_tokens,
                                     submitted_at=time.perf_counter())

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def pending(self) -> int:
        """Tokens to compute before the next one can be sampled."""
        return len(self.token_ids) - self.computed

    @property
    def generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def append(self, tok: int, now: float, logprob: TokenLogprob | None = None) -> str | None:
        """Take a picked token: deliver it (teacher forcing: the next forced one instead) unless it ends
        the sequence. Returns the finish reason when the sequence ends here ("stop": a stop id, not
        delivered, or a complete grammar; "length": ``max_tokens``, the context, or no token left to
        force; "constraint": the grammar refused it), else None."""
        if self.forced is not None:
            if not self.forced:
                return "length"
            tok = self.forced.popleft()
        if tok in self.stop:
            return "stop"
        stats = self.stats
        if self.constraint is not None and not self.constraint.take(tok):
            stats.constraint_error = self.constraint.error or f"token {tok} refused"
            return "constraint"
        if stats.first_token_at is None:
            stats.first_token_at = now
        stats.token_times.append(now)
        self.token_ids.append(tok)
        stats.generated_tokens += 1
        if logprob is not None:
            self.token_logprobs.append(logprob)  # before the token can be taken
        self.out.append(tok)
        if self.recent is not None:
            self.recent.append(tok)
        if self.constraint is not None and self.constraint.done:  # complete: nothing may follow
            return "stop"
        if self.max_tokens is not None and stats.generated_tokens >= self.max_tokens:
            return "length"
        if len(self.token_ids) > self.max_len:  # the newest token has no position left to run at
            return "length"
        return None
