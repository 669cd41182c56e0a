"""Loaded models: each on its own :class:`BatchEngine` (one background thread), loaded on first use
(concurrent first requests share one load), kept alive per ``keep_alive`` after its last request,
and unloaded when that runs out or when a memory budget needs room for another model (the least
recently used idle model goes first). A model with requests in flight is never unloaded, except at
shutdown, which cancels them.

A request holds its model through a :class:`Lease`, closed exactly once however the request ends
(answered, failed, or its client gone at any moment): closing cancels its generation, which frees
its KV blocks and its slot in the batch, and releases its hold, which starts the keep-alive. Work
that can take long (loading, unloading and collecting the freed memory, sizing a model from its
files) runs on worker threads, never on the event loop.

A request's model name is checked before anything else, and resolved to what it loads only as
:mod:`localllm.server.names` allows; the names the operator preloaded resolve as ``run`` resolves them.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TypeVar

import anyio

from localllm.errors import LocalLLMError
from localllm.loaders.load import LoadedModel, release_freed_memory
from localllm.report import placement_lines
from localllm.runtime.batch import DEFAULT_KV_BUDGET, BatchEngine
from localllm.runtime.constrain import Constraint, Constraints, Grammar
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.scheduler import EngineBusy
from localllm.runtime.tools import call_syntax, reply_stop_ids
from localllm.server.config import ServerConfig
from localllm.server.generation import Generation
from localllm.server.metrics import Metrics
from localllm.server.names import (AS_RUN, REPO, Target, check_name, operator_target, pull_repo, resolve,
                                   stored_from_repo)

log = logging.getLogger("localllm.server")

T = TypeVar("T")

#: "keep the server's default" (None already means "forever").
DEFAULT = object()


@dataclass(eq=False)
class ModelSlot:
    """A loaded model and its engine."""

    name: str
    lm: LoadedModel
    engine: BatchEngine
    stop_ids: list[int]
    size_bytes: int
    load_s: float
    keep_alive_s: float | None
    #: Of a GPU run's weights, those placed in CPU RAM (experts, first blocks: ``--n-cpu-moe``,
    #: ``--gpu-layers``), not counted in ``size_bytes`` (the device's share).
    host_bytes: int = 0
    loaded_at: float = field(default_factory=time.time)
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    generations: set[Generation] = field(default_factory=set)
    constraints: Constraints = field(init=False)  # its vocabulary and compiled grammars (structured outputs)

    def __post_init__(self) -> None:
        self.constraints = Constraints(self.lm.tokenizer, self.stop_ids)

    @property
    def context_length(self) -> int:
        """Positions one sequence may hold (the model's context, capped by the KV pool)."""
        return self.engine.max_seq_len

    @property
    def expires_at(self) -> float | None:
        """``time.monotonic()`` when an idle model is unloaded (None: never, or busy now)."""
        if self.keep_alive_s is None:
            return None
        return self.last_used + self.keep_alive_s

    def expires_at_wall(self) -> datetime:
        """The expiry as a wall-clock time (far in the future when kept forever), as ``/api/ps`` shows it."""
        now = datetime.now(timezone.utc)
        if self.keep_alive_s is None:
            return now + timedelta(days=365 * 100)
        left = self.keep_alive_s if self.active else max(0.0, self.expires_at - time.monotonic())  # type: ignore[operator]
        return now + timedelta(seconds=left)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None,
               stop: Sequence[str], metrics: Metrics, constraint: Constraint | None = None,
               logprobs: int | None = None) -> Generation:
        """Queue a generation on this model's engine; raises EngineBusy (queue full) or LocalLLMError.
        ``logprobs``: record each token's log-probability and that many alternatives."""
        try:
            handle = self.engine.submit(prompt_ids, params, max_tokens, self.stop_ids, constraint=constraint,
                                        logprobs=logprobs)
        except EngineBusy:
            metrics.rejected()
            raise
        try:
            gen = Generation(handle, self.lm.tokenizer, stop, on_end=metrics.outcome)
        except BaseException:
            handle.cancel()  # queued, but nobody will read it: retire it at the engine's next step
            raise
        self.generations.add(gen)
        return gen


