"""Speculative decoding's serving figures: each workload with speculation and without, in one run.

``localllm bench MODEL --workload edit|summarize|open [--concurrency 1,8]`` runs the workload's
requests on a fresh engine with speculation off, then on (the order alternating by round, ``ROUNDS``
rounds, so that the machine's drift falls on both alike), and reports per concurrency level the
median throughput of each and their ratio, drafted and accepted tokens, the acceptance rate, the
mean accepted length per verify step, and what the engine measured a decode step to cost by its
number of query rows (a verify step of k drafts has k more rows than the sequences in it). What
limits the gain is reported too: from the replies generated with speculation off, the fewest decode
steps any lookup of this engine's kind could take (:func:`lookup_steps`), and the throughput that
would give if a verify step cost what a one-token step costs.
``--workload agent --speculate compare`` does the same for the agent workload's turns.

Workloads (chat-templated prompts, greedy, end-of-sequence ignored, ``gen_tokens`` per request):

* ``edit``: a source file of about ``EDIT_TOKENS`` tokens (localllm's own modules, a different one
  per stream), asked back whole with one change: a reply that mostly copies its prompt.
* ``summarize``: an article of about ``SUMMARY_TOKENS`` tokens (slices of the evaluation text),
  asked for a summary that quotes it.
* ``open``: the uniform workload's free text: a slice of the evaluation text, continued.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localllm.bench.settings import Log
from localllm.bench.workloads import (
    AGENT_HISTORY,
    AGENT_REPLY,
    AGENT_TOOL,
    AGENT_TURNS,
    Request,
    ServingSettings,
    TextSlicer,
    agent_requests,
    drive,
    kv_bytes,
    make_engine,
)
from localllm.runtime.speculate import MAX_DRAFT, MIN_NGRAM

if TYPE_CHECKING:
    from localllm.runtime.model import Transformer
    from localllm.runtime.tokenizer import Tokenizer

ROUNDS = 3
EDIT_TOKENS = 1000
SUMMARY_TOKENS = 1500
SPEC_WORKLOADS = ("edit", "summarize", "open")
#: The source files the edit workload sends: modules of this installation.
SOURCES = ["scheduler", "block_manager", "paged", "kv_pool", "textstream", "sampling", "speculate", "cache"]

NOTES = {
    "edit": f"N streams, each a ~{EDIT_TOKENS}-token source file asked back whole with one change",
    "summarize": f"N streams, each a ~{SUMMARY_TOKENS}-token article asked for a summary that quotes it",
    "open": "N streams continuing free text (the uniform workload's prompts)",
    "agent": "the agent workload's turns",
}


def _clip(tokenizer: Tokenizer, text: str, tokens: int) -> str:
    """``text`` cut at a line end to about ``tokens`` tokens."""
    ids = tokenizer.encode(text)
    if len(ids) <= tokens:
        return text
    cut = tokenizer.decode(ids[:tokens])
    return cut[: cut.rfind("\n") + 1] or cut


def edit_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    from localllm.runtime.chat import encode_chat

    out = []
    for i in range(n):
        spec = importlib.util.find_spec(f"localllm.runtime.{SOURCES[i % len(SOURCES)]}")
        assert spec is not None and spec.origin is not None
        source = _clip(tokenizer, Path(spec.origin).read_text(encoding="utf-8"), EDIT_TOKENS)
        ask = ("Here is a Python file:\n\n```python\n" + source + "```\n\nReturn the whole file unchanged, except "
               "that the `from __future__ import annotations` line is removed. Write only the code.")
        out.append(encode_chat(tokenizer, [{"role": "user", "content": ask}]))
    return out


def summary_prompts(tokenizer: Tokenizer, text: TextSlicer, n: int) -> list[list[int]]:
    from localllm.runtime.chat import encode_chat

    out = []
    for _ in range(n):
        article = tokenizer.decode(text.take(SUMMARY_TOKENS))
        ask = ("Summarize the following article in a few paragraphs, quoting its most important sentences "
               "word for word.\n\n" + article)
        out.append(encode_chat(tokenizer, [{"role": "user", "content": ask}]))
    return out


def _requests(workload: str, tokenizer: Tokenizer | None, text: TextSlicer, level: int, gen_tokens: int,
              prompt_tokens: int) -> list[Request]:
    """``level`` requests of ``workload`` (``tokenizer``: the edit and summarize workloads encode text)."""
    if workload in ("edit", "summarize"):
        assert tokenizer is not None, f"the {workload} workload encodes text: it needs the model's tokenizer"
        prompts = edit_prompts(tokenizer, level) if workload == "edit" else summary_prompts(tokenizer, text, level)
    else:
        prompts = [text.take(prompt_tokens) for _ in range(level)]
    return [Request(p, gen_tokens) for p in prompts]


def lookup_steps(prompt: Sequence[int], reply: Sequence[int], max_draft: int = MAX_DRAFT) -> int:
    """The fewest decode steps in which ``reply`` (its first token from the prefill) could follow
    ``prompt`` had every step's draft come from the text so far: after ``reply[:p]``, a step keeps at
    most the longest run of the next reply tokens that follows some earlier occurrence of the last
    ``MIN_NGRAM`` tokens (at most ``max_draft``), plus one token of its own, and may keep fewer (a
    shorter draft). The engine's proposals (the latest occurrence of the longest matching suffix) are
    among those occurrences, so its decode steps on the same reply are at least this many."""
    text = [*prompt, *reply]
    followers: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of the tokens that followed it
    indexed = MIN_NGRAM - 1  # n-grams ending before text[indexed] are in followers
    reach = [1] * len(reply)  # reach[p]: the most reply tokens one step after reply[:p] can add
    for p in range(1, len(reply)):
        held = len(prompt) + p  # the sequence holds text[:held]
        for end in range(indexed, held - 1):  # the n-gram ending at the last token has no follower yet
            followers.setdefault(tuple(text[end + 1 - MIN_NGRAM : end + 1]), []).append(end + 1)
        indexed = max(indexed, held - 1)
        for j in followers.get(tuple(text[held - MIN_NGRAM : held]), ()) if held >= MIN_NGRAM else ():
            n = 0
            while n < max_draft and j + n < held and p + n < len(reply) and text[j + n] == reply[p + n]:
                n += 1
            reach[p] = max(reach[p], n + 1)
    # fewest[p]: steps from reply[:p] to the whole reply, each step adding 1 .. reach[p] tokens
    fewest = [0] * (len(reply) + 1)
    for p in range(len(reply) - 1, 0, -1):
        fewest[p] = 1 + min(fewest[p + 1 : min(len(reply), p + reach[p]) + 1])
    return fewest[1] if len(reply) > 1 else 0


def lookup_figures(requests: Sequence[Request], figures: dict[str, Any]) -> dict[str, Any]:
    """What bounds speculation's gain on a run made without it (``drive``'s figures of ``requests``):
    its replies' decode tokens per step under :func:`lookup_steps` (a stream's decode rate could rise
    at most that much), and the throughput ratio were every decode step that much fewer and a verify
    step as cheap as a one-token step (the steps that carried prompt tokens as they were)."""
    tokens = sum(max(0, len(r.tokens) - 1) for r in requests)
    steps = sum(lookup_steps(r.prompt, r.tokens) for r in requests)
    per_step = tokens / steps if steps else 1.0
    wall, decode = figures["wall_s"], figures["decode_steps_s"]
    saved = decode * (1 - 1 / per_step)
    return {"lookup_decode_steps": steps, "lookup_tokens_per_step": per_step,
            "lookup_throughput_bound": wall / (wall - saved) if wall > saved else None}


def speculation_row(off: Sequence[dict[str, Any]], on: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One level's comparison from its rounds' figures (``drive``'s), speculation off and on."""
    last = on[-1]
    drafted = sum(r["drafted_tokens"] for r in on)
    accepted = sum(r["accepted_tokens"] for r in on)
    steps = sum(r["draft_steps"] for r in on)
    return {
        "off_tok_s": statistics.median(r["throughput_tok_s"] for r in off),
        "on_tok_s": statistics.median(r["throughput_tok_s"] for r in on),
        # per round, on over off: the ratio of runs made next to each other
        "on_over_off": statistics.median(b["throughput_tok_s"] / a["throughput_tok_s"] for a, b in zip(off, on)),
        # a stream's decode rate (first token to last): what speculation changes, prefill left out
        "off_stream_decode_tok_s": statistics.median(r["stream_decode_tok_s"] for r in off),
        "on_stream_decode_tok_s": statistics.median(r["stream_decode_tok_s"] for r in on),
        "stream_decode_on_over_off": statistics.median(b["stream_decode_tok_s"] / a["stream_decode_tok_s"]
                                                       for a, b in zip(off, on)),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted": accepted / steps if steps else None,
        "verify_steps": steps,
        # from the runs without speculation: what no lookup of this kind could beat (lookup_figures)
        "lookup_decode_steps": off[-1]["lookup_decode_steps"],
        "lookup_tokens_per_step": off[-1]["lookup_tokens_per_step"],
        "lookup_throughput_bound": statistics.median(r["lookup_throughput_bound"] or 1.0 for r in off),
        "step_ms_by_rows_on": last["step_ms_by_rows"],
        "step_ms_by_rows_off": off[-1]["step_ms_by_rows"],
    }


