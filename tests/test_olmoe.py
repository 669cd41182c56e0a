"""OLMoE (transformers' ``OlmoeForCausalLM``, llama.cpp's ``olmoe``): a MoE like Qwen3-MoE's routing (a
softmax over all experts, then the top-k, renormalised by ``norm_topk_prob``; no shared expert) whose q
and k norms are one RMSNorm over the whole projection (q_dim and kv_dim wide), not one per head, and
whose ``clip_qkv`` clamps q, k and v. Tiny random models made by transformers, against its fp32 logits:
from HF safetensors and from a GGUF laid out as llama.cpp's converter writes it, prefill and cached
decode through the batch engine, and with int4 experts on the native expert kernel."""

from __future__ import annotations

import pytest
import torch

from localllm.loaders.checkpoint import HFCheckpoint
from localllm.loaders.gguf import GGUFCheckpoint
from localllm.loaders.load import load_model
from localllm.runtime.moe import MoE
from tests import test_gguf_moe
from tests.conftest import TINY, hf_folders
from tests.test_moe import _reference, _widen, assert_logits_match, tokens

ATOL = RTOL = 1e-4
#: 8 experts of 64 (every int4 group divides it), 2 active; kv heads fewer than query heads.
OLMOE = dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64, num_key_value_heads=2)


def olmoe_model(**overrides) -> torch.nn.Module:
    """A tiny random transformers OLMoE (fp32), weights wide enough for logits well away from zero."""
    import transformers

    torch.manual_seed(0)
    return _widen(transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**{**TINY, **OLMOE, **overrides})))


#: The variants the tests load: plain (the released models' settings), renormalised top-k with a
#: clip low enough to clamp some q/k/v values.
MAKERS = {"olmoe": olmoe_model, "olmoe-clip": lambda: olmoe_model(norm_topk_prob=True, clip_qkv=0.5)}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return hf_folders(MAKERS, "olmoe", tmp_path_factory)


def test_config_reads_olmoe_fields(family):
    c = HFCheckpoint(family("olmoe")[1]).config
    assert (c.arch, c.n_experts, c.n_active, c.expert_size) == ("olmoe", 8, 2, 64)
    assert c.qk_norm and c.qk_norm_full and c.clip_qkv is None and not c.norm_topk_prob
    assert c.shared_expert_size is None and c.moe_layers is None
    clip = HFCheckpoint(family("olmoe-clip")[1]).config
    assert clip.clip_qkv == 0.5 and clip.norm_topk_prob
    ref = family("olmoe")[0]
    assert c.num_parameters() == sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize("variant", list(MAKERS))
def test_logits_match_transformers(family, variant):
    ref, folder = family(variant)
    lm = load_model(str(folder), quant="fp32")
    assert all(isinstance(layer.mlp, MoE) for layer in lm.model.layers)
    assert lm.model.layers[0].attn.q_norm.weight.shape == (TINY["hidden_size"],)  # the whole projection
    assert_logits_match(ref, lm.model)


def test_the_clip_changes_the_logits(family):
    """The clip of the clipped variant does clamp: without it its logits differ from transformers'."""
    ref, folder = family("olmoe-clip")
    lm = load_model(str(folder), quant="fp32")
    for layer in lm.model.layers:
        layer.attn.clip_qkv = None
    ids = tokens(24)
    with torch.inference_mode():
        got = lm.model(ids)
    assert (got - _reference(ref, ids)).abs().max() > 1e-2


@pytest.mark.parametrize("variant", list(MAKERS))
def test_prefill_then_cached_decode_equals_transformers(family, variant):
    """Prefill in chunks of 13, then decode steps from the paged cache, against transformers' forward."""
    from localllm.runtime.batch import BatchEngine

    ref, folder = family(variant)
    lm = load_model(str(folder), quant="fp32")
    ids = tokens(30, seed=2)
    want = _reference(ref, ids)[0]
    engine = BatchEngine(lm.model, kv_budget_bytes=1 << 20, chunk_tokens=13, max_seq_len=30)
    got = engine.forced_logits(ids[0, :19].tolist(), ids[0, 19:].tolist())
    torch.testing.assert_close(got, want[18:], atol=ATOL, rtol=RTOL)


