"""The batch engine as tests drive it: one sequence alone (the reference every batched, compiled or
windowed run is compared with) and teacher-forced logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localllm.runtime.batch import BatchEngine
from localllm.runtime.engine import sequence_engine
from localllm.runtime.model import Transformer
from localllm.runtime.sampling import SamplingParams
from localllm.runtime.scheduler import Chunk
from localllm.runtime.sequence import Sequence as Seq

GREEDY = SamplingParams(temperature=0)


def step_chunk(tokens: Sequence[int], start: int, blocks: Sequence[int], logits: bool = True,
               more: Sequence[Sequence[int]] = (), verify: bool = False) -> Chunk:
    """The scheduler's chunk that runs ``tokens`` at positions ``start ..`` with ``blocks`` (and
    ``more``: the other layer groups' tables), as :meth:`runtime.paged.PagedStep.build` takes it: a
    sequence whose tokens before ``start`` are computed, and that samples after the chunk when
    ``logits`` (else more tokens follow); ``verify``: the first token then a draft of the rest."""
    tokens = list(tokens)
    draft = len(tokens) - 1 if verify else 0
    ids = [0] * start + tokens[: len(tokens) - draft] + ([] if logits or verify else [0])
    seq = Seq(0, len(ids), ids, max_len=len(ids) + len(tokens) + 1)
    seq.table.groups = [list(blocks), *map(list, more)]
    seq.draft = tokens[len(tokens) - draft :]
    return Chunk(seq, start, len(tokens), draft)


def alone(model: Transformer, prompt: Sequence[int], params: SamplingParams = GREEDY, n: int = 16,
          ctx: int = 256, kv_dtype: str = "16bit", stop_ids: Sequence[int] = (),
          compile: bool | str = False) -> list[int]:
    """Up to ``n`` tokens of ``prompt`` run alone in an engine of its own (``ctx`` positions)."""
    engine = sequence_engine(model, ctx, compile=compile, kv_dtype=kv_dtype)
    return engine.submit(list(prompt), params, max_tokens=n, stop_ids=stop_ids).result()


def forced(model: Transformer, prompt: Sequence[int], fed: Sequence[int], ctx: int | None = None,
           **engine: object) -> torch.Tensor:
    """Teacher-forced fp32 logits (len(fed) + 1, vocab) after ``prompt`` and each of ``fed``, from an
    engine of its own (``engine``: BatchEngine options; a one-sequence engine when none is given)."""
    positions = ctx or len(prompt) + len(fed) + 1
    if engine:
        return BatchEngine(model, **engine).forced_logits(list(prompt), list(fed))  # type: ignore[arg-type]
    return sequence_engine(model, positions).forced_logits(list(prompt), list(fed))


@torch.inference_mode()
def reference(model: Transformer, prompt: Sequence[int], params: SamplingParams = GREEDY, n: int | None = 16,
              ctx: int = 256, stop_ids: Sequence[int] = ()) -> list[int]:
    """The tokens of ``prompt`` by the plainest loop there is: a whole cache-less forward per token
    (SDPA over the sequence, no pool, no kernel, no engine), sampled as the engine samples (the draw
    its seed fixes at each position, the repeat penalty's window of the last ``repeat_last_n`` ids), ending as the engine ends
    (a stop id, ``n`` tokens, or no position left in ``ctx``). What the engine's runs are checked against."""
    from collections import deque

    from localllm.runtime.sampling import sample, unit_random

    seq, out = list(prompt), []
    window = params.repeat_last_n
    recent = deque(seq[-window:], maxlen=window) if params.repeat_penalty != 1.0 and window > 0 else None
    while True:
        logits = model(torch.tensor([seq], device=model.device), last_only=True)[0]  # (1, vocab)
        u = None if params.seed is None else torch.tensor([unit_random(params.seed, len(seq))], dtype=torch.float64)
        ids = None if recent is None else [torch.tensor(list(recent), dtype=torch.long, device=model.device)]
        tok = int(sample(logits, params, u, ids))
        if tok in stop_ids:
            return out
        out.append(tok)
        seq.append(tok)
        if recent is not None:
            recent.append(tok)
        if (n is not None and len(out) >= n) or len(seq) > ctx:
            return out
