"""The batch engine: many requests on one model, continuously batched over a paged KV pool.

    engine = BatchEngine(model, kv_budget_bytes=256 << 20)
    a = engine.submit(prompt_a, SamplingParams(temperature=0), max_tokens=64, stop_ids=eos)
    b = engine.submit(prompt_b, SamplingParams(seed=7), max_tokens=64, stop_ids=eos)
    for token in a:          # iterating drives the engine (every request advances), or
        ...
    engine.start()           # a background thread runs the steps; submit() from any thread
    a.stats.finish_reason    # "stop", "length", "cancelled" (or "error")

Each :meth:`BatchEngine.step` asks the :class:`runtime.scheduler.Scheduler` for the step's work
(decode tokens, prefill chunks, admissions, preemptions), runs every scheduled token of every
sequence in **one** forward (:class:`runtime.paged.PagedStep`), samples each sequence that reached its
last token with its own :class:`SamplingParams` and seeded generator, and retires finished or cancelled
sequences at once (their blocks freed; full blocks stay in the prefix cache). With ``compile``, a step
in which every sequence decodes one token runs through an AOTInductor package of the model's paged
decode step (:mod:`runtime.compiled_step`) where one is built; every other step runs eagerly.

It knows nothing of HTTP, text or chat templates: token ids in, token ids out.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from localllm.errors import LocalLLMError
from localllm.yielding import Generating
from localllm.runtime.block_manager import BlockManager
from localllm.runtime.kv_pool import DEFAULT_BLOCK_SIZE, KVPool, PoolPlan, plan_pool
from localllm.runtime.model import Transformer, cache_rope_tables
from localllm.runtime.cuda_graphs import GraphedDecode
from localllm.runtime.paged import PagedChunkAttention, PagedDecodeAttention, PagedSpanAttention, PagedStep, SeqChunk
from localllm.runtime.compiled_step import CompiledDecode, find_step, wanted_batch
from localllm.runtime.constrain import Constraint, apply_masks
from localllm.runtime.sampling import SamplingParams, greedy, sample, top_k, unit_random
from localllm.runtime.scheduler import Chunk, Scheduler, Sequence as Seq, Status
from localllm.runtime.speculate import MAX_DRAFT, Acceptance, NgramIndex, Proposal, StepCosts, plan_drafts

log = logging.getLogger("localllm.engine")

#: Alternatives a token's log-probability entry lists at most (OpenAI's limit).
MAX_TOP_LOGPROBS = 20

#: KV memory when none is given: ~11k tokens of SmolLM2-135M in bf16.
DEFAULT_KV_BUDGET = 256 << 20


@dataclass
class GenerationStats:
    """Figures of one generation (times from ``time.perf_counter()``; durations in seconds, as Ollama
    reports them): every request the engine runs has one, and ``run``, the server and the bench read it."""

    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache
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

    @property
    def mean_accepted(self) -> float:
        """Draft tokens kept per verify step (each such step adds one token more of its own)."""
        return self.accepted_tokens / self.draft_steps if self.draft_steps else 0.0
    #: When each generated token was sampled (its step's end): inter-token latencies are the gaps.
    token_times: list[float] = field(default_factory=list)

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


class RequestHandle:
    """A submitted request: iterate it for its token ids as they come; :meth:`cancel` to stop it.

    Iterating waits for the engine's background thread when it runs, and otherwise drives the engine
    itself (each :meth:`BatchEngine.step` advances every request, not only this one).
    """

    def __init__(self, engine: "BatchEngine", request: "_Request") -> None:
        self._engine = engine
        self._request = request
        self.id = request.seq.id
        self.stats = request.stats

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        return self._engine._next_token(self._request)

    @property
    def done(self) -> bool:
        """Finished, and every token taken."""
        r = self._request
        return r.finished and not r.out

    def take(self) -> list[int]:
        """The tokens produced so far and not yet taken, without waiting or stepping (for a caller
        that drives :meth:`BatchEngine.step` itself and polls many requests)."""
        return self._engine._take(self._request)

    def cancel(self) -> None:
        """Stop generating; the request ends with ``finish_reason == "cancelled"`` at the next step
        (tokens already produced can still be read). Safe from any thread."""
        self._engine._cancel(self._request)

    def result(self) -> list[int]:
        """Every remaining token id, waiting for the end."""
        return list(self)

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """With ``logprobs`` asked at :meth:`BatchEngine.submit`: one entry per generated token so far,
        in order (entry i is token i's, there before token i can be taken)."""
        return self._request.token_logprobs


class _Request:
    """A sequence plus what the engine needs to sample and deliver its tokens."""

    def __init__(self, seq: Seq, params: SamplingParams, max_tokens: int | None, stop_ids: Sequence[int],
                 forced: Sequence[int] | None = None, constraint: Constraint | None = None,
                 logprobs: int | None = None) -> None:
        self.seq = seq
        #: Log-probabilities: None (not asked), or how many alternatives each token lists (0 to 20).
        self.top_logprobs = logprobs
        self.token_logprobs: list[TokenLogprob] = []
        self.step_logprobs: list[TokenLogprob] = []  # the current step's rows, for _deliver
        self.constraint = constraint  # the grammar its tokens must follow (None: free)
        self.params = params
        self.max_tokens = max_tokens
        self.stop = frozenset(stop_ids)
        #: Fixes the draw of the token at each position (:func:`runtime.sampling.unit_random`).
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        n = params.repeat_last_n
        prompt = seq.token_ids
        self.recent: deque[int] | None = (
            deque(prompt[-n:], maxlen=n) if params.repeat_penalty != 1.0 and n > 0 else None)
        self.stats = GenerationStats(prompt_tokens=seq.prompt_len, max_tokens=max_tokens,
                                     submitted_at=time.perf_counter())
        self.out: deque[int] = deque()  # produced, not yet taken by the handle
        #: Teacher forcing (:meth:`BatchEngine.forced_logits`): the tokens fed in place of the sampled
        #: ones, and the fp32 logits row of every step that sampled.
        self.forced: deque[int] | None = None if forced is None else deque(forced)
        self.logits: list[torch.Tensor] = []
        #: Speculative decoding: the sequence's n-gram index (made at its first proposal), its record of
        #: accepted drafts, and the match length of the draft in flight.
        self.index: NgramIndex | None = None
        self.acceptance = Acceptance()  # the engine's at submission (BatchEngine.submit)
        self.ngram = 0
        self.finished = False
        self.error: BaseException | None = None


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
    measured against). ``kv_dtype``: "16bit" (the activations' dtype) or "int8" (int8 codes and
    per-token, per-head scales: half the bytes).
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
        if attention not in ("auto", "sdpa"):
            raise ValueError(f"attention must be 'auto' or 'sdpa', not {attention!r}")
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', not {compile!r}")
        self.model = model
        config = model.config
        self.device = model.device
        self.plan: PoolPlan = plan_pool(config, kv_budget_bytes, model.dtype, block_size, kv_dtype)
        self.pool = KVPool.allocate(config, self.plan, self.device)
        self.blocks = BlockManager(self.plan.n_blocks, block_size, prefix_cache, self.plan.windows)
        self.scheduler = Scheduler(self.blocks, max_waiting, max_running, chunk_tokens)
        self.max_seq_len = min(max_seq_len or config.max_seq_len, self.scheduler.capacity_tokens)
        cos, sin = cache_rope_tables(config, self.max_seq_len, self.device)
        self._cos, self._sin = cos.to(model.dtype), sin.to(model.dtype)  # (max_seq_len, rot), 2 * rot with local ones
        self.kernel: PagedDecodeAttention | PagedSpanAttention | None = None
        self.chunk: PagedChunkAttention | None = None  # prefill chunks' attention beside a decode kernel
        if attention == "auto" and self.device.type == "cpu":
            from localllm.runtime import cpu_attention

            self.kernel = cpu_attention.paged_kernel()
            self.chunk = cpu_attention.chunk_kernel(config.head_dim)
        elif attention == "auto" and self.device.type == "cuda":
            from localllm.runtime import cuda_attention

            self.kernel = cuda_attention.span_kernel()
        self._compiled: CompiledDecode | None = None
        #: Decode-only steps replayed from CUDA graphs (on a real GPU with the paged kernel).
        self.graphs: GraphedDecode | None = None
        if (cuda_graphs and self.kernel is not None and self.device.type == "cuda" and torch.cuda.is_available()
                and all(layer.attn.softcap is None for layer in model.layers)):
            self.graphs = GraphedDecode(model, self.pool, self.kernel, self._cos, self._sin, max_running)
        #: "auto" found no compiled step built for this model and pool shape (``localllm compile``),
        #: and no build of it failed before.
        self.needs_build = False
        #: The batch size (query rows) a build for this engine covers (:func:`wanted_batch`): what to
        #: hand ``localllm compile --batch`` when :attr:`needs_build`.
        self.build_batch = wanted_batch(max_running, speculate)
        self.compile_s = 0.0  # building (True) or loading the compiled step's packages
        #: Why steps run eagerly although compiling was asked for (None: they do not, or it was not).
        self.compile_note: str | None = None
        self.speculate = speculate
        if compile:
            self._compile(compile is True, max_running)
        self._requests: dict[int, _Request] = {}  # live (not finished) requests by sequence id
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

    def _compile(self, build: bool, max_running: int) -> None:
        # Verify steps have more rows than sequences: packages built for such batches serve them too.
        rows = max_running * (1 + MAX_DRAFT) if self.speculate else max_running
        found = find_step(self.model, self.pool, self.kernel, max_running, build, load_batch=rows,
                          want_batch=self.build_batch)
        self._compiled, self.compile_s = found.step, found.seconds
        self.needs_build, self.compile_note = found.needs_build, found.note

    @property
    def compiled(self) -> bool:
        """Whether decode-only steps run through the compiled step."""
        return self._compiled is not None

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
            seq = Seq(self._next_id, len(prompt_ids), list(prompt_ids), self.max_seq_len)
            request = _Request(seq, params, max_tokens, stop_ids, forced, constraint, logprobs)
            request.acceptance = self.acceptance.start()
            self.scheduler.add(seq)  # raises before anything is recorded
            self._next_id += 1
            self._requests[seq.id] = request
            self._cond.notify_all()
        return RequestHandle(self, request)

    def _cancel(self, request: _Request) -> None:
        with self._cond:
            request.seq.cancelled = True
            self._cond.notify_all()

    @property
    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work

    # Stepping ------------------------------------------------------------------------------------
    def step(self) -> int:
        """Run one scheduling step; the number of tokens it computed (0: nothing to do)."""
        with self._step_lock:
            with self._cond:
                for r in list(self._requests.values()):
                    if r.seq.cancelled:
                        self._finish(r, "cancelled")
                if self.speculate:
                    self._propose()
                plan = self.scheduler.schedule()
                for seq in plan.admitted:
                    self._requests[seq.id].stats.cached_tokens = seq.cached_tokens  # the first admission's
                for seq in plan.preempted:
                    self._requests[seq.id].stats.preemptions = seq.preemptions
                sampling = [self._requests[c.seq.id] for c in plan.chunks if c.samples]
                prefill_tokens = plan.prefill_tokens  # now: a chunk stops sampling once its token is in
                self._cond.notify_all()
            if not plan.chunks:
                self._generating.release()
                return 0
            self._generating.hold()  # a background build stops while this engine has work
            t0 = time.perf_counter()
            try:
                tokens = self._run(plan.chunks, sampling)  # per sampling request: its accepted drafts, then its token
            except BaseException as e:
                with self._cond:
                    for c in plan.chunks:
                        r = self._requests.get(c.seq.id)
                        if r is not None:
                            r.error = e
                            self._finish(r, "error")
                    self._cond.notify_all()
                raise
            with self._cond:
                now = time.perf_counter()
                drafts = {r.seq.id: toks[:-1] for r, toks in zip(sampling, tokens) if r.seq.draft}
                self.scheduler.computed(plan.chunks, drafts)
                if not prefill_tokens:
                    self.costs.record(plan.num_tokens, now - t0)
                if drafts:
                    self.verify_steps += 1
                for r, toks in zip(sampling, tokens):
                    if r.seq.draft:
                        self._record_draft(r, len(toks) - 1)
                    for j, tok in enumerate(toks):
                        if r.finished:
                            break
                        self._deliver(r, tok, now, r.step_logprobs[j] if r.step_logprobs else None)
                self.steps += 1
                self.tokens_computed += plan.num_tokens
                self.last_step_s = now - t0
                self.last_step_prefill_tokens = prefill_tokens
                if not self.scheduler.has_work:
                    self._generating.release()  # idle: a stopped build may go on
                self._cond.notify_all()
            return plan.num_tokens

    def _propose(self) -> None:
        """Set the drafts of this step's decoding sequences (called with the lock held): in a step
        where every running sequence decodes and none waits, each one's n-gram proposal, as far as
        :func:`runtime.speculate.plan_drafts` finds it pays."""
        sched = self.scheduler
        running = sched.running
        if sched.waiting or not running or any(s.pending != 1 for s in running):
            for s in running:
                s.draft = []
            return
        proposals: list[Proposal | None] = []
        for seq in running:
            r = self._requests[seq.id]
            room = min(MAX_DRAFT, seq.max_len - len(seq.token_ids))
            if r.max_tokens is not None:
                room = min(room, r.max_tokens - r.stats.generated_tokens - 1)  # the step adds a token of its own
            if r.forced is not None or room < 1 or seq.cancelled:
                proposals.append(None)
                continue
            if r.index is None:
                r.index = NgramIndex()
            tokens, n = r.index.propose(seq.token_ids, room)
            if r.constraint is not None:  # only what the grammar takes: a refused draft could not be kept
                tokens = tokens[: r.constraint.valid_prefix(tokens)]
            proposals.append(Proposal(tokens, n, r.acceptance.rate(n)) if tokens else None)
        for seq, p, k in zip(running, proposals, plan_drafts(proposals, self.costs)):
            seq.draft = p.tokens[:k] if p is not None and k else []
            if seq.draft:
                self._requests[seq.id].ngram = p.ngram  # type: ignore[union-attr]

    def _record_draft(self, r: _Request, kept: int) -> None:
        drafted = len(r.seq.draft)
        r.acceptance.record(r.ngram, drafted, kept)
        self.acceptance.record(r.ngram, drafted, kept)
        r.stats.drafted_tokens += drafted
        r.stats.accepted_tokens += kept
        r.stats.draft_steps += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += kept
        r.seq.draft = []

    @torch.inference_mode()
    def _run(self, chunks: list[Chunk], requests: list[_Request]) -> list[list[int]]:
        """One forward over ``chunks``; for each chunk that samples (``requests``, in order) the tokens
        it adds: a verify chunk's accepted drafts, then one token of its own; otherwise one token."""
        specs = [SeqChunk([*c.seq.token_ids[c.start : c.start + c.length - c.draft], *c.seq.draft[: c.draft]],
                          c.start, c.seq.table.groups[0], c.samples, tuple(c.seq.table.groups[1:]), c.draft > 0)
                 for c in chunks]
        step, ids = PagedStep.build(self.pool, specs, self._cos, self._sin, self.kernel, self.chunk)
        # Each request's logits rows: one, or a verify chunk's 1 + len(draft).
        spans, row = [], 0
        for r in requests:
            spans.append((row, 1 + len(r.seq.draft)))
            row += spans[-1][1]
        constrained = [i for i, r in enumerate(requests) if r.constraint is not None]
        # The grammars' masks: on the CPU before the forward, while the caches still hold the grammar's
        # state rather than the weights; on a GPU after it is queued, while the device runs it.
        early = constrained and self.device.type == "cpu"
        bits = self._grammar_bits(spans, requests, constrained) if early else None
        if self._compiled is not None and self._compiled.takes(step):
            logits = self._compiled(ids, step)  # (S_out, vocab)
        elif self.graphs is not None and self.graphs.takes(step):
            logits = self.graphs(ids, step)  # (S_out, vocab)
        else:
            logits = self.model(ids, step)[0]
        if constrained and bits is None:
            bits = self._grammar_bits(spans, requests, constrained)
        for (at, _), r in zip(spans, requests):
            if r.forced is not None:
                r.logits.append(logits[at].float().clone())
        rows_of = {i: logits[at : at + n] for i, (at, n) in enumerate(spans)}
        # The model's own distribution, before any mask below changes these rows in place.
        scored = {i: torch.log_softmax(rows_of[i].float(), -1) for i, r in enumerate(requests)
                  if r.top_logprobs is not None}  # (n, V)
        if bits is not None:  # each constrained request's rows, refused tokens at -inf (in place: its own rows)
            row = 0
            for i in constrained:
                n = spans[i][1]
                apply_masks(rows_of[i], bits[row : row + n])
                row += n
        picks: list[torch.Tensor | None] = [None] * len(requests)
        plain = [i for i, r in enumerate(requests)
                 if r.params.greedy and r.recent is None and r.constraint is None]
        if plain:  # greedy rows in one argmax, of every row: indexing by a list of rows would upload
            best = greedy(logits)  # it with a blocking copy (a host sync on CUDA)
            for i in plain:
                at, n = spans[i]
                picks[i] = best[at : at + n]
        # What sampling needs from the host (each row's draw, the penalty's recent ids), uploaded in one
        # non-blocking copy for the whole step: a blocking upload waits for the GPU, one per request adds up.
        host: list[float] = []
        inputs: dict[int, tuple[tuple[int, int] | None, list[tuple[int, int]] | None]] = {}
        for i, r in enumerate(requests):
            if picks[i] is not None:
                continue
            n, draft, length = spans[i][1], r.seq.draft, len(r.seq.token_ids)
            draws = None
            if not r.params.greedy:  # the draw of each row's position
                draws = (len(host), n)
                host += [unit_random(r.seed, length + j) for j in range(n)]
            rows = None
            if r.recent is not None:  # the penalty's window of each row: the drafts before it too
                rows, window = [], r.params.repeat_last_n
                for j in range(n):
                    ids = [*r.recent, *draft[:j]][-window:]
                    rows.append((len(host), len(ids)))
                    host += ids  # token ids are exact in float64
            inputs[i] = (draws, rows)
        up = torch.tensor(host, dtype=torch.float64).to(logits.device, non_blocking=True) if host else None
        for i, (draws, rows) in inputs.items():
            u = None if draws is None or up is None else up[draws[0] : draws[0] + draws[1]]
            recent = None if rows is None or up is None else [up[a : a + w].long() for a, w in rows]
            picks[i] = sample(rows_of[i], requests[i].params, u, recent)  # (n,)
        if not picks:
            return []
        chosen = torch.cat(picks).tolist()  # type: ignore[arg-type]  # the one transfer to the host per step
        out = []
        for (at, n), r in zip(spans, requests):
            rows, draft = chosen[at : at + n], r.seq.draft
            kept = 0  # a draft token stays while it is the token its row picks (the same draw: exact)
            while kept < len(draft) and rows[kept] == draft[kept]:
                kept += 1
            out.append([*draft[:kept], rows[kept]])
        for i, lp in scored.items():
            r, (at, n) = requests[i], spans[i]
            r.step_logprobs = self._logprobs(lp[: len(out[i])], out[i], r.top_logprobs or 0)
        return out

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

    @staticmethod
    def _grammar_bits(spans: list[tuple[int, int]], requests: list[_Request], which: list[int]) -> torch.Tensor:
        """The allowed-token bitmask of every row of each constrained request in ``which``, stacked
        (rows, words) int32: a verify chunk's row j is the mask after its first j draft tokens."""
        n_rows = sum(spans[i][1] for i in which)
        words = requests[which[0]].constraint.words  # type: ignore[union-attr]  # one vocabulary per model
        bits = torch.empty(n_rows, words, dtype=torch.int32)
        row = 0
        for i in which:
            n = spans[i][1]
            requests[i].constraint.fill(bits[row : row + n], requests[i].seq.draft)  # type: ignore[union-attr]
            row += n
        return bits

    def _deliver(self, r: _Request, tok: int, now: float, logprob: TokenLogprob | None = None) -> None:
        """A sampled token: end on a stop id (not delivered), else hand it over and end at the limits."""
        seq, stats = r.seq, r.stats
        if seq.cancelled:
            self._finish(r, "cancelled")
            return
        if r.forced is not None:  # teacher forcing: the given token, whatever was sampled
            if not r.forced:
                self._finish(r, "length")
                return
            tok = r.forced.popleft()
        if tok in r.stop:
            self._finish(r, "stop")
            return
        if r.constraint is not None and not r.constraint.take(tok):
            # No token was allowed (the grammar hit a limit, or broke): end here, and say why.
            stats.constraint_error = r.constraint.error or f"token {tok} refused"
            log.warning("request %d: the grammar allows no further token (%s); it ends here",
                        seq.id, stats.constraint_error)
            self._finish(r, "constraint")
            return
        if stats.first_token_at is None:
            stats.first_token_at = now
        stats.token_times.append(now)
        seq.token_ids.append(tok)
        stats.generated_tokens += 1
        if logprob is not None:
            r.token_logprobs.append(logprob)  # before the token can be taken
        r.out.append(tok)
        if r.recent is not None:
            r.recent.append(tok)
        if r.constraint is not None and r.constraint.done:  # the grammar is complete: nothing may follow
            self._finish(r, "stop")
        elif r.max_tokens is not None and stats.generated_tokens >= r.max_tokens:
            self._finish(r, "length")
        elif len(seq.token_ids) > seq.max_len:  # the newest token has no position left to run at
            self._finish(r, "length")

    def _finish(self, r: _Request, reason: str) -> None:
        """Retire ``r`` now (its blocks freed). Called with the lock held."""
        if r.finished:
            return
        self.scheduler.finish(r.seq)
        r.finished = True
        r.stats.finish_reason = reason
        r.stats.finished_at = time.perf_counter()
        self._requests.pop(r.seq.id, None)

    def forced_logits(self, prompt_ids: Sequence[int], fed: Sequence[int]) -> torch.Tensor:
        """Teacher forcing: the fp32 logits (len(fed) + 1, vocab) after ``prompt_ids`` and after each of
        ``fed`` in turn, fed in place of what the model would pick, through this engine's own steps (its
        pool, prefix cache and compiled step: what generation computes, not a second forward)."""
        handle = self.submit(prompt_ids, SamplingParams(temperature=0), forced=fed)
        handle.result()
        request = handle._request
        return torch.stack(request.logits[: len(fed) + 1])

    def embed(self, inputs: Sequence[Sequence[int]], pooling: str = "last") -> torch.Tensor:
        """Pooled, normalized final hidden states (len(inputs), dim) (:func:`runtime.embed.embed`), a
        batch at a time between this engine's steps (never beside one, on the same cores)."""
        from localllm.runtime.embed import embed

        for i, ids in enumerate(inputs):
            if not ids:
                raise LocalLLMError(f"input {i} is empty", "give some text to embed")
            if len(ids) > self.max_seq_len:
                raise LocalLLMError(f"input {i} is {len(ids)} tokens; the context holds {self.max_seq_len}",
                                    "shorten it, or let it be truncated")
        return embed(self.model, inputs, pooling, turn=self._step_lock)

    def run_until_done(self) -> None:
        """Step until every submitted request has finished (the simple driver)."""
        while self.step() or self.has_work:
            pass

    # Delivery ------------------------------------------------------------------------------------
    def _take(self, r: _Request) -> list[int]:
        with self._cond:
            out = list(r.out)
            r.out.clear()
            if not out and r.finished and r.error is not None:
                raise r.error
            return out

    def _next_token(self, r: _Request) -> int:
        while True:
            with self._cond:
                if r.out:
                    return r.out.popleft()
                if r.finished:
                    if r.error is not None:
                        raise r.error
                    raise StopIteration
                if self._thread is not None:
                    self._cond.wait()
                    continue
            if not self.step() and not r.finished and not r.out:
                with self._cond:  # nothing ran: wait for whoever is stepping
                    if self._thread is None and not r.out and not r.finished:
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
