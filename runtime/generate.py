"""Prefill, cached decode and the token loop, with the timing of each phase."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from localllm.errors import LocalLLMError
from localllm.runtime.cache import SequenceCache
from localllm.runtime.model import Transformer
from localllm.runtime.sampling import SamplingParams, make_generator, sample


@torch.inference_mode()
def prefill(model: Transformer, cache: SequenceCache, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Run the prompt tokens (B, T) in one forward from position ``start``, filling ``cache``.

    Returns the logits of the last position (B, vocab).
    """
    T = tokens.shape[1]
    input_pos = torch.arange(start, start + T, device=tokens.device)
    return model(tokens, cache, input_pos, start, last_only=True)[:, -1]


def forward_one_token(
    model: Transformer, cache: SequenceCache, token: torch.Tensor, input_pos: torch.Tensor, pos: int
) -> torch.Tensor:
    """One token (B, 1) at position ``pos`` (also given as the (1,) tensor ``input_pos``) over ``cache``
    -> logits (B, vocab).

    Undecorated, so that ``torch.compile`` can trace it; callers run it under inference mode.
    """
    return model(token, cache, input_pos, pos)[:, -1]


@torch.inference_mode()
def decode_one_token(
    model: Transformer, cache: SequenceCache, token: torch.Tensor, input_pos: torch.Tensor, pos: int
) -> torch.Tensor:
    """One cached decode step (see :func:`forward_one_token`)."""
    return forward_one_token(model, cache, token, input_pos, pos)


def _min_step_cache() -> int:
    from localllm.runtime.aot import MIN_STEP_CACHE

    return MIN_STEP_CACHE


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class GenerationStats:
    """Figures of one generation, as Ollama reports them (durations in seconds)."""

    prompt_tokens: int = 0  # tokens actually run through prefill (a reused cached prefix is not counted)
    cached_tokens: int = 0  # prompt tokens whose keys/values were reused from the previous turn
    prompt_s: float = 0.0
    generated_tokens: int = 0
    decode_s: float = 0.0  # from the first generated token to the last
    stop_reason: str = ""  # "eos", "max_tokens", "context", "stop_string"
    token_latencies_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        """Time to first token: the prefill (the first token is sampled from its logits)."""
        return self.prompt_s

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def decode_tps(self) -> float:
        steps = self.generated_tokens - 1  # the first token comes from prefill
        return steps / self.decode_s if self.decode_s and steps > 0 else 0.0


def check_prompt(prompt: Sequence[int], ctx: int) -> None:
    """Refuse an empty prompt, or one that leaves no position of a ``ctx`` context to generate in."""
    if not prompt:
        raise LocalLLMError("the prompt is empty", "give some text to continue")
    if len(prompt) >= ctx:
        raise LocalLLMError(
            f"the prompt is {len(prompt)} tokens, the context holds {ctx}",
            f"use a shorter prompt or a larger context (--ctx {len(prompt) + 256} or more)",
        )


