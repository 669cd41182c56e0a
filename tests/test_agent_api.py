"""Agents' API features on the tiny random-weight llama served on 127.0.0.1, through the ``openai``,
``anthropic`` and ``ollama`` clients: thinking and tool calls with a Qwen3-style chat template written
here (``<think>`` blocks, ``tools`` in the system turn, ``<tool_call>`` blocks, ``enable_thinking``; a
reply's thinking is split off into ``reasoning_content`` / ``thinking`` / thinking blocks / reasoning
items, a thinking budget holds the block, and a format or tool grammar holds only the answer after
it); embeddings, equal to transformers' pooled hidden states."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import llguidance
import pytest

from localllm.runtime.constrain import Constraints, Grammar, after_thinking, json_schema
from localllm.runtime.tools import CallSyntax, ReplySplitter, Tool, call_grammar
from localllm.server.config import ServerConfig
from localllm.server.replies import ReplyShape
from tests.server_fixtures import ServerThread, running_server

QWEN3_STYLE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "ok": {"type": "boolean"}},
         "required": ["x", "ok"], "additionalProperties": False}
MOVE = {"type": "function", "function": {"name": "move", "description": "Move to a point",
                                         "parameters": POINT}}


@pytest.fixture(scope="module")
def thinker(tiny_folder, tmp_path_factory) -> Path:
    """The tiny llama's folder, its tokenizer_config.json carrying the Qwen3-style template (and its
    context widened: random weights care for no trained length)."""
    _, folder = tiny_folder("llama")
    own = tmp_path_factory.mktemp("thinker") / "thinker"
    shutil.copytree(folder, own)
    config = json.loads((own / "tokenizer_config.json").read_text())
    (own / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_STYLE}))
    model = json.loads((own / "config.json").read_text())  # room for the tools' JSON, a byte a token
    (own / "config.json").write_text(json.dumps({**model, "max_position_embeddings": 1024}))
    return own


@pytest.fixture(scope="module")
def opener(thinker: Path, tmp_path_factory) -> Path:
    """The thinker with a template that opens the block itself (as Qwen3's thinking-only models do):
    every reply starts inside ``<think>``."""
    own = tmp_path_factory.mktemp("opener") / "opener"
    shutil.copytree(thinker, own)
    config = json.loads((own / "tokenizer_config.json").read_text())
    template = QWEN3_STYLE.replace("<think>\n\n</think>\n\n{% endif %}", "<think>\n\n</think>\n\n{% else %}<think>\n"
                                   "{% endif %}")
    assert template != QWEN3_STYLE
    (own / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return own


@pytest.fixture(scope="module")
def server(thinker: Path, tmp_path_factory) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("thinker-home")))
        with running_server(ServerConfig(parallel=2, kv_memory=16 << 20, quant="fp32", device="cpu",
                                         allow_local_paths=True)) as srv:
            yield srv


def test_tool_calls_and_formats_with_thinking_off(server: ServerThread, thinker: Path) -> None:
    """Thinking off (reasoning_effort "none", think false): the template writes the empty block itself,
    so the grammar holds the whole reply: a forced call of the template's own syntax, streamed and
    assembled by the openai client, arguments valid; and Ollama's format, valid."""
    openai = pytest.importorskip("openai")
    ollama = pytest.importorskip("ollama")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    for seed in range(3):
        with client.chat.completions.stream(model=str(thinker), messages=[{"role": "user", "content": "go"}],
                                            tools=[MOVE], tool_choice="required", parallel_tool_calls=False,
                                            reasoning_effort="none", temperature=1.0, seed=seed,
                                            max_tokens=150) as stream:
            final = stream.get_final_completion()
        (call,) = final.choices[0].message.tool_calls
        assert call.function.name == "move" and final.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), POINT)
    reply = ollama.Client(host=server.url).chat(model=str(thinker), messages=[{"role": "user", "content": "go"}],
                                                format=POINT, think=False,
                                                options={"temperature": 1.0, "seed": 4, "num_predict": 150})
    jsonschema.validate(json.loads(reply.message.content), POINT)
    assert not reply.message.thinking