def _olmoe_gguf(monkeypatch, ref, path):
    """``ref`` written by the MoE GGUF tests' writer as llama.cpp's converter lays out an OLMoE: arch
    ``olmoe``, q/k unpermuted (NEOX rope), full-width ``attn_{q,k}_norm``, stacked experts. (The writer
    also writes the experts' size as ``expert_feed_forward_length``, which llama.cpp's OLMoE converter
    leaves to ``feed_forward_length``: the two are equal here.)"""
    monkeypatch.setitem(test_gguf_moe.GGUF_ARCH, "olmoe", "olmoe")
    ref.config.moe_intermediate_size = ref.config.intermediate_size
    return test_gguf_moe.write_moe_gguf(ref, path)


def test_f32_gguf_logits_equal_transformers(family, monkeypatch, tmp_path):
    ref = family("olmoe")[0]
    path = _olmoe_gguf(monkeypatch, ref, tmp_path / "olmoe.gguf")
    c = GGUFCheckpoint(path).config
    assert (c.arch, c.n_experts, c.n_active, c.expert_size) == ("olmoe", 8, 2, 64)
    assert c.qk_norm_full and not c.norm_topk_prob and c.n_kv_heads == 2
    lm = load_model(str(path), quant="fp32")
    ids = tokens(20)
    want = _reference(ref, ids)
    with torch.inference_mode():
        got = lm.model(ids)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    from localllm.runtime.batch import BatchEngine

    engine = BatchEngine(lm.model, kv_budget_bytes=1 << 20, chunk_tokens=7, max_seq_len=20)
    decoded = engine.forced_logits(ids[0, :12].tolist(), ids[0, 12:].tolist())
    torch.testing.assert_close(decoded, want[0, 11:], atol=ATOL, rtol=RTOL)


def test_gguf_without_expert_feed_forward_length_reads_feed_forward_length():
    """llama.cpp's OLMoE converter gives the experts' size only as ``feed_forward_length``."""
    from localllm.runtime.config import ModelConfig

    meta = {"general.architecture": "olmoe", "olmoe.block_count": 2, "olmoe.embedding_length": 64,
            "olmoe.attention.head_count": 4, "olmoe.attention.head_count_kv": 2, "olmoe.vocab_size": 384,
            "olmoe.feed_forward_length": 96, "olmoe.expert_count": 8, "olmoe.expert_used_count": 2}
    c = ModelConfig.from_gguf(meta, tie_embeddings=False)
    assert (c.arch, c.expert_size, c.norm_topk_prob, c.qk_norm_full) == ("olmoe", 96, False, True)


def test_int4_experts_run_on_the_native_kernel(family):
    """int4 experts (and linears), rounded to nearest while streaming, on the native expert kernel:
    logits close to fp32's."""
    from localllm.quant.expert_kernels import MoEBlocksCPU

    ref, folder = family("olmoe")
    lm = load_model(str(folder), quant="int4", dtype="fp32", check_kernels=True)
    experts = [layer.mlp.experts for layer in lm.model.layers]
    assert all(e.down.scheme.name == "int4" for e in experts)
    assert all(e.down.kernel is MoEBlocksCPU for e in experts), [e.down.kernel for e in experts]
    ids = tokens(24, seed=3)
    want = _reference(ref, ids)[0]
    with torch.inference_mode():
        got = lm.model(ids)[0]
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert 0 < kl < 0.03, kl


def test_pull_and_run_accept_olmoe(family, monkeypatch, tmp_path):
    """``pull`` stores an OLMoE folder (int4 experts, rounded to nearest) and its GGUF; ``run`` answers
    from both, and each stored int4 model stays close to transformers' fp32 logits."""
    from click.testing import CliRunner

    from localllm.cli import main

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOCALLLM_DEBUG", raising=False)
    ref, folder = family("olmoe")
    path = _olmoe_gguf(monkeypatch, ref, tmp_path / "tiny-olmoe.gguf")
    runner = CliRunner()
    for source, name in ((str(folder), "olmoe-hf"), (str(path), "olmoe-gguf")):
        pulled = runner.invoke(main, ["pull", source, "--name", name, "--calibration", "none"],
                               catch_exceptions=False)
        assert pulled.exit_code == 0, pulled.output
        ran = runner.invoke(main, ["run", name, "hi", "-n", "3", "--temperature", "0", "--raw"],
                            catch_exceptions=False)
        assert ran.exit_code == 0, ran.output
    ids = tokens(16, seed=6)
    want = _reference(ref, ids)[0]
    for name in ("olmoe-hf", "olmoe-gguf"):
        lm = load_model(name, dtype="fp32")  # from the store under LOCALLLM_HOME
        assert all(layer.mlp.experts.down.scheme.name == "int4" for layer in lm.model.layers)
        with torch.inference_mode():
            got = lm.model(ids)[0]
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                        reduction="batchmean")
        assert 0 < kl < 0.03, (name, kl)