@dataclass(eq=False)
class Lease:
    """One request's hold on a loaded model and, once submitted, its generation (see the module's doc).

    ``load_s``: the seconds the request waited for the model to load (0 when it was loaded)."""

    manager: "ModelManager"
    slot: ModelSlot
    load_s: float = 0.0
    gen: Generation | None = None
    closed: bool = False

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None,
               stop: Sequence[str], constraint: Constraint | None = None, logprobs: int | None = None) -> Generation:
        """Queue the generation on the model's engine (once per lease)."""
        if self.gen is not None or self.closed:
            raise RuntimeError("a lease submits one generation, before it is closed")
        self.gen = self.slot.submit(prompt_ids, params, max_tokens, stop, self.manager.metrics, constraint, logprobs)
        return self.gen

    async def token_bytes(self) -> Callable[[int], bytes]:
        """Each token's bytes, for log-probability entries (the model's vocabulary index is built on a
        worker thread the first time: call this before answering, so the event loop never builds it)."""
        vocab = self.slot.constraints
        await anyio.to_thread.run_sync(vocab.token_bytes, 0)
        return vocab.token_bytes

    async def constraint(self, grammar: Grammar | None) -> Constraint | None:
        """A constraint of ``grammar`` for this request, compiled (or copied from the model's cache) on
        a worker thread: the first one builds the model's vocabulary index, a second or two for a large
        vocabulary, which the event loop never waits on."""
        if grammar is None:
            return None
        return await anyio.to_thread.run_sync(self.slot.constraints.start, grammar)

    def close(self) -> None:
        """Cancel the generation (nothing if it has ended) and release the model; once, from the event loop."""
        if self.closed:
            return
        self.closed = True
        if self.gen is not None:
            self.gen.cancel()
        self.manager.release(self.slot, self.gen)


def estimate_bytes(target: Target) -> int:
    """What loading ``target`` will take, roughly, before loading it: its files' size (0 if unknown).
    A folder's files are counted at its top level only, where a model folder keeps its weights: a
    folder that is no model is never walked."""
    try:
        if target.entry is not None:
            return target.entry.size_bytes
        if target.kind == REPO:
            from localllm.loaders.store import Store

            entry = stored_from_repo(Store(), target.ref)
            return entry.size_bytes if entry is not None else 0
        path = Path(target.ref).expanduser() if target.kind == AS_RUN else Path(target.ref)  # the operator's own
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        if target.kind == AS_RUN:
            from localllm.loaders.store import Store

            return Store().resolve(target.ref).size_bytes
        return 0
    except (OSError, ValueError, RuntimeError, LocalLLMError):  # RuntimeError: an operator's ~user of no user
        return 0