class Generator:
    """Runs a model token by token over a KV cache of ``ctx`` positions that it owns.

    The cache records the tokens whose keys/values it holds, so that a follow-up prompt sharing a
    prefix with the previous one (a chat's history) only prefills what is new. Any number of
    generators can share one model: each reads and writes its own cache alone.
    """

    def __init__(self, model: Transformer, ctx: int, compile: bool | str = False, kv_dtype: str = "16bit") -> None:
        """``compile``: True compiles the decode step now if it is not built yet (:mod:`runtime.compile`);
        "auto" uses a step already built for this model (:func:`runtime.compile.ready_decode`) and
        otherwise runs eagerly, compiling nothing (:attr:`needs_build` then says so); False: eager."""
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', not {compile!r}")
        if compile is True and kv_dtype != "16bit":
            raise LocalLLMError(f"the compiled decode step does not support a {kv_dtype} KV cache",
                                f"leave out --compile or --kv-cache {kv_dtype}")
        self.model = model
        self.ctx = ctx
        self.device = model.device
        self.kv_dtype = kv_dtype
        self.cache = model.new_cache(ctx, kv_dtype=kv_dtype)
        self._decode = decode_one_token
        self._run: object | None = None  # the generate() call that owns the cache now
        self.stats = GenerationStats()
        self.compile_s = 0.0  # the warm-up that compiled (or loaded) the decode step
        #: "auto" found no compiled step for this model, and no build of it failed before: one built ahead
        #: (``localllm compile``) would serve the next runs.
        self.needs_build = False
        if compile == "auto" and kv_dtype == "16bit" and ctx >= _min_step_cache():
            from localllm.paths import home
            from localllm.runtime.compile import ready_decode

            ready = ready_decode(forward_one_token, self.device, home() / "inductor")
            if ready is not None:
                t0 = time.perf_counter()
                self._decode = ready
                self._warm_up()  # finds and loads the package (milliseconds), or finds none
                self.compile_s = time.perf_counter() - t0
                if ready.missing:  # unless a build of it failed before: it would fail again
                    self._decode, self.needs_build = decode_one_token, not ready.failed_before
        elif compile is True:
            from localllm.paths import home
            from localllm.runtime.compile import compiled_decode

            t0 = time.perf_counter()
            self._decode = compiled_decode(forward_one_token, self.device, home() / "inductor")
            self._warm_up()
            self.compile_s = time.perf_counter() - t0  # with the compiler's imports: all of it

    @property
    def step_kind(self) -> str:
        """What runs the decode step now: "eager", "aot" or "torch.compile" (a failed compiled step
        falls back, so this can change during a reply)."""
        return getattr(self._decode, "kind", "eager")

    def _warm_up(self) -> None:
        """One decode step at a scratch position, so that compilation (tens of seconds the first
        time, about a second from the disk cache) happens now rather than inside the first reply's timing.

        The scratch keys/values land at a position that any real sequence writes before it reads it.
        """
        pos = min(8, self.ctx - 1)  # not 0 or 1: dynamo would specialise the graph on a length of 1
        token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._decode(self.model, self.cache, token, torch.tensor([pos], device=self.device), pos)
        _sync(self.device)

    def reset(self) -> None:
        """Forget what the cache holds: the next prompt is prefilled whole."""
        self.cache.tokens = []
        self._run = None

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        stop_ids: Sequence[int] = (),
    ) -> Iterator[int]:
        """Yield generated token ids one at a time (a stop id ends generation and is not yielded).

        ``self.stats`` holds the figures of the current/last call; ``stop_reason`` says why it ended.
        """
        check_prompt(prompt, self.ctx)
        stats = self.stats = GenerationStats()
        cache = self.cache
        run = self._run = object()  # an earlier call's iterator, resumed, would now write over this one
        reuse = _common_prefix(cache.tokens, prompt)
        if reuse == len(prompt):
            reuse -= 1  # at least one token must run to give the next logits
        reuse = cache.reusable(len(cache.tokens), reuse)  # a sliding layer's ring may have moved on
        stats.cached_tokens = reuse
        dev = self.device
        gen = make_generator(params.seed, dev)
        stop = frozenset(stop_ids)
        n_recent = params.repeat_last_n
        # The last repeat_last_n token ids (0: the penalty is off), (1, n) on the device: each sampled
        # token joins them there, so no ids cross from the host per token (a blocking upload per token
        # was a second host sync beside the token's read; the CUDA dry run counts them).
        recent = None
        if params.repeat_penalty != 1.0 and n_recent > 0:
            recent = torch.tensor([list(prompt[-n_recent:])], device=dev, dtype=torch.long)

        t0 = time.perf_counter()
        new = torch.tensor([list(prompt[reuse:])], device=dev, dtype=torch.long)
        cache.tokens = list(prompt[:reuse])  # all that is sure to hold should the prefill fail midway
        logits = prefill(self.model, cache, new, reuse)
        cache.tokens = list(prompt)
        stats.prompt_tokens = new.shape[1]
        pos = len(prompt)
        input_pos = torch.empty(1, device=dev, dtype=torch.long)
        limit = max_tokens if max_tokens is not None else self.ctx
        first = True
        while True:
            token = sample(logits, params, recent, gen)  # (1,)
            tok = int(token.item())  # the one value that crosses to the host each step
            now = time.perf_counter()
            if tok in stop:  # timed neither as prefill nor as a decoded token: it is not yielded
                if first:
                    stats.prompt_s = now - t0
                stats.stop_reason = "eos"
                return
            if first:
                stats.prompt_s = now - t0
                t_first = now
                first = False
            else:
                stats.token_latencies_s.append(now - t_last)
                stats.decode_s = now - t_first
            t_last = now
            stats.generated_tokens += 1
            yield tok
            if recent is not None:
                recent = torch.cat([recent, token.view(1, 1)], dim=1)[:, -n_recent:]
            if stats.generated_tokens >= limit:
                stats.stop_reason = "max_tokens"
                return
            if pos >= self.ctx:
                stats.stop_reason = "context"
                return
            if self._run is not run:
                raise RuntimeError("this Generator's cache was reset or taken by a later generate() call; "
                                   "one Generator runs one sequence at a time")
            input_pos.fill_(pos)
            logits = self._decode(self.model, cache, token.view(1, 1), input_pos, pos)
            cache.tokens.append(tok)
            pos += 1


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