def compare(levels: Sequence[int], run_level: Callable[[int, bool], dict[str, Any]], log: Log,
            label: str) -> list[dict[str, Any]]:
    """Each level ``ROUNDS`` times with speculation off and on, alternating which goes first."""
    rows = []
    for level in levels:
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for rnd in range(ROUNDS):
            for speculate in ((False, True) if rnd % 2 == 0 else (True, False)):
                runs[speculate].append(run_level(level, speculate))
        row = {"level": level, **runs[True][-1], "speculation": speculation_row(runs[False], runs[True])}
        sp = row["speculation"]
        log(f"  {label} c={level}: {sp['off_tok_s']:.1f} tok/s off, {sp['on_tok_s']:.1f} on ({sp['on_over_off']:.2f}x); "
            f"a stream decodes {sp['off_stream_decode_tok_s']:.1f} -> {sp['on_stream_decode_tok_s']:.1f} tok/s "
            f"({sp['stream_decode_on_over_off']:.2f}x); "
            f"{sp['accepted_tokens']} of {sp['drafted_tokens']} drafts accepted; the best lookup: "
            f"{sp['lookup_tokens_per_step']:.2f} tokens a decode step, throughput at most "
            f"{sp['lookup_throughput_bound']:.2f}x")
        rows.append(row)
    return rows


