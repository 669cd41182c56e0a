"""Which sequences run in the next step, and how many tokens each: admission, chunked prefill,
batched decode, preemption.

Every step:

1. every running sequence with one token to compute (decoding) gets it, oldest first; one that needs
   a new block and finds none makes room by preempting the *youngest* running sequence (its blocks
   freed, itself put back at the front of the waiting queue, recomputed later from its prompt and the
   tokens it generated so far), possibly itself;
2. running sequences still prefilling get the next chunk of their prompt, within the step's prefill
   budget (``chunk_tokens`` tokens for all of them together);
3. waiting sequences are admitted, oldest first, while the budget lasts, there are free slots
   (``max_running``) and the pool has blocks for their whole prompt (less what the prefix cache holds).
   Nothing is admitted in a step that had to preempt.

A sequence's blocks are taken for its whole prompt at admission, then one at a time as decoding
fills them: memory follows the tokens held, never reserved for ``max_tokens`` ahead. The blocks of
sliding-window layer groups are taken a chunk at a time and given back as the window moves on
(:meth:`runtime.block_manager.BlockManager.release`); a chunk that finds none preempts as a decode
token does.

The queue is bounded: :meth:`Scheduler.add` raises :class:`EngineBusy` when ``max_waiting`` requests
wait beyond the free slots (a request a free slot will take at the next step does not count). A request that
cannot fit the pool even alone is refused there too, with the numbers.

This module knows token ids and blocks, not tensors, sampling or the model.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from localllm.errors import LocalLLMError
from localllm.runtime.block_manager import BlockManager
from localllm.runtime.kv_pool import capacity_tokens
from localllm.runtime.sequence import Sequence, Status


def check_prompt(prompt_len: int, ctx: int, pool: str = "") -> None:
    """Refuse an empty prompt, or one that leaves no position of a ``ctx`` context to generate in: the
    one prompt check (the engine's; the server turns its error into the API's 400). ``pool``: what
    bounds the context when the KV pool does."""
    if prompt_len < 1:
        raise LocalLLMError("the prompt is empty", "give some text to continue")
    if prompt_len >= ctx:
        raise LocalLLMError(
            f"the prompt is {prompt_len} tokens and the context holds {ctx} (prompt and reply together"
            + (f"; {pool})" if pool else ")"),
            f"use a prompt of at most {ctx - 1} tokens, or a larger context (--ctx {prompt_len + 256} or more)"
            + (" or KV cache budget" if pool else ""),
        )


class EngineBusy(LocalLLMError):
    """The waiting queue is full: retry later (a server answers 503 with ``Retry-After``)."""

    def __init__(self, waiting: int, retry_after_s: float = 1.0, what: str = "") -> None:
        self.retry_after_s = retry_after_s
        super().__init__(f"the server is busy: {waiting} requests are already waiting" + (f" {what}" if what else ""),
                         f"retry after {retry_after_s:g} s")


@dataclass(frozen=True)
class Chunk:
    """``seq`` computes ``token_ids[start : start + length - draft]`` this step, then its ``draft``
    proposed tokens (a verify chunk: every row is sampled)."""

    seq: Sequence
    start: int
    length: int
    draft: int = 0

    @property
    def tokens(self) -> list[int]:
        """The ids the step runs: the sequence's tokens from ``start``, then a verify chunk's draft."""
        s = self.seq
        return [*s.token_ids[self.start : self.start + self.length - self.draft], *s.draft[: self.draft]]

    @property
    def tables(self) -> list[list[int]]:
        """The sequence's block table of each layer group (covering at least ``start + length``)."""
        return self.seq.table.groups

    @property
    def verify(self) -> bool:
        """A decode token and its draft (speculative decoding): every token is a query of its own,
        seeing the keys up to its position, with logits."""
        return self.draft > 0

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the sequence's last token, so that a new token is sampled."""
        return self.start + self.length - self.draft == len(self.seq.token_ids)

    @property
    def decodes(self) -> bool:
        """Whether the chunk is one generated token's step, as a decode computes it: the last token of a
        sequence past its prompt (also after a preemption, when the prefix cache held all but that
        token); prompt chunks and longer recomputations are not. Like :attr:`samples`, true only until
        the step's token is appended."""
        return self.length - self.draft == 1 and self.samples and self.start >= self.seq.prompt_len


@dataclass
class Scheduled:
    """One step's work."""

    chunks: list[Chunk]
    preempted: list[Sequence]
    admitted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def prefill_tokens(self) -> int:
        """Tokens computed for prompts (or recomputed after a preemption), not decoded."""
        return sum(c.length for c in self.chunks if not c.decodes)


