"""Constrained decoding in the batch engine (runtime.constrain), on the tiny random-weight llama and its
byte-level tokenizer: every reply to a schema parses and validates (the grammar guarantees it, so it is
asserted over many seeds), batched in the same steps as free requests and through speculative
verification, with the same tokens either way; a complete grammar ends the reply ("stop"), max_tokens
cuts it ("length"); schemas are compiled once per content; schemas the grammar engine cannot enforce
are refused with the keyword's path.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.runtime.batch import BatchEngine
from localllm.runtime.constrain import Constraints, any_json_object, apply_masks, json_schema
from localllm.runtime.sampling import SamplingParams
from tests.test_batch import BIG, GREEDY, prompt
from tests.test_speculate import Flat

#: Bounded everywhere (enums, maxLength, maxItems, integer ranges): a random model finishes it well
#: within max_tokens, so every reply can be checked whole.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def constraints(tiny_fp32):
    return Constraints(tiny_fp32.tokenizer, tiny_fp32.tokenizer.eos_ids)


def replies(eng: BatchEngine, lm, handles) -> list[str]:
    eng.run_until_done()
    return [lm.tokenizer.decode(h.result()) for h in handles]


def test_every_reply_validates_batched_with_free_requests(tiny_fp32, constraints):
    """Twelve seeded schema requests and two free ones in the same steps: each constrained reply is
    complete ("stop") and valid; the free ones are their tokens without any constraint beside them;
    every block is back."""
    grammar = json_schema(PERSON)
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=16, speculate=False)
    free = [prompt(7, 9), prompt(8, 20)]
    want_free = [BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, speculate=False).submit(p, GREEDY, 30).result()
                 for p in free]
    handles = [eng.submit(prompt(s, 5 + s), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=s), 400,
                          tiny_fp32.tokenizer.eos_ids, constraint=constraints.start(grammar)) for s in range(12)]
    free_handles = [eng.submit(p, GREEDY, 30) for p in free]
    texts = replies(eng, tiny_fp32, handles)
    for h, text in zip(handles, texts):
        assert h.stats.finish_reason == "stop", (text, h.stats.finish_reason)
        jsonschema.validate(json.loads(text), PERSON)
    assert [h.result() for h in free_handles] == want_free
    assert len({t for t in texts}) > 6  # sampled: the replies differ
    assert constraints.compiled_grammars == 1  # one schema, compiled once for twelve requests
    eng.blocks.check()
    assert eng.usage()["blocks_used"] == 0


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.3, top_k=0, top_p=1.0, seed=5)],
                         ids=["greedy", "seeded"])
def test_drafts_are_verified_under_the_mask(tiny_fp32, constraints, params):
    """Speculation on, drafting wherever the reply's own n-grams propose: verify rows are masked after
    each draft token, so the tokens are the tokens without speculation, and drafts were kept."""
    grammar = json_schema({"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": [12, 34]},
                                                                     "minItems": 4, "maxItems": 12}},
                           "required": ["xs"], "additionalProperties": False})
    prompts = [prompt(s, 6) for s in range(4)]
    plain = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, speculate=False)
    want = [plain.submit(p, params, 200, constraint=constraints.start(grammar)).result() for p in prompts]
    eng = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG)
    eng.costs = Flat()
    handles = [eng.submit(p, params, 200, constraint=constraints.start(grammar)) for p in prompts]
    eng.run_until_done()
    assert [h.result() for h in handles] == want
    assert eng.accepted_tokens > 0
    for h, tokens in zip(handles, want):
        assert h.stats.finish_reason == "stop"
        assert len(json.loads(tiny_fp32.tokenizer.decode(tokens))["xs"]) >= 4


def test_max_tokens_cuts_a_reply_with_length(tiny_fp32, constraints):
    h = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG).submit(
        prompt(3, 5), GREEDY, 4, constraint=constraints.start(json_schema(PERSON)))  # 4 bytes: '{"na' at most
    tokens = h.result()
    assert h.stats.finish_reason == "length" and len(tokens) == 4
    assert tiny_fp32.tokenizer.decode(tokens).startswith("{")
    free = any_json_object()
    h = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG).submit(prompt(3, 5), GREEDY, 100,
                                                                 constraint=constraints.start(free))
    assert h.stats.finish_reason is None and isinstance(json.loads(tiny_fp32.tokenizer.decode(h.result())), dict)
    assert h.stats.finish_reason == "stop"


def test_schemas_it_cannot_enforce_are_refused_with_the_keyword_and_its_path():
    nested = {"type": "object", "properties": {"tags": {"type": "array", "items": {"not": {"type": "null"}}}}}
    with pytest.raises(LocalLLMError, match=r"^format\.properties\.tags\.items uses 'not', which localllm cannot "
                                            r"enforce"):
        json_schema(nested, where="format")
    with pytest.raises(LocalLLMError, match=r"schema\.properties\.a\.type is 'strng', not a JSON Schema type"):
        json_schema({"type": "object", "properties": {"a": {"type": "strng"}}})
    with pytest.raises(LocalLLMError, match="uniqueItems"):
        json_schema({"type": "array", "uniqueItems": True})
    with pytest.raises(LocalLLMError, match="must be a JSON Schema object"):
        json_schema(["type", "object"])  # type: ignore[arg-type]


@pytest.mark.parametrize("vocab,words", [(49152, 1536), (49157, 1536), (49100, 1536), (300, 12)])
def test_the_mask_kernel_numpy_and_torch_paths_agree(vocab, words, monkeypatch):
    """Each path sets exactly the refused ids to -inf: whole words refused, allowed and mixed, and
    ids past the grammar's vocabulary (the model's rows can be wider than the tokenizer's)."""
    from localllm import native
    from localllm.runtime import constrain

    g = torch.Generator().manual_seed(vocab)
    kinds = torch.tensor([0, -1, 5, 123456, -7, 1 << 31 - 1], dtype=torch.int32)
    bits = kinds[torch.randint(0, len(kinds), (3, words), generator=g)]
    logits = torch.randn(3, vocab, generator=g)
    ids = torch.arange(vocab)
    allowed = (ids < 32 * words) & ((bits[:, (ids // 32).clamp(max=words - 1)] >> (ids % 32)) & 1).bool()
    want = logits.masked_fill(~allowed, float("-inf"))
    assert native.available(constrain.LIBRARY)
    got = logits.clone()
    apply_masks(got, bits)  # the kernel
    assert torch.equal(got, want)
    monkeypatch.setattr(native, "available", lambda lib, cache_dir=None: False)
    got = logits.clone()
    apply_masks(got, bits)  # numpy
    assert torch.equal(got, want)
    got = logits.clone().double()  # not float32: torch's ops
    apply_masks(got, bits)
    assert torch.equal(got, want.double())