def speculative(model: Transformer, tokenizer: Tokenizer | None, s: ServingSettings, text: TextSlicer,
                log: Log) -> dict[str, Any]:
    """``--workload edit|summarize|open``: every level with speculation off and on."""
    def run_level(level: int, speculate: bool) -> dict[str, Any]:
        start = text.offset
        requests = _requests(s.workload, tokenizer, text, level, s.gen_tokens, s.prompt_tokens)
        text.offset = start  # the same prompts both ways and every round
        engine = make_engine(model, replace(s, speculate=speculate), level)
        figures = drive(engine, requests)
        return figures if speculate else {**figures, **lookup_figures(requests, figures)}

    return _result(compare(s.levels, run_level, log, s.workload))


def agent_compare(model: Transformer, s: ServingSettings, text: TextSlicer, log: Log) -> dict[str, Any]:
    """``--workload agent --speculate compare``: the agents' turns with speculation off and on (prefix
    cache on, the pool sized as the agent workload sizes it)."""
    longest = AGENT_HISTORY + AGENT_TURNS * (AGENT_TOOL + AGENT_REPLY)

    def run_level(level: int, speculate: bool) -> dict[str, Any]:
        start = text.offset
        sized = replace(s, speculate=speculate, kv_budget_bytes=s.kv_budget_bytes or kv_bytes(
            model, level * (longest + AGENT_TOOL), s.kv_dtype))
        requests = agent_requests(text, level)
        figures = drive(make_engine(model, sized, level), requests)
        text.offset = start
        return figures if speculate else {**figures, **lookup_figures(requests, figures)}

    return _result(compare(s.levels, run_level, log, "agent"))


def _result(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"concurrency": rows, "comparison": {"on_over_off": {str(r["level"]): r["speculation"]["on_over_off"]
                                                                for r in rows}}}
