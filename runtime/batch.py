"""The batch engine: many requests on one model, continuously batched over a paged KV pool.

    engine = BatchEngine(model, kv_budget_bytes=256 << 20)
    a = engine.submit(prompt_a, SamplingParams(temperature=0), max_tokens=64, stop_ids=eos)
    b = engine.submit(prompt_b, SamplingParams(seed=7), max_tokens=64, stop_ids=eos)
    for token in a:          # iterating drives the engine (every request advances), or
        ...
    engine.start()           # a background thread runs the steps; submit() from any thread
    a.stats.finish_reason    # "stop", "length", "cancelled" (or "error")

A request is one :class:`runtime.sequence.Sequence`. Each :meth:`BatchEngine.step` reads:

    schedule -> forward -> pick -> advance -> deliver

the :class:`runtime.scheduler.Scheduler` plans the step (decode tokens, prefill chunks, admissions,
preemptions; with speculation, drafts to verify); the :class:`runtime.runner.ModelRunner` runs every
scheduled token of every sequence in **one** forward, through the compiled decode step, CUDA graphs or
the eager model, whichever takes the step first; the :class:`runtime.sampler.Sampler` picks each
sampling sequence's tokens (masks, penalties, seeded draws, log-probabilities, draft acceptance); the
pool records what was computed; and each token is delivered or ends its sequence, whose blocks are
freed at once (full blocks stay in the prefix cache).

It knows nothing of HTTP, text or chat templates: token ids in, token ids out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

from localllm.errors import LocalLLMError
from localllm.yielding import Generating
from localllm.runtime.block_manager import BlockManager
from localllm.runtime.compiled_step import CompiledDecode, wanted_batch
from localllm.runtime.constrain import Constraint
from localllm.runtime.cuda_graphs import GraphedDecode
from localllm.runtime.kv_pool import DEFAULT_BLOCK_SIZE, KVPool, PoolPlan, plan_pool
from localllm.runtime.model import Transformer
from localllm.runtime.paged import PagedDecodeAttention, PagedSpanAttention
from localllm.runtime.runner import ModelRunner
from localllm.runtime.sampler import Picked, Sampler
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.scheduler import Scheduled, Scheduler
from localllm.runtime.sequence import GenerationStats, Sequence as Seq, Status, TokenLogprob
from localllm.runtime.speculate import Acceptance, StepCosts, propose_drafts

__all__ = ["BatchEngine", "RequestHandle", "GenerationStats", "TokenLogprob", "MAX_TOP_LOGPROBS"]

log = logging.getLogger("localllm.engine")

#: Alternatives a token's log-probability entry lists at most (OpenAI's limit).
MAX_TOP_LOGPROBS = 20

#: KV memory when none is given: ~11k tokens of SmolLM2-135M in bf16.
DEFAULT_KV_BUDGET = 256 << 20


class RequestHandle:
    """A submitted request: iterate it for its token ids as they come; :meth:`cancel` to stop it.

    Iterating waits for the engine's background thread when it runs, and otherwise drives the engine
    itself (each :meth:`BatchEngine.step` advances every request, not only this one).
    """

    def __init__(self, engine: "BatchEngine", seq: Seq) -> None:
        self._engine = engine
        self._seq = seq
        self.id = seq.id
        self.stats: GenerationStats = seq.stats

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        return self._engine._next_token(self._seq)

    @property
    def done(self) -> bool:
        """Finished, and every token taken."""
        return self._seq.finished and not self._seq.out

    def take(self) -> list[int]:
        """The tokens produced so far and not yet taken, without waiting or stepping (for a caller
        that drives :meth:`BatchEngine.step` itself and polls many requests)."""
        return self._engine._take(self._seq)

    def cancel(self) -> None:
        """Stop generating; the request ends with ``finish_reason == "cancelled"``: at once if it is
        still queued, else at the next step (tokens already produced can still be read). Safe from
        any thread."""
        self._engine._cancel(self._seq)

    def result(self) -> list[int]:
        """Every remaining token id, waiting for the end."""
        return list(self)

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """With ``logprobs`` asked at :meth:`BatchEngine.submit`: one entry per generated token so far,
        in order (entry i is token i's, there before token i can be taken)."""
        return self._seq.token_logprobs


class BatchEngine:
    """Continuous batching of token-id requests on ``model`` over a paged KV pool of
    ``kv_budget_bytes`` (see the module's docstring).

    ``max_seq_len``: positions one sequence may hold (default the model's context, capped by the
    pool); ``chunk_tokens``: prompt tokens prefilled per step, all sequences together (decode tokens
    come on top); ``max_running``: sequences in a step at most; ``max_waiting``: the queue's bound.
    ``attention``: "auto" runs single-query attention with localllm's paged CPU kernel on the CPU, and
    every span (prefill chunks too) with the Triton paged kernel on CUDA (where Triton is installed, as
    torch's CUDA builds install it); "sdpa" always gathers blocks and runs SDPA (the reference).
    ``prefix_cache=False``: no prompt reuses another's blocks (the baseline the prefix cache is
    measured against). ``kv_dtype``: one of :data:`runtime.cache.KV_DTYPES`: "16bit" (the
    activations' dtype), "fp16", or "int8" (int8 codes and per-token, per-head scales).
    ``compile``: False runs every step eagerly; "auto" runs decode-only steps through the compiled
    step's packages when they are built (:attr:`needs_build` says when they are not); True builds
    missing ones now (a minute or so a package on two cores), all but those of a lone sequence's verify
    steps, which a background build adds (:attr:`needs_build`, :attr:`build_batch`). Where the step
    cannot run the model (:func:`runtime.compiled_step.unsupported`), steps run eagerly and
    :attr:`compile_note` says why.
    ``speculate``: propose tokens from each sequence's own history and verify them in the step where
    that pays (:mod:`runtime.speculate`); the tokens are the same either way. ``cuda_graphs``: on a
    GPU, replay decode-only steps from CUDA graphs captured per batch-size bucket
    (:mod:`runtime.cuda_graphs`; False: launch every step eagerly, the baseline).
    """

    def __init__(
        self,
        model: Transformer,
        *,
        kv_budget_bytes: int = DEFAULT_KV_BUDGET,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_seq_len: int | None = None,
        chunk_tokens: int = 256,
        max_running: int = 32,
        max_waiting: int = 64,
        attention: str = "auto",
        prefix_cache: bool = True,
        kv_dtype: str = "16bit",
        compile: bool | str = False,
        speculate: bool = True,
        cuda_graphs: bool = True,
    ) -> None:
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', not {compile!r}")
        self.model = model
        config = model.config
        self.device = model.device
        self.plan: PoolPlan = plan_pool(config, kv_budget_bytes, model.dtype, block_size, kv_dtype)
        self.pool = KVPool.allocate(config, self.plan, model.layer_devices())  # a CPU block's KV in CPU RAM
        self.blocks = BlockManager(self.plan.n_blocks, block_size, prefix_cache, self.plan.windows)
        self.scheduler = Scheduler(self.blocks, max_waiting, max_running, chunk_tokens)
        self.max_seq_len = min(max_seq_len or config.max_seq_len, self.scheduler.capacity_tokens)
        self.runner = ModelRunner(model, self.pool, self.max_seq_len, attention=attention,
                                  cuda_graphs=cuda_graphs, max_running=max_running)
        self.sampler = Sampler(self.device)
        self.speculate = speculate
        #: The batch size (query rows) a build for this engine covers (:func:`wanted_batch`): what to
        #: hand ``localllm compile --batch`` when :attr:`needs_build`.
        self.build_batch = wanted_batch(max_running, speculate)
        if compile:
            self.runner.load_compiled(compile is True, max_running, speculate)
        self._live: dict[int, Seq] = {}  # unfinished sequences by id
        self._next_id = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # one step at a time, whoever drives
        self._generating = Generating()
        self._thread: threading.Thread | None = None
        self._stopping = False
        #: Measured decode step times by query rows: what the drafts' cost is weighed against.
        self.costs = StepCosts()
        #: Every sequence's drafts together: where a new sequence's record starts.
        self.acceptance = Acceptance()
        #: Totals since creation.
        self.steps = 0
        self.tokens_computed = 0
        self.drafted_tokens = 0  # speculative decoding: proposed tokens verified
        self.accepted_tokens = 0  # ... and kept
        self.verify_steps = 0  # steps with a draft in them
        self.last_step_s = 0.0  # the last step's forward and sampling
        self.last_step_prefill_tokens = 0  # prompt (or recomputed) tokens in it; 0: a decode-only step

    # The runner's, as callers read them ------------------------------------------------------------
    @property
    def kernel(self) -> PagedDecodeAttention | PagedSpanAttention | None:
        """The paged attention kernel single queries run through (None: SDPA over gathered blocks)."""
        return self.runner.kernel

    @property
    def graphs(self) -> GraphedDecode | None:
        return self.runner.graphs

    @property
    def compiled(self) -> bool:
        """Whether decode-only steps run through the compiled step."""
        return self.runner.compiled is not None

    @property
    def needs_build(self) -> bool:
        """"auto" found no compiled step built for this model and pool shape (``localllm compile``),
        and no build of it failed before."""
        return self.runner.needs_build

    @property
    def compile_s(self) -> float:
        """Building (``compile=True``) or loading the compiled step's packages."""
        return self.runner.compile_s

    @property
    def compile_note(self) -> str | None:
        """Why steps run eagerly although compiling was asked for (None: they do not, or it was not)."""
        return self.runner.compile_note

    # Submission ----------------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None = None,
               stop_ids: Sequence[int] = (), *, forced: Sequence[int] | None = None,
               constraint: Constraint | None = None, logprobs: int | None = None) -> RequestHandle:
        """Queue a request. Raises :class:`runtime.scheduler.EngineBusy` when the queue is full and
        LocalLLMError when the prompt is empty or can never fit (:func:`runtime.scheduler.check_prompt`). Safe from any
        thread. ``forced``: teacher forcing (see :meth:`forced_logits`). ``constraint``: a grammar the
        tokens must follow (:mod:`runtime.constrain`; one per request, never shared); the request ends
        with "stop" where the grammar is complete. ``logprobs``: record each generated token's
        log-probability and this many alternatives (0 to 20; :attr:`RequestHandle.logprobs`)."""
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise LocalLLMError(f"top logprobs {logprobs} is out of range", f"ask for 0 to {MAX_TOP_LOGPROBS}")
        if max_tokens is not None and max_tokens < 1:
            raise LocalLLMError(f"max tokens {max_tokens} is not positive", "ask for at least 1 token")
        with self._cond:
            seq = Seq(self._next_id, len(prompt_ids), list(prompt_ids), self.max_seq_len, params=params,
                      max_tokens=max_tokens, stop=frozenset(stop_ids), constraint=constraint, top_logprobs=logprobs,
                      forced=None if forced is None else deque(forced), acceptance=self.acceptance.start())
            self.scheduler.add(seq)  # raises before anything is recorded
            self._next_id += 1
            self._live[seq.id] = seq
            self._cond.notify_all()
        return RequestHandle(self, seq)

    def _cancel(self, seq: Seq) -> None:
        with self._cond:
            seq.cancelled = True
            if seq.status is Status.WAITING:  # in no step: it leaves the queue now, not at the next step
                self._finish(seq, "cancelled")
            self._cond.notify_all()

    @property
    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work

    # Stepping ------------------------------------------------------------------------------------
    def step(self) -> int:
        """Run one step: schedule -> forward -> pick -> advance -> deliver. Returns the number of
        tokens it computed (0: nothing to do)."""
        with self._step_lock:
            plan, sampling = self._schedule()
            if not plan.chunks:
                self._generating.release()
                return 0
            self._generating.hold()  # a background build stops while this engine has work
            t0 = time.perf_counter()
            try:
                masks = self.sampler.masks_before(sampling)
                logits = self.runner.forward(plan.chunks)  # (rows of the sampling sequences, vocab)
                picked = self.sampler(logits, sampling, masks)
            except BaseException as e:
                self._fail(plan, e)
                raise
            self._advance(plan, sampling, picked, t0)
            return plan.num_tokens

    def _schedule(self) -> tuple[Scheduled, list[Seq]]:
        """Retire cancelled sequences, propose drafts, plan the step; and the sequences that sample in it."""
        with self._cond:
            for seq in [s for s in self._live.values() if s.cancelled]:
                self._finish(seq, "cancelled")
            running = self.scheduler.running
            if self.speculate and not self.scheduler.waiting and all(s.pending == 1 for s in running):
                propose_drafts(running, self.costs)  # a step where every sequence decodes
            else:
                for s in running:
                    s.draft = []
            plan = self.scheduler.schedule()
            self._cond.notify_all()
            return plan, [c.seq for c in plan.chunks if c.samples]

    def _advance(self, plan: Scheduled, sampling: list[Seq], picked: list[Picked], t0: float) -> None:
        """Record what the step computed and deliver each sampling sequence's tokens."""
        prefill_tokens = plan.prefill_tokens  # before the tokens go in: a chunk samples until then
        with self._cond:
            now = time.perf_counter()
            drafts = {s.id: tokens[:-1] for s, (tokens, _) in zip(sampling, picked) if s.draft}
            self.scheduler.computed(plan.chunks, drafts)
            if not prefill_tokens:
                self.costs.record(plan.num_tokens, now - t0)
            if drafts:
                self.verify_steps += 1
            for seq, (tokens, entries) in zip(sampling, picked):
                if seq.draft:
                    self._record_draft(seq, len(tokens) - 1)
                for j, tok in enumerate(tokens):
                    if seq.finished:
                        break
                    self._deliver(seq, tok, now, entries[j] if entries else None)
            self.steps += 1
            self.tokens_computed += plan.num_tokens
            self.last_step_s = now - t0
            self.last_step_prefill_tokens = prefill_tokens
            if not self.scheduler.has_work:
                self._generating.release()  # idle: a stopped build may go on
            self._cond.notify_all()

    def _fail(self, plan: Scheduled, error: BaseException) -> None:
        """A step that raised: its sequences end with ``error`` (the others carry on)."""
        with self._cond:
            for c in plan.chunks:
                if not c.seq.finished:
                    c.seq.error = error
                    self._finish(c.seq, "error")
            self._cond.notify_all()

    def _record_draft(self, seq: Seq, kept: int) -> None:
        drafted = len(seq.draft)
        seq.acceptance.record(seq.ngram, drafted, kept)
        self.acceptance.record(seq.ngram, drafted, kept)
        seq.stats.drafted_tokens += drafted
        seq.stats.accepted_tokens += kept
        seq.stats.draft_steps += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += kept
        seq.draft = []

    def _deliver(self, seq: Seq, tok: int, now: float, logprob: TokenLogprob | None = None) -> None:
        """A picked token: delivered, or the end of its sequence (a stop id is not delivered)."""
        reason = "cancelled" if seq.cancelled else seq.append(tok, now, logprob)
        if reason == "constraint":  # no token was allowed (the grammar hit a limit, or broke): say why
            log.warning("request %d: the grammar allows no further token (%s); it ends here",
                        seq.id, seq.stats.constraint_error)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Seq, reason: str) -> None:
        """Retire ``seq`` now (its blocks freed). Called with the lock held."""
        if seq.finished:
            return
        self.scheduler.finish(seq)
        seq.stats.finish_reason = reason
        seq.stats.finished_at = time.perf_counter()
        self._live.pop(seq.id, None)

    def forced_logits(self, prompt_ids: Sequence[int], fed: Sequence[int]) -> torch.Tensor:
        """Teacher forcing: the fp32 logits (len(fed) + 1, vocab) after ``prompt_ids`` and after each of
        ``fed`` in turn, fed in place of what the model would pick, through this engine's own steps (its
        pool, prefix cache and compiled step: what generation computes, not a second forward)."""
        handle = self.submit(prompt_ids, SamplingParams(temperature=0), forced=fed)
        handle.result()
        return torch.stack(handle._seq.logits[: len(fed) + 1])

    def embed(self, inputs: Sequence[Sequence[int]], pooling: str = "last",
              stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Pooled, normalized final hidden states (len(inputs), dim) (:func:`runtime.embed.embed`), a
        batch at a time between this engine's steps (never beside one, on the same cores). ``stop``:
        asked before each batch; true ends the work (:class:`runtime.embed.EmbeddingStopped`)."""
        from localllm.runtime.embed import embed

        for i, ids in enumerate(inputs):
            if not ids:
                raise LocalLLMError(f"input {i} is empty", "give some text to embed")
            if len(ids) > self.max_seq_len:
                raise LocalLLMError(f"input {i} is {len(ids)} tokens; the context holds {self.max_seq_len}",
                                    "shorten it, or let it be truncated")
        return embed(self.model, inputs, pooling, turn=self._step_lock, stop=stop)

    def run_until_done(self) -> None:
        """Step until every submitted request has finished (the simple driver)."""
        while self.step() or self.has_work:
            pass

    # Delivery ------------------------------------------------------------------------------------
    def _take(self, seq: Seq) -> list[int]:
        with self._cond:
            out = list(seq.out)
            seq.out.clear()
            if not out and seq.finished and seq.error is not None:
                raise seq.error
            return out

    def _next_token(self, seq: Seq) -> int:
        while True:
            with self._cond:
                if seq.out:
                    return seq.out.popleft()
                if seq.finished:
                    if seq.error is not None:
                        raise seq.error
                    raise StopIteration
                if self._thread is not None:
                    self._cond.wait()
                    continue
            if not self.step() and not seq.finished and not seq.out:
                with self._cond:  # nothing ran: wait for whoever is stepping
                    if self._thread is None and not seq.out and not seq.finished:
                        self._cond.wait(0.01)

    # Background loop -----------------------------------------------------------------------------
    def start(self) -> None:
        """Run steps on a background thread whenever there is work (submit from any thread)."""
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="localllm-batch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the background thread after its current step. Unfinished requests stay queued: a later
        :meth:`start`, or iterating their handles, carries them on."""
        with self._cond:
            thread = self._thread
            if thread is None:
                return
            self._stopping = True
            self._cond.notify_all()
        thread.join()
        with self._cond:
            self._thread = None
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.scheduler.has_work:
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 - delivered to the requests of that step; keep serving
                pass

    def __enter__(self) -> "BatchEngine":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # Figures -------------------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        """Blocks in use, cached (reusable prefixes) and free; sequences running and waiting."""
        with self._lock:
            bm = self.blocks
            return {
                "blocks": bm.n_blocks, "blocks_used": bm.num_used, "blocks_cached": bm.num_cached,
                "blocks_free": bm.num_free - bm.num_cached, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting), "preemptions": self.scheduler.preemptions,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "verify_steps": self.verify_steps,
            }