def test_anthropic_thinking_within_its_budget(server: ServerThread, thinker: Path) -> None:
    """``thinking.budget_tokens`` through the ``anthropic`` client: the reply opens a thinking block
    (the budget's grammar requires one), closes it within the budget, and comes back as a thinking
    block before the answer, whole and streamed (thinking_delta events first)."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    ask = {"model": str(thinker), "max_tokens": 40, "messages": [{"role": "user", "content": "go"}],
           "thinking": {"type": "enabled", "budget_tokens": 6},
           "extra_body": {"temperature": 1.0}}  # the SDK's signature takes no sampling fields; the API does
    r = client.messages.create(**ask)
    assert r.content[0].type == "thinking" and r.content[0].thinking
    assert len(r.content[0].thinking) <= 6  # the thinker's tokens are bytes: at most a character each
    assert all(b.type == "text" for b in r.content[1:])
    with client.messages.stream(**ask) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds and kinds[0] == "thinking_delta" and "thinking_delta" not in kinds[kinds.index("thinking_delta")
                                                                                   + kinds.count("thinking_delta"):]
    assert final.content[0].type == "thinking"
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(**{**ask, "thinking": {"type": "enabled", "budget_tokens": 40}})


def test_responses_reasoning_items(server: ServerThread, opener: Path) -> None:
    """A reply inside a thinking block the prompt opened comes back as a ``reasoning`` item (its text,
    its tokens counted as reasoning), whole and streamed, through the ``openai`` client; effort
    "none" writes the empty block instead and gives no reasoning item."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    r = client.responses.create(model=str(opener), input="go", reasoning={"effort": "high"}, max_output_tokens=8,
                                temperature=1.0)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text
    if len(r.output) == 1:  # no "</think>" within 8 tokens: all of them thinking
        assert r.status == "incomplete" and r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens
    with client.responses.stream(model=str(opener), input="go", reasoning={"effort": "high"}, max_output_tokens=8,
                                 temperature=1.0) as stream:
        events = list(stream)  # get_final_response() wants response.completed; a cut one is incomplete
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and "response.reasoning_text.delta" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert events[-1].response.output[0].type == "reasoning"
    plain = client.responses.create(model=str(opener), input="go", reasoning={"effort": "none"}, max_output_tokens=4,
                                    temperature=1.0)
    assert all(item.type != "reasoning" for item in plain.output)
    assert plain.usage.output_tokens_details.reasoning_tokens == 0


