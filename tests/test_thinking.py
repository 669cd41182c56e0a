"""Thinking models (Qwen3's ``<think>`` block): the reply stream split into thinking and answer at any
piece boundary, ``run`` showing thinking on stderr (or not) and the answer alone on stdout, and
``--no-think`` reaching the template as ``enable_thinking``."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from localllm.commands.run import answer_only
from localllm.runtime.textstream import ThinkingSplitter

REPLY = "<think>\nThe user asks for a capital.\n</think>\n\nParis is the capital."
THINKING, ANSWER = "\nThe user asks for a capital.\n", "Paris is the capital."


def split(pieces: list[str], opened: bool = False) -> dict[str, str]:
    s = ThinkingSplitter(opened)
    out: dict[str, str] = {}
    for kind, text in [p for piece in pieces for p in s.feed(piece)] + s.flush():
        out[kind] = out.get(kind, "") + text
    return out


def test_every_two_cuts_of_a_reply_give_the_same_thinking_and_answer():
    for i in range(len(REPLY) + 1):
        for j in range(i, len(REPLY) + 1):
            assert split([REPLY[:i], REPLY[i:j], REPLY[j:]]) == {"thinking": THINKING, "answer": ANSWER}, (i, j)


@pytest.mark.parametrize("pieces,want", [
    (["Hello <think> there"], {"answer": "Hello <think> there"}),  # a tag inside the answer is text
    (["  ", "Hi"], {"answer": "  Hi"}),
    (["<thi"], {"answer": "<thi"}),  # a stream that ends on half a tag keeps it
    (["<think>\n\n</think>\n\n", "Answer"], {"thinking": "\n\n", "answer": "Answer"}),
    (["<think>unclosed"], {"thinking": "unclosed"}),
])
def test_edge_cases(pieces, want):
    assert split(pieces) == want


def test_a_block_the_prompt_opened_starts_in_thinking():
    assert split(["abc</thi", "nk>\n\nans"], opened=True) == {"thinking": "abc", "answer": "ans"}


def test_answer_only_routes_thinking_to_stderr_or_nowhere(capsys):
    pieces = [REPLY[:9], REPLY[9:40], REPLY[40:]]
    assert "".join(answer_only(iter(pieces), show_thinking=True)) == ANSWER
    err = capsys.readouterr().err
    assert err.startswith("Thinking...\n") and THINKING in err and "...done thinking." in err
    assert "".join(answer_only(iter(pieces), show_thinking=False)) == ANSWER
    assert capsys.readouterr().err == ""


TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")


@pytest.mark.parametrize("think,has_block", [(None, False), (True, False), (False, True)])
def test_think_reaches_the_template_as_enable_thinking(tiny_folder, think, has_block):
    from localllm.loaders.load import load_model
    from localllm.runtime.engine import Engine
    from localllm.runtime.sampling import SamplingParams

    lm = load_model(str(tiny_folder("llama")[1]), device="cpu", quant="fp32")
    lm.tokenizer.chat_template = TEMPLATE
    engine = Engine(lm.model, lm.tokenizer, 128)
    seen: list[list[int]] = []  # the prompt ids the chat template made
    run = engine.generate_ids
    engine.generate_ids = lambda ids, *args, **kw: (seen.append(list(ids)), run(ids, *args, **kw))[1]  # type: ignore[method-assign]
    list(engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0), 1, think=think))
    prompt = lm.tokenizer.decode(seen[0])
    assert prompt.removeprefix("<s>").startswith("<|user|>Hi\n<|assistant|>")  # BOS added by the tokenizer
    assert ("<think>\n\n</think>" in prompt) == has_block


def test_run_has_the_thinking_flags():
    from localllm.cli import main

    result = CliRunner().invoke(main, ["run", "--help"])
    assert "--think / --no-think" in result.output and "--hide-thinking" in result.output