class Scheduler:
    """The waiting queue, the running set and the step plan, over a :class:`BlockManager`."""

    def __init__(self, blocks: BlockManager, max_waiting: int = 64, max_running: int = 32,
                 chunk_tokens: int = 256) -> None:
        if chunk_tokens < 1 or max_running < 1 or max_waiting < 0:
            raise ValueError("chunk_tokens and max_running must be >= 1, max_waiting >= 0")
        self.blocks = blocks
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # by id: oldest first
        self.preemptions = 0  # since creation

    @property
    def capacity_tokens(self) -> int:
        """Positions one sequence can hold alone (prefilled a chunk at a time)."""
        bm = self.blocks
        return capacity_tokens(bm.n_blocks, bm.block_size, bm.windows, self.chunk_tokens)

    def check_fits(self, prompt_len: int, max_len: int) -> None:
        """Refuse a prompt that can never run: no room for it and one generated token."""
        bm = self.blocks
        pool = f"the KV pool has {bm.n_blocks} blocks x {bm.block_size} tokens = {self.capacity_tokens}"
        check_prompt(prompt_len, max_len, pool if self.capacity_tokens <= max_len else "")

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; :class:`EngineBusy` when the queue is full, LocalLLMError if it can never fit."""
        self.check_fits(seq.prompt_len, seq.max_len)
        # A free slot takes a waiting request at the next step: those are not queued behind anyone, so a
        # burst of max_running + max_waiting requests on an idle engine is accepted whole.
        free_slots = max(0, self.max_running - len(self.running))
        if len(self.waiting) >= self.max_waiting + free_slots:
            raise EngineBusy(len(self.waiting) - free_slots)
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Retire ``seq`` (finished or cancelled, running or waiting): its blocks are freed at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.blocks.free(seq.table)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.table)  # its full blocks stay cached: the recompute may find them
        seq.computed = 0
        seq.draft = []
        seq.status = Status.WAITING
        seq.stats.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)  # it is older than anything queued

    def schedule(self) -> Scheduled:
        """Plan the next step (see the module's docstring)."""
        chunks: list[Chunk] = []
        preempted: list[Sequence] = []
        admitted: list[Sequence] = []
        # 1. one token for every decoding sequence, preempting the youngest when blocks run out
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.pending != 1:
                continue
            if self._grow(seq, len(seq.token_ids), preempted):
                chunks.append(Chunk(seq, seq.computed, 1))
        # ... and their drafts where free blocks allow: a draft never preempts anything
        for i, c in enumerate(chunks):
            seq = c.seq
            if seq.draft and seq.status is Status.RUNNING and \
                    self.blocks.grow(seq.table, len(seq.token_ids) + len(seq.draft)):
                chunks[i] = Chunk(seq, c.start, 1 + len(seq.draft), len(seq.draft))
            else:
                seq.draft = []
        # 2. the next chunk of each prefilling sequence, within the budget
        budget = self.chunk_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is Status.RUNNING and seq.pending > 1:
                n = min(seq.pending, budget)
                if self._grow(seq, seq.computed + n, preempted):  # window groups take blocks per chunk
                    chunks.append(Chunk(seq, seq.computed, n))
                    budget -= n
        if preempted:  # a chunk's blocks may have gone to the one before it: it runs another time
            chunks = [c for c in chunks if c.seq.status is Status.RUNNING]
        # 3. admission
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_running:
            seq = self.waiting[0]
            cached = self.blocks.allocate(seq.table, seq.token_ids, budget)
            if cached is None:
                break
            self.waiting.popleft()
            seq.computed = cached
            if not seq.stats.preemptions:  # the first admission (later ones recompute after a preemption)
                seq.stats.cached_tokens = cached
            seq.status = Status.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.id)
            admitted.append(seq)
            n = min(seq.pending, budget)
            chunks.append(Chunk(seq, seq.computed, n))
            budget -= n
        return Scheduled(chunks, preempted, admitted)

    def _grow(self, seq: Sequence, tokens: int, preempted: list[Sequence]) -> bool:
        """Blocks for ``seq`` to hold ``tokens`` positions, preempting the youngest running sequences
        while there are too few; False when ``seq`` itself was preempted."""
        while not self.blocks.grow(seq.table, tokens):
            if len(self.running) == 1:  # alone, it can use the whole pool: max_len forbids this
                raise RuntimeError(f"a sequence of {tokens} tokens found no block alone "
                                   f"in a pool of {self.capacity_tokens} tokens")
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def computed(self, chunks: Seq[Chunk], accepted: dict[int, Seq[int]] | None = None) -> None:
        """Record that ``chunks`` ran: their keys/values are in the pool, full blocks get keyed.
        ``accepted``: by sequence id, the tokens kept of a verify chunk's draft; the rows of the rest
        hold rejected tokens, are not counted as computed, never keyed, and get overwritten."""
        for c in chunks:
            seq = c.seq
            if seq.status is not Status.RUNNING:
                continue
            tokens: Seq[int] = seq.token_ids
            seq.computed = c.start + c.length
            if c.draft:
                kept = list((accepted or {}).get(seq.id, ()))[: c.draft]
                seq.computed -= c.draft - len(kept)
                tokens = [*seq.token_ids, *kept]
            self.blocks.commit(seq.table, tokens, seq.computed)
            self.blocks.release(seq.table, seq.computed)
