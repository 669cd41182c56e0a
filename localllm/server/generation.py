"""One request on a model's batch engine, bridged from the engine's thread to asyncio.

The engine runs steps on its own thread; a :class:`RequestHandle` blocks the thread that iterates it.
So each generation gets a small pump thread that iterates the handle, decodes the text (incremental
UTF-8, stop strings cut without showing any part of one) and hands each piece to the event loop
with ``call_soon_threadsafe``. The event loop never waits on a model step. Cancelling (a client that
went away, a stop string) calls ``handle.cancel()``: the engine retires the sequence and frees its
KV blocks at its next step, and the pump ends as the handle does.

Between the engine and a slow client nothing grows without bound. At most :data:`MAX_PENDING` text
pieces wait for the consumer: past that the pump blocks (backpressure) until the consumer takes one,
and the consumer itself waits on the socket (the ASGI server's ``send`` waits while the transport's
buffer is full). Meanwhile the engine runs the sequence on to its end, which frees its KV blocks and
its slot for the other requests sooner than pausing it would; what it produced waits as token ids
in the handle, at most one per position of the context.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from localllm.runtime.batch import RequestHandle, TokenLogprob
from localllm.runtime.textstream import StopStringFilter, template_channels
from localllm.runtime.tokenizer import Tokenizer

#: Text pieces handed to the event loop and not yet taken by the client's response (see the module's doc).
MAX_PENDING = 64


@dataclass
class Piece:
    """Text as the client gets it, with the log-probability entries of the tokens that made it (empty
    unless asked for; a token can make no text of its own, half a character, and then lands on the next)."""

    text: str
    logprobs: list[TokenLogprob]


@dataclass
class Outcome:
    """How a generation ended, with its figures (times from ``time.perf_counter()``)."""

    finish_reason: str  # "stop", "length", "constraint", "cancelled", "error"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    submitted_at: float
    first_token_at: float | None
    finished_at: float
    error: BaseException | None = None
    stop: str | None = None  # the stop string that ended it, if one did


class Generation:
    """Text pieces of one submitted request, as an async iterator; :attr:`outcome` once it has ended."""

    def __init__(self, handle: RequestHandle, tokenizer: Tokenizer, stop: Sequence[str],
                 on_end: Callable[[Outcome], None] | None = None, max_pending: int = MAX_PENDING) -> None:
        self.handle = handle
        self._tokenizer = tokenizer
        self._stop = list(stop)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Piece | Outcome] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._room = threading.Semaphore(max_pending)  # pieces the pump may still hand over
        self._on_end = on_end
        self.outcome: Outcome | None = None
        self.tokens = 0  # token ids taken from the engine so far
        self.logprobs: list[TokenLogprob] = []  # every entry handed over so far (a whole reply's, at its end)
        self._thread = threading.Thread(target=self._pump, name=f"localllm-req-{handle.id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine side (pump thread)
    def _put(self, item: Piece | Outcome) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            return True
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self._cancelled.set()
            self.handle.cancel()
            return False

    def _put_piece(self, piece: str) -> bool:
        """Hand ``piece`` over (with the entries of the tokens since the last piece) once the consumer
        has room for it (blocks: backpressure); False when nobody will take it any more."""
        self._room.acquire()
        entries = self.handle.logprobs[len(self.logprobs) : self.tokens]
        self.logprobs += entries
        return not self._cancelled.is_set() and self._put(Piece(piece, entries))

    def _pump(self) -> None:
        # harmony's replies (gpt-oss) are messages whose headers are special tokens: kept, to be split
        decoder = self._tokenizer.stream(skip_special=not template_channels(self._tokenizer.chat_template))
        cut = StopStringFilter(self._stop)
        reason: str | None = None
        error: BaseException | None = None
        try:
            for token in self.handle:
                self.tokens += 1
                if self._cancelled.is_set():
                    break
                piece = cut.feed(decoder.feed(token))
                if piece and not self._put_piece(piece):
                    break
                if cut.stopped:
                    self.handle.cancel()  # the stop string ends it: free its blocks now
                    reason = "stop"
                    break
            else:
                tail = cut.feed(decoder.flush()) + cut.flush()
                if tail:
                    self._put_piece(tail)
        except BaseException as e:  # noqa: BLE001 - the engine's error, delivered to the client
            error = e
        stats = self.handle.stats
        if reason is None:
            if error is not None:
                reason = "error"
            elif self._cancelled.is_set():
                reason = "cancelled"
            else:
                reason = stats.finish_reason or "stop"
        outcome = Outcome(reason, stats.prompt_tokens, max(0, stats.cached_tokens), self.tokens,
                          stats.submitted_at, stats.first_token_at, time.perf_counter(), error, cut.hit)
        if self._on_end is not None:
            self._on_end(outcome)
        self._put(outcome)

    # ------------------------------------------------------------------ asyncio side
    def cancel(self) -> None:
        """Stop generating (safe to call more than once, and after the end)."""
        self._cancelled.set()
        self.handle.cancel()
        self._room.release()  # a pump blocked on a full queue wakes, sees the cancel and ends

    @property
    def pending(self) -> int:
        """Pieces handed over and not yet taken."""
        return self._queue.qsize()

    async def parts(self) -> AsyncIterator[Piece]:
        """The text as it comes, with its tokens' log-probabilities; a cancelled consumer (a
        disconnect) cancels the request."""
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, Outcome):
                    self.outcome = item
                    return
                self._room.release()
                yield item
        finally:
            if self.outcome is None:
                self.cancel()

    async def pieces(self) -> AsyncIterator[str]:
        """The text as it comes (:meth:`parts` without the log-probabilities)."""
        async with contextlib.aclosing(self.parts()) as parts:  # closed with this one: a disconnect cancels
            async for part in parts:
                yield part.text

    async def text(self) -> str:
        """All of the text, waiting for the end."""
        return "".join([piece async for piece in self.pieces()])