def matches(grammar_text: str, text: str, lm_tokenizer) -> bool:
    vocab = Constraints(lm_tokenizer, lm_tokenizer.eos_ids)
    m = vocab.start(Grammar(grammar_text, "test"))._m  # noqa: SLF001
    ids = lm_tokenizer.encode(text, add_special=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def test_a_grammar_after_thinking_holds_the_answer_only(thinker: Path) -> None:
    from localllm.loaders.load import load_tokenizer, open_checkpoint

    tk = load_tokenizer(open_checkpoint(str(thinker)))
    point = after_thinking(json_schema(POINT), opened=False)
    assert matches(point.text, '<think>\nx < y </thin k>?\n</think>\n\n{"x": 3, "ok": true}', tk)
    assert matches(point.text, '{"x": 3, "ok": true}', tk)  # the block is optional
    assert not matches(point.text, '<think>plan</think> sure! {"x": 3, "ok": true}', tk)
    opened = after_thinking(json_schema(POINT), opened=True)  # the prompt ended in "<think>"
    assert matches(opened.text, 'plan</think>{"x": -2, "ok": false}', tk)
    calls = after_thinking(call_grammar(CallSyntax("hermes"), [Tool("move", "", POINT)], "required"), opened=False)
    assert matches(calls.text, '<think>a</think>\n<tool_call>{"name": "move", "arguments": {"x": 1, "ok": true}}'
                               '</tool_call>', tk)
    assert not matches(calls.text, "<think>a</think>\nno call", tk)
    assert llguidance.LLMatcher.validate_grammar_with_warnings(calls.text)[0] is False


def test_a_streamed_reply_splits_into_thinking_answer_and_calls_at_any_cut() -> None:
    reply = ('<think>\nweigh it\n</think>\n\n<tool_call>{"name": "move", "arguments": {"x": 1, "ok": true}}'
             '</tool_call>')
    for cut in range(0, len(reply) + 1, 7):
        shape = ReplyShape(thinks=True, calls=ReplySplitter(CallSyntax("hermes"), forced=False))
        parts = shape.feed(reply[:cut]) + shape.feed(reply[cut:])
        rest, calls = shape.finish()
        parts += rest
        assert "".join(t for k, t in parts if k == "thinking") == "\nweigh it\n"
        assert "".join(t for k, t in parts if k == "answer") == ""
        assert [(c.name, c.arguments) for c in calls] == [("move", {"x": 1, "ok": True})]
    text = ReplyShape(thinks=True).whole("<think>hm</think>\n\nHello")
    assert text[:2] == ("hm", "Hello")


def test_embeddings_are_the_models_pooled_hidden_states(tiny_folder, thinker: Path) -> None:
    """Last-token (the default) and mean pooling of inputs of different lengths in one padded batch:
    transformers' final hidden states, pooled and normalized; a folder's sentence-transformers config
    chooses the pooling."""
    import torch

    from localllm.loaders.load import load_model
    from localllm.runtime.embed import embed

    hf, folder = tiny_folder("llama")
    lm = load_model(str(folder), quant="fp32")
    inputs = [[1, 5, 9, 200], [1, 7], [1, 3, 3, 3, 3, 3, 8, 9, 10, 11, 250, 4]]
    for pooling in ("last", "mean"):
        got = embed(lm.model, inputs, pooling, batch_tokens=64)
        for i, ids in enumerate(inputs):
            with torch.no_grad():
                h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()  # (T, D), after the final norm
            want = torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0)
            assert torch.allclose(got[i], want, atol=1e-5), (pooling, i)
    assert lm.pooling == "last"
    (thinker / "modules.json").write_text(json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling",
                                                       "type": "sentence_transformers.models.Pooling"}]))
    (thinker / "1_Pooling").mkdir(exist_ok=True)
    (thinker / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    try:
        assert load_model(str(thinker), quant="fp32").pooling == "mean"
    finally:
        (thinker / "modules.json").unlink()


def test_embeddings_through_both_clients(server: ServerThread, thinker: Path) -> None:
    """OpenAI's (strings, token ids, base64, dimensions) and Ollama's (embed with truncate, the older
    embeddings): the same vectors for the same text; an input past the context is a 400 unless cut."""
    import base64
    import struct

    openai = pytest.importorskip("openai")
    ollama = pytest.importorskip("ollama")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    r = client.embeddings.create(model=str(thinker), input=["a cat", "a dog sat"])
    a, b = (d.embedding for d in r.data)
    assert len(a) == 64 and abs(sum(x * x for x in a) - 1) < 1e-4 and a != b
    assert r.usage.prompt_tokens == len("a cat") + len("a dog sat") + 2  # bytes, and a BOS each
    raw = client.embeddings.create(model=str(thinker), input="a cat", encoding_format="base64", dimensions=8)
    short = struct.unpack("<8f", base64.b64decode(raw.data[0].embedding)) if isinstance(raw.data[0].embedding, str) \
        else raw.data[0].embedding
    head = a[:8]
    norm = sum(x * x for x in head) ** 0.5
    assert [round(x, 4) for x in short] == [round(x / norm, 4) for x in head]
    o = ollama.Client(host=server.url)
    assert o.embed(model=str(thinker), input="a cat").embeddings[0] == pytest.approx(a, abs=1e-5)
    assert o.embeddings(model=str(thinker), prompt="a dog sat").embedding == pytest.approx(b, abs=1e-5)
    long = "x" * 1100  # past the 1024-token context
    assert len(o.embed(model=str(thinker), input=long).embeddings[0]) == 64  # truncated
    with pytest.raises(ollama.ResponseError, match="the context holds 1024"):
        o.embed(model=str(thinker), input=long, truncate=False)
    with pytest.raises(openai.BadRequestError, match="the context holds 1024"):
        client.embeddings.create(model=str(thinker), input=long)