async def in_own_thread(fn: Callable[[str], T], arg: str) -> T:
    """``fn(arg)`` on a thread of its own that ends with it (a model's load).

    Not on a pooled worker thread: a thread that has run torch's parallel CPU ops keeps a team of
    OpenMP workers for as long as it lives, and while the process holds more such workers than the
    machine has cores, libgomp stops them spinning between parallel regions. Every small op of the
    engine thread's decode step then waits for its workers to wake: a server stream decoded at a
    fraction of ``run``'s speed while the thread that loaded its model lived on as an idle worker."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result = fn(arg)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=work, name=f"localllm-load-{arg}", daemon=True).start()
    return await future


def _drop(slot: ModelSlot) -> None:
    """On a worker thread: stop the engine, let go of the model and give its memory back to the system."""
    slot.engine.stop()
    del slot.engine, slot.lm
    gc.collect()
    release_freed_memory()


class ModelManager:
    """The loaded models of one server (all calls from the event loop)."""

    def __init__(self, config: ServerConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.slots: dict[str, ModelSlot] = {}
        self._loading: dict[str, asyncio.Task[ModelSlot]] = {}
        #: Requests waiting for each model's load: they count against the queue limit, as the
        #: engine's own queue would count them.
        self._load_waiters: dict[str, int] = {}
        self._reaper: asyncio.Task[None] | None = None
        #: Names the operator preloaded (``serve --preload``): requests may name them, resolved as
        #: ``run`` resolves them, paths included.
        self._operator_names: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap())

    async def close(self) -> None:
        """Cancel what is in flight and unload everything (shutdown)."""
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._loading.values()):
            try:
                await task
            except BaseException:  # noqa: BLE001 - a failed load leaves nothing to unload
                pass
        for slot in list(self.slots.values()):
            for gen in list(slot.generations):
                gen.cancel()
            await self._unload(slot)

    # ------------------------------------------------------------------ use
    async def acquire(self, name: str, keep_alive: object = DEFAULT) -> tuple[ModelSlot, float]:
        """The loaded model ``name`` (loading it if needed), marked in use; and the seconds this call
        spent loading it (0 when it was loaded already). Pair with :meth:`release`."""
        self._check(name)
        waited = 0.0
        while True:
            slot = self.slots.get(name)
            if slot is not None:
                slot.active += 1
                if keep_alive is not DEFAULT:
                    slot.keep_alive_s = keep_alive  # type: ignore[assignment]
                return slot, waited
            waiters = self._load_waiters.get(name, 0)
            if waiters >= self.config.parallel + self.config.queue:
                self.metrics.rejected()
                raise EngineBusy(waiters, what="for the model to load")
            task = self._loading.get(name)
            if task is None:
                task = asyncio.create_task(self._load(name))
                self._loading[name] = task
                task.add_done_callback(lambda t, n=name: self._loading.pop(n, None))
            t0 = time.perf_counter()
            self._load_waiters[name] = waiters + 1
            try:
                await asyncio.shield(task)  # a client that leaves does not stop the load others wait for
            finally:
                left = self._load_waiters.pop(name) - 1
                if left:
                    self._load_waiters[name] = left
            waited += time.perf_counter() - t0

    async def preload(self, name: str) -> None:
        """Load ``name``, which the operator gave (``serve --preload``): any name ``run`` takes, a path
        included; requests may name it from then on."""
        self._operator_names.add(name)
        slot, _ = await self.acquire(name)
        self.release(slot)

    def _check(self, name: object) -> None:
        """A request's name is one this server serves (:func:`names.check_name`), before anything is read."""
        if not (isinstance(name, str) and name in self._operator_names):
            check_name(name, self.config)

    async def lease(self, name: str, keep_alive: object = DEFAULT) -> Lease:
        """:meth:`acquire` for one request: the hold as a :class:`Lease`, to close when the request ends."""
        slot, waited = await self.acquire(name, keep_alive)
        return Lease(self, slot, waited)

    def release(self, slot: ModelSlot, gen: Generation | None = None) -> None:
        """A request is done with ``slot``; its keep-alive starts now (0: unload at once when idle)."""
        slot.active -= 1
        slot.last_used = time.monotonic()
        if gen is not None:
            slot.generations.discard(gen)
        if slot.active == 0 and slot.keep_alive_s == 0:
            asyncio.get_running_loop().create_task(self._unload(slot))

    async def unload(self, name: str) -> bool:
        """Unload ``name`` now if it is loaded and idle (``keep_alive: 0`` with no prompt)."""
        self._check(name)
        slot = self.slots.get(name)
        if slot is None:
            return False
        if slot.active:
            slot.keep_alive_s = 0  # unloaded when its last request ends
            return True
        await self._unload(slot)
        return True

    async def forget(self, name: str) -> None:
        """Unload every loaded model that came from the store entry ``name`` (it is being deleted)."""
        for key in [k for k in self.slots if k == name]:
            slot = self.slots[key]
            for gen in list(slot.generations):
                gen.cancel()
            await self._unload(slot)

    # ------------------------------------------------------------------ loading
    async def _load(self, name: str) -> ModelSlot:
        target, size = await anyio.to_thread.run_sync(self._target, name)
        await self._make_room(size + (self.config.kv_memory or DEFAULT_KV_BUDGET), keep=None)
        slot = await in_own_thread(functools.partial(self._load_blocking, target=target), name)
        self.slots[name] = slot
        self.metrics.models_loaded_total += 1
        await self._make_room(0, keep=slot)
        log.info("loaded %s in %.1f s (%d MB); %s", name, slot.load_s, slot.size_bytes // 10**6,
                 slot.engine.plan.describe())
        for line in placement_lines(slot.lm, slot.engine.runner.eager_reason):  # on a GPU: where its parts live
            log.info("%s placement: %s", name, line)
        return slot

    def target(self, name: str) -> Target:
        """On a worker thread: what ``name`` loads (:func:`names.resolve`; a name the operator preloaded
        as ``run`` takes it)."""
        return operator_target(name) if name in self._operator_names else resolve(name, self.config)

    def _target(self, name: str) -> tuple[Target, int]:
        """On a worker thread: what ``name`` loads, and roughly how many bytes."""
        target = self.target(name)
        return target, estimate_bytes(target)

    def _load_blocking(self, name: str, target: Target) -> ModelSlot:
        """On a thread of its own: fetch ``target`` if it is a Hub repo not stored yet, load it, start its engine."""
        from localllm.loaders.load import load_model

        t0 = time.perf_counter()
        cfg = self.config
        ref = target.ref
        if target.kind == REPO:
            ref = str(pull_repo(target.ref, cfg.quant).path)
        elif target.kind == AS_RUN:
            from localllm.loaders.pull import pull_if_missing
            from localllm.loaders.store import check_local_path

            check_local_path(name)
            ref = pull_if_missing(name, cfg.quant)
        spec = cfg.load_spec(ref)
        lm = load_model(spec)
        budget = cfg.kv_memory or DEFAULT_KV_BUDGET
        if cfg.kv_memory is None and lm.device.type == "cuda":  # the card's free memory, not a CPU-sized default
            from localllm.loaders.memory_plan import available_memory, gpu_kv_budget

            budget = gpu_kv_budget(lm.config, lm.dtype, spec.kv_dtype, cfg.parallel, cfg.chunk_tokens,
                                   available_memory(lm.device)[0])
        engine = BatchEngine(lm.model, kv_budget_bytes=budget,
                             max_running=cfg.parallel, max_waiting=cfg.queue, chunk_tokens=cfg.chunk_tokens,
                             kv_dtype=spec.kv_dtype, compile="auto", speculate=cfg.speculate)
        if engine.compile_note:  # decode steps that run eagerly, why, and when a build is tried again
            log.warning("%s: %s", name, engine.compile_note)
        # the compiled decode step, for the next time this model is loaded
        if engine.needs_build and cfg.build_in_background is not None:
            from localllm.paths import build_log

            if cfg.build_in_background(spec, engine.build_batch):
                log.info("building a compiled decode step for %s in the background, only on idle CPU time; it goes "
                         "on after the server stops (output in %s); the next load of %s uses it",
                         name, build_log(), name)
        engine.start()
        tk = lm.tokenizer  # harmony's <|return|> and <|call|> end a reply whatever the files list
        ends = reply_stop_ids(call_syntax(tk.chat_template, tk.token_to_id), tk.token_to_id)
        stop_ids = list(dict.fromkeys([*tk.eos_ids, *lm.config.eos_token_ids, *ends]))
        host = lm.placement.host_bytes if lm.placement is not None and lm.placement.split else 0  # experts in CPU RAM
        return ModelSlot(name, lm, engine, stop_ids, lm.weight_bytes - host + engine.plan.bytes,
                         time.perf_counter() - t0, cfg.keep_alive_s, host_bytes=host)

    async def _make_room(self, need: int, keep: ModelSlot | None) -> None:
        """Unload idle models, least recently used first, until ``need`` more bytes fit the budget."""
        budget = self.config.models_memory
        if budget is None:
            return
        while sum(s.size_bytes for s in self.slots.values()) + need > budget:
            idle = [s for s in self.slots.values() if s.active == 0 and s is not keep]
            if not idle:
                return  # what is loaded is busy (or alone): over budget until it is idle
            victim = min(idle, key=lambda s: s.last_used)
            log.info("unloading %s to make room (memory budget %d MB)", victim.name, budget // 10**6)
            await self._unload(victim)

    async def _unload(self, slot: ModelSlot) -> None:
        if self.slots.get(slot.name) is not slot:
            return
        del self.slots[slot.name]
        self.metrics.models_unloaded_total += 1
        slot.generations.clear()
        await anyio.to_thread.run_sync(_drop, slot)
        log.info("unloaded %s", slot.name)

    async def _reap(self) -> None:
        """Unload idle models whose keep-alive ran out (checked twice a second)."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for slot in list(self.slots.values()):
                expires = slot.expires_at
                if slot.active == 0 and expires is not None and expires <= now:
                    await self._unload(slot)
