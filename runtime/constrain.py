"""Constrained decoding: a grammar decides which tokens may come next, step by step.

    grammar = json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    constraints = Constraints(tokenizer, vocab_size, stop_ids)   # one per model, shared by its requests
    handle = batch.submit(ids, params, max_tokens, stop_ids, constraint=constraints.start(grammar))

The grammar engine is llguidance: it reads a Hugging Face ``tokenizer.json`` as it is (byte-level BPE
and SentencePiece vocabularies alike, so GGUF vocabularies rebuilt by :mod:`runtime.tokenizer` work
too), enforces JSON Schema, Lark and regular expressions, computes a step's mask from a token trie in
a fraction of a millisecond on the CPU, and needs no other package. (xgrammar requires transformers
and triton, which the runtime never imports; outlines-core builds an index over the whole vocabulary
for each schema before the first token, where llguidance walks the token trie lazily each step and
agents may send a new schema any turn.)

A :class:`Constraint` is one sequence's matcher. The batch engine asks it for a bitmask of allowed
tokens for each of the sequence's rows in a step (a verify chunk has one per draft token: the mask
after each draft), masks those rows' logits to -inf outside it before sampling, and feeds it every
token it keeps. A grammar that is complete (nothing may follow) ends the sequence with
``finish_reason == "stop"``; only the end token is allowed once the reply could end, so a model that
keeps going is cut by ``max_tokens`` (``"length"``).

Compiling a grammar (building its lexer against the vocabulary) happens once per grammar text and
model: :class:`Constraints` keeps compiled matchers by content and copies one per request, since an
agent sends the same schema every turn.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import torch

from localllm import native
from localllm.errors import LocalLLMError
from localllm.runtime.tokenizer import Tokenizer

#: The CPU kernel that applies a step's masks (:func:`apply_masks`).
LIBRARY = native.NativeLibrary(
    "localllm_token_mask", (Path(__file__).resolve().parent / "csrc" / "token_mask.cpp",), ("apply_token_bitmask_",))

#: Whitespace allowed between JSON tokens: a space, or a line break and an indent (as models
#: pretty-print). Bounded, so that no model, random weights included, can fill a reply with it.
JSON_WHITESPACE = r"(?:\x20?|\x0A[\x20\x09]{0,24})"
#: float32 -inf's bits (0xFF800000) as an int32.
_NEG_INF_BITS = np.int32(-8388608)
#: Compiled matchers kept per model (by grammar text).
CACHED_GRAMMARS = 64


@dataclass(frozen=True)
class Grammar:
    """What a constrained reply must match: llguidance's grammar text, and ``summary`` for messages.
    ``drafts``: whether speculation's drafts may be checked against it (masks computed over a draft,
    then rolled back): llguidance cannot roll back a grammar whose lexemes are bounded in tokens."""

    text: str
    summary: str
    drafts: bool = True


def json_schema(schema: Mapping[str, Any] | bool, where: str = "schema") -> Grammar:
    """A JSON value that validates against ``schema`` (a JSON Schema object). Raises LocalLLMError
    for a schema that is not valid JSON Schema or uses a keyword llguidance cannot enforce, naming
    the keyword and where it is (``where`` names the schema itself, as the caller's API spells it):
    such a schema is refused, never silently left unenforced."""
    if not isinstance(schema, (Mapping, bool)):
        raise LocalLLMError(f"{where} must be a JSON Schema object", 'give an object such as {"type": "object"}')
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(
            dict(schema) if isinstance(schema, Mapping) else schema, overrides={"whitespace_pattern": JSON_WHITESPACE})
    except ValueError as e:
        raise LocalLLMError(f"{where} is not a JSON object ({e})", "send the schema as a JSON object") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        raise LocalLLMError(_schema_problem(schema, messages[0] if messages else "invalid", where),
                            "use a schema within what localllm enforces (JSON Schema without not, if/then, "
                            "uniqueItems, contains and dependent keywords)")
    return Grammar(text, "a JSON schema")


def any_json_object() -> Grammar:
    """Any JSON object (Ollama's ``format: "json"``, OpenAI's ``json_object``)."""
    return json_schema({"type": "object"})


def _schema_problem(schema: Any, message: str, where: str) -> str:
    """llguidance's message with the JSON path of the keyword it names (its messages name none)."""
    keys = re.match(r"Unimplemented keys: \[(.*)\]", message)
    if keys:
        names = [json.loads(k) for k in re.findall(r'"(?:[^"\\]|\\.)*"', keys.group(1))]
        path = _find_key(schema, set(names), where)
        return f"{path or where} uses {', '.join(repr(n) for n in names)}, which localllm cannot enforce"
    bad_type = re.match(r"Invalid type: (.*)", message)
    if bad_type:
        path = _find_value(schema, "type", bad_type.group(1), where)
        return f"{path or where}.type is {bad_type.group(1)!r}, not a JSON Schema type"
    return f"{where} is not a schema localllm can enforce: {message}"


def _walk(node: Any, path: str):
    yield node, path
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def _find_key(schema: Any, names: set[str], where: str) -> str | None:
    for node, path in _walk(schema, where):
        if isinstance(node, Mapping) and names & set(node):
            return path
    return None


def _find_value(schema: Any, key: str, value: str, where: str) -> str | None:
    for node, path in _walk(schema, where):
        if isinstance(node, Mapping) and str(node.get(key)) == value:
            return path
    return None


#: A reply's text, unconstrained: the answer a thinking budget (:func:`after_thinking`) holds nothing of.
FREE_TEXT = Grammar("start: /(.|\\n)*/\n", "text")


def harmony_final(grammar: Grammar) -> Grammar:
    """``grammar`` as the text of harmony's final message (gpt-oss: ``<|channel|>final<|message|>``
    before it), for :func:`after_thinking` with ``harmony``."""
    text = grammar.text
    inner = json.loads(text) if text.lstrip().startswith("{") else {"grammars": [{"lark_grammar": text}]}
    body = {**inner["grammars"][0], "name": "final_text"}
    head = {"lark_grammar": 'start: <|channel|> "final" <|message|> @final_text\n'}
    return Grammar(json.dumps({**inner, "grammars": [head, body, *inner["grammars"][1:]]}), grammar.summary,
                   grammar.drafts)


def after_thinking(grammar: Grammar, opened: bool, budget: int | None = None, harmony: bool = False) -> Grammar:
    """``grammar`` held to the answer only: a thinking block (``<think>…</think>``, as Qwen3 and
    DeepSeek-R1 write it) may come first, free, then the answer must match. ``opened``: the prompt
    already opened the block (the reply starts inside it, and must close it).

    ``budget``: the block is required and closed after that many tokens at most (``</think>`` is then
    the only token allowed). llguidance's lexer does not backtrack, so a bounded block cannot hold
    ``<`` (or it could not tell the closing tag from thinking text).

    ``harmony`` (gpt-oss): the thinking is a message on the analysis channel, ended by ``<|end|>`` (a
    special token, which thinking text cannot hold), and ``grammar`` holds the messages after it
    with their headers (:func:`harmony_final`, or the tools' call grammar)."""
    text = grammar.text  # llguidance's JSON form, or a Lark grammar as it is
    inner = json.loads(text) if text.lstrip().startswith("{") else {"grammars": [{"lark_grammar": text}]}
    answer = {**inner["grammars"][0], "name": "answer"}
    if harmony:
        bound = "" if budget is None else f"[max_tokens={budget}]"
        block = '<|channel|> "analysis" <|message|> thought <|end|> <|start|> "assistant"'
        start = f"start: {block} @answer\n" if budget is not None else f"start: ({block})? @answer\n"
        wrapped = {**inner, "grammars": [{"lark_grammar": f"{start}thought{bound}: /(.|\\n)*/\n"}, answer,
                                         *inner["grammars"][1:]]}
        return Grammar(json.dumps(wrapped), grammar.summary, drafts=budget is None and grammar.drafts)
    if budget is not None:
        thought = f'thought[max_tokens={budget}]: /[^<]*/\nWS: /[ \\t\\n]+/\n'
        start = ('start: thought "</think>" WS? @answer\n' if opened
                 else 'start: "<think>" thought "</think>" WS? @answer\n')
        wrapped = {**inner, "grammars": [{"lark_grammar": start + thought}, answer, *inner["grammars"][1:]]}
        return Grammar(json.dumps(wrapped), grammar.summary, drafts=False)  # max_tokens: no rollback
    thought = 'thought[lazy]: /(.|\\n)*<\\/think>/\nWS: /[ \\t\\n]+/\n'
    start = "start: thought WS? @answer\n" if opened else 'start: ("<think>" thought WS?)? @answer\n'
    wrapped = {**inner, "grammars": [{"lark_grammar": start + thought}, answer, *inner["grammars"][1:]]}
    return Grammar(json.dumps(wrapped), grammar.summary)


def _reason(error: str | None) -> str:
    """llguidance's error, its first line only: the rest dumps the parser's state and the whole grammar
    (the client's schema), which neither a client nor the server's log should get back."""
    line = (error or "").strip().split("\n", 1)[0].split("<state>", 1)[0].strip()
    return line or "the grammar cannot continue"


class Constraint:
    """One sequence's grammar state (an llguidance matcher): its masks, and the tokens it has taken."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_words: int, stop_ids: Sequence[int] = (),
                 drafts: bool = True) -> None:
        self._m = matcher
        self._drafts = drafts  # see Grammar.drafts
        self.words = vocab_words  # int32 words of one mask row: ceil(tokenizer vocabulary / 32)
        #: (word, bit mask) of each stop id: cleared from a row where the reply cannot end yet (a stop
        #: token whose text is ordinary bytes, "</s>" in a plain vocabulary, would pass inside a string)
        self._stops = [(i // 32, 1 << (i % 32)) for i in stop_ids if i < 32 * vocab_words]

    @property
    def done(self) -> bool:
        """Nothing but the end may follow: the reply is complete."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def error(self) -> str | None:
        """Why the grammar can go no further (a token it refused, a limit hit); None while it can."""
        return _reason(self._m.get_error()) if self._m.is_error() else None

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar would take next, in order (drafts are cut there); none
        where the grammar cannot check drafts (:attr:`Grammar.drafts`)."""
        return self._m.validate_tokens(list(tokens)) if tokens and self._drafts else 0

    def fill(self, out: torch.Tensor, draft: Sequence[int]) -> None:
        """Write the allowed-token bitmask of each row into ``out`` (1 + len(draft), words) int32 (CPU,
        contiguous): row j is the mask after ``draft[:j]`` (drafts must be valid: :meth:`valid_prefix`).
        The state is as before when it returns."""
        for j in range(len(draft) + 1):
            row = out[j]
            self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if self._stops and not self._m.is_accepting():
                words = row.numpy().view("uint32")
                for w, bit in self._stops:
                    words[w] &= ~bit & 0xFFFFFFFF
            if j < len(draft):
                self._m.consume_token(draft[j])
        if draft:
            self._m.rollback(len(draft))

    def take(self, token: int) -> bool:
        """Advance over a kept token; False when the grammar refused it (then :attr:`error` says why)."""
        return self._m.consume_token(token)


class Constraints:
    """A model's vocabulary as llguidance reads it (built at the first constrained request: a large
    vocabulary takes a second or two), and its compiled grammars by content. Also each token's own
    bytes (:meth:`token_bytes`: log-probability entries show them)."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._stop_ids = [int(i) for i in stop_ids]
        self._vocab: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the compiled grammars' cache
        self._vocab_lock = threading.Lock()
        self.compiled_grammars = 0  # grammars compiled (not served from the cache), for figures

    def _vocabulary(self) -> llguidance.LLTokenizer:
        vocab = self._vocab
        if vocab is not None:  # built: read without the lock (a stream's every chunk asks)
            return vocab
        with self._vocab_lock:  # one build, whoever asks first
            if self._vocab is None:
                tk = self._tokenizer
                try:
                    self._vocab = llguidance.LLTokenizer(tk.backend.to_str(), n_vocab=tk.vocab_size,
                                                         eos_token=self._stop_ids or None)
                except (ValueError, RuntimeError) as e:
                    raise LocalLLMError(f"the grammar engine cannot read this model's tokenizer ({e})",
                                        "use a model with a Hugging Face tokenizer.json or a GGUF vocabulary") from None
            return self._vocab

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (half a UTF-8 character, for some; a special token's name)."""
        return self._vocabulary().decode_bytes([token_id])

    def start(self, grammar: Grammar) -> Constraint:
        """A fresh constraint for one sequence (compiling ``grammar`` against the vocabulary the first
        time it is seen). Raises LocalLLMError when it does not compile against this vocabulary.
        Compiling runs outside the cache's lock: one schema's compile never holds up another's."""
        vocab = self._vocabulary()
        with self._lock:
            template = self._compiled.get(grammar.text)
            if template is not None:
                self._compiled.move_to_end(grammar.text)
                matcher = template.deep_copy()
        if template is None:
            template = llguidance.LLMatcher(vocab, grammar.text, log_level=0)
            if not template.is_error():  # a schema that admits no value ({"$ref": "#"}) fails its first mask
                template.compute_bitmask()
            if template.is_error():
                raise LocalLLMError(f"{grammar.summary} admits no reply (llguidance: {_reason(template.get_error())})",
                                    "check the schema's $ref cycles and that some value satisfies it")
            matcher = template.deep_copy()
            with self._lock:
                self.compiled_grammars += 1
                self._compiled[grammar.text] = template
                if len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return Constraint(matcher, (vocab.vocab_size + 31) // 32, self._stop_ids, grammar.drafts)


def apply_masks(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """Set every token of ``logits`` (n, V) outside ``bits`` (n, words) int32 (CPU), one bit per token
    id (the tokenizer's ids; ids past ``32 * words`` are never allowed), to -inf, in place.

    On the CPU localllm's kernel does it in one pass that skips whole words (``csrc/token_mask.cpp``);
    without it numpy adds a bias of 0 or -inf built from the bits with integer ops (branch-free: a
    select by a mask whose bits look random to the branch predictor costs several times more)."""
    n, vocab = logits.shape
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        if native.available(LIBRARY):
            torch.ops.localllm.apply_token_bitmask_(logits, bits)
            return
        allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=-1, count=vocab, bitorder="little")  # (n, <=V) 0/1
        bias = ((allowed.astype(np.int32) - 1) & _NEG_INF_BITS).view(np.float32)  # 1 -> +0.0, 0 -> -inf
        rows = logits.numpy()
        words = allowed.shape[1]
        rows[:, :words] += bias
        rows[:, words:] = -np.inf
        return
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = bits.to(logits.device, non_blocking=True)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(n, -1).bool()  # (n, 32 * words)
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.cat([allowed, allowed.new_zeros(n, vocab - allowed.shape[1])], dim=1)
    logits.masked_fill_(~allowed, float("-inf"))
