"""The families people download (Gemma 3, Qwen3, Phi-3): tiny random-weight models against transformers
(fp32), the batch engine's chunked prefill and decode against the full forward and in batches, and
GGUF files written from the same weights against the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.loaders.build import empty_model, fuse_projections, load_weights
from localllm.loaders.checkpoint import HFCheckpoint
from localllm.runtime.config import ModelConfig
from tests.conftest import TINY, hf_folders
from tests.engines import reference
from tests.test_gguf import add_model_shape

#: Logits tolerance against transformers (fp32): the tightest every family meets on any CPU.
ATOL = RTOL = 1e-4
WINDOW = 8  # sliding window of the tiny Gemma 3: shorter than the test sequences, so it cuts


def _widen(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights wide enough that logits are not near zero; norms (Gemma's start at 0) too."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08 if p.dim() == 2 else 0.1)
            if p.dim() == 1 and "norm" in name and "gemma" not in type(model).__name__.lower():
                p.add_(1.0)
    return model.eval()


def gemma3_model(**overrides):
    import transformers

    kw = {**TINY, "head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
          "num_hidden_layers": 4, "pad_token_id": 0,
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    kw.update(overrides)
    torch.manual_seed(0)
    return _widen(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kw)))


def qwen3_model(**overrides):
    import transformers

    kw = {**TINY, "head_dim": 24, **overrides}  # head_dim != hidden / heads: it must be read, not derived
    torch.manual_seed(0)
    return _widen(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw)))


def phi3_model(**overrides):
    import transformers

    kw = {**TINY, "max_position_embeddings": 128, "original_max_position_embeddings": 32,
          "pad_token_id": 0, "partial_rotary_factor": 0.75,
          "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                              "short_factor": [1.0 + 0.1 * i for i in range(6)],
                              "long_factor": [1.5 + 0.5 * i for i in range(6)],
                              "original_max_position_embeddings": 32}}
    kw.update(overrides)
    torch.manual_seed(0)
    return _widen(transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)))


MAKERS = {"gemma3": gemma3_model, "qwen3": qwen3_model, "phi3": phi3_model}
FAMILIES = list(MAKERS)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """arch -> (transformers model, its HF folder), made once per module."""
    return hf_folders(MAKERS, "fam", tmp_path_factory)


def ours_from(folder: Path, dtype: torch.dtype = torch.float32):
    ckpt = HFCheckpoint(folder)
    return load_weights(empty_model(ckpt.config), ckpt.iter_tensors(), torch.device("cpu"), dtype, str(folder))


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _reference(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids).logits


@pytest.mark.parametrize("arch", FAMILIES)
def test_logits_match_transformers(family, arch):
    ref, folder = family(arch)
    model = ours_from(folder)
    ids = tokens(24)  # past the Gemma window (8) and below Phi-3's original context (32)
    want = _reference(ref, ids)
    got = model(ids)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_config_fields_read(family):
    c = ours_from(family("gemma3")[1]).config
    assert c.arch == "gemma3" and c.layer_types == ["sliding", "full", "sliding", "sliding"]
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta) == (WINDOW, 100000.0, 10000.0)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}  # global layers only
    assert c.attn_scale == 24 ** -0.5 and c.embed_scale == 64 ** 0.5 and c.tie_embeddings
    q = ours_from(family("qwen3")[1]).config
    assert q.qk_norm and q.head_dim == 24 and not q.attention_bias and q.sliding_window is None
    p = ours_from(family("phi3")[1]).config
    assert p.rotary_dim == 12 and p.rope_scaling["rope_type"] == "longrope"


def test_phi3_long_factors_beyond_the_original_context(family):
    """Beyond original_max_position_embeddings longrope takes its long factors (transformers does the
    same for a sequence that long); the attention factor scales cos/sin either way."""
    ref, folder = family("phi3")
    model = ours_from(folder)
    ids = tokens(48, seed=9)
    torch.testing.assert_close(model(ids), _reference(ref, ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", FAMILIES)
def test_prefill_then_cached_decode_equals_full_forward(family, arch):
    """Prefill chunks of 13 (Gemma: past its window of 8 within a chunk), then decode steps through the
    paged kernel (each query's last 8 keys in the sliding layers), against one whole forward."""
    from localllm.runtime.batch import BatchEngine

    model = ours_from(family(arch)[1])
    ids = tokens(30, seed=2)
    full = model(ids)[0]
    # RoPE tables of 30 positions, as the full forward's (Phi-3's longrope picks its factors by length)
    engine = BatchEngine(model, kv_budget_bytes=1 << 20, chunk_tokens=13, max_seq_len=30)
    got = engine.forced_logits(ids[0, :19].tolist(), ids[0, 19:].tolist())  # chunks of 13 and 6, then 11 steps
    torch.testing.assert_close(got, full[18:], atol=1e-5, rtol=1e-5)


def test_gemma3_final_softcapping_matches_transformers(tmp_path):
    """Gemma 2 style soft-capping of the final logits (off in Gemma 3's checkpoints, kept as a path)."""
    ref = gemma3_model(final_logit_softcapping=3.0)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    model = ours_from(tmp_path)
    assert model.config.final_softcap == 3.0
    ids = tokens(20, seed=4)
    want = _reference(ref, ids)
    assert want.abs().max() < 3.0  # the cap bites
    torch.testing.assert_close(model(ids), want, atol=ATOL, rtol=RTOL)


def test_attention_softcapping_matches_gemma2s_attention():
    """Soft-capped attention scores (Gemma 2; transformers' Gemma 3 leaves the config's value unused,
    as llama.cpp does, so the model is given it directly) against transformers' Gemma 2 attention."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from localllm.runtime.attention import reference as attend

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, h, 10, 16, generator=g) * 2 for h in (4, 2, 2))
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    module = SimpleNamespace(head_dim=16, num_key_value_groups=2, training=False)
    additive = torch.zeros(10, 10).masked_fill(~causal, float("-inf"))[None, None]
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.2, softcap=1.5)  # (1, T, H, hd)
    got = attend(q, k, v, None, 0.2, 1.5).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (attend(q, k, v, None, 0.2, None).transpose(1, 2) - want).abs().max() > 1e-2  # the cap bites


@pytest.mark.parametrize("arch", FAMILIES)
def test_fused_projections_change_nothing(family, arch):
    folder = family(arch)[1]
    plain, fused = ours_from(folder), fuse_projections(ours_from(folder))
    ids = tokens(16, seed=7)
    torch.testing.assert_close(fused(ids), plain(ids), atol=1e-5, rtol=1e-5)


def test_multimodal_gemma3_checkpoint_runs_its_language_model(family, tmp_path):
    """A Gemma 3 checkpoint as the multimodal repos ship it: config under text_config, weights under a
    language-model prefix, a vision tower beside them (left out)."""
    from safetensors.torch import save_file

    ref, folder = family("gemma3")
    hf = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": hf}))
    sd = {f"language_model.{k}": v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    sd["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(4)
    save_file(sd, str(tmp_path / "model.safetensors"))
    ids = tokens(12, seed=5)
    torch.testing.assert_close(ours_from(tmp_path)(ids), _reference(ref, ids), atol=ATOL, rtol=RTOL)


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(LocalLLMError) as e:
        ModelConfig.from_hf({"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    assert "MambaForCausalLM" in str(e.value)
    for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"):
        assert arch in str(e.value)


# ------------------------------------------------------------------------------------------- GGUF
def write_gguf(ref, arch: str, path: Path) -> Path:
    """A GGUF of a transformers model laid out as llama.cpp's converter writes ``arch`` (F32 tensors):
    Gemma's norms stored as 1 + w, Phi-3's fused qkv and gate/up, its longrope factors as tensors."""
    import gguf

    c = ref.config
    sd = {k: v.detach().float().numpy() for k, v in ref.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    add_model_shape(w, c)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    norm = (lambda a: a + 1) if arch == "gemma3" else (lambda a: a)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        rot = int(hd * c.rope_parameters["partial_rotary_factor"])
        w.add_rope_dimension_count(rot)
        orig = c.rope_parameters["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(c.max_position_embeddings / orig) / np.log(orig))))
        w.add_tensor("rope_factors_long.weight", np.array(c.rope_parameters["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(c.rope_parameters["short_factor"], dtype=np.float32))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", norm(sd[p + "input_layernorm.weight"]))
        if arch == "phi3":
            w.add_tensor(b + "attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"])
            w.add_tensor(b + "ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"])
        else:
            for ours, hf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                w.add_tensor(b + f"attn_{ours}.weight", sd[p + f"self_attn.{hf}.weight"])
            w.add_tensor(b + "attn_q_norm.weight", norm(sd[p + "self_attn.q_norm.weight"]))
            w.add_tensor(b + "attn_k_norm.weight", norm(sd[p + "self_attn.k_norm.weight"]))
            w.add_tensor(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
            w.add_tensor(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
        if arch == "gemma3":
            w.add_tensor(b + "post_attention_norm.weight", norm(sd[p + "post_attention_layernorm.weight"]))
            w.add_tensor(b + "ffn_norm.weight", norm(sd[p + "pre_feedforward_layernorm.weight"]))
            w.add_tensor(b + "post_ffw_norm.weight", norm(sd[p + "post_feedforward_layernorm.weight"]))
        else:
            w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    w.add_tensor("output_norm.weight", norm(sd["model.norm.weight"]))
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_reference(arch: str):
    """The transformers model a GGUF of ``arch`` can describe: Gemma 3 with llama.cpp's fixed layer
    pattern (every sixth layer global), local base and head_dim-based attention scale."""
    if arch == "gemma3":
        return gemma3_model(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16)
    return MAKERS[arch]()


@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_of_the_same_weights_gives_the_same_logits(family, arch, tmp_path):
    from localllm.loaders.gguf import GGUFCheckpoint

    ref = family(arch)[0] if arch != "gemma3" else _gguf_reference(arch)
    ckpt = GGUFCheckpoint(write_gguf(ref, arch, tmp_path / f"{arch}.gguf"))
    c = ckpt.config
    assert c.arch == arch and c.qk_norm == (arch != "phi3")
    if arch == "gemma3":
        assert c.layer_types == ["sliding"] * 5 + ["full"] and c.rope_local_theta == 10000.0
    model = load_weights(empty_model(c), ckpt.iter_tensors(), torch.device("cpu"), torch.float32, arch)
    ids = tokens(24, seed=11)
    torch.testing.assert_close(model(ids), _reference(ref, ids), atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------ the batch engine
@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_gemma3_batches_like_alone(family, attention):
    """Gemma 3 in the paged engine: each layer with its own window and RoPE base, chunked prefill and
    decode past the window, against the same requests by the cache-less forward."""
    from localllm.loaders.load import load_model
    from localllm.runtime.batch import BatchEngine
    from localllm.runtime.sampling import SamplingParams

    lm = load_model(str(family("gemma3")[1]), quant="fp32")
    greedy = SamplingParams(temperature=0)
    prompts = [tokens(n, seed=20 + n)[0].tolist() for n in (3, 11, 30)]
    eng = BatchEngine(lm.model, kv_budget_bytes=1 << 20, chunk_tokens=8, attention=attention)
    handles = [eng.submit(p, greedy, 14) for p in prompts]
    eng.run_until_done()
    for p, h in zip(prompts, handles):
        want = reference(lm.model, p, greedy, 14, 64)
        with torch.inference_mode():
            forced = lm.model(torch.tensor([p + want[:-1]]))[0, len(p) - 1 :]
        top2 = forced.topk(2, dim=-1)
        assert (top2.values[:, 0] - top2.values[:, 1]).min() > 1e-4  # decided: CPUs agree
        assert h.result() == want


def test_gemma3_paged_pool_holds_only_the_window_of_sliding_layers(family):
    """The paged pool gives the sliding layers' blocks back as the window moves on: one sequence of
    70 positions holds every block of the full layer and at most 2 of each sliding layer, where a pool
    without windows holds every block of all four; a second request reuses the first's prompt (its
    window's blocks cached) and still picks the tokens it picks alone."""
    from localllm.loaders.load import load_model
    from localllm.runtime.batch import BatchEngine
    from localllm.runtime.sampling import SamplingParams

    lm = load_model(str(family("gemma3")[1]), quant="fp32")
    greedy = SamplingParams(temperature=0)
    eng = BatchEngine(lm.model, kv_budget_bytes=1 << 20, chunk_tokens=8, speculate=False)  # blocks without drafts
    assert eng.plan.windows == (None, WINDOW, WINDOW, WINDOW)
    assert "1 full-context, 3 holding only their 8-token window" in eng.plan.describe()
    prompt = tokens(40, seed=5)[0].tolist()
    h = eng.submit(prompt, greedy, 30)
    most = 0
    while eng.step():
        most = max(most, eng.usage()["blocks_used"])
    assert most <= 5 + 3 * 2  # ceil(70 / 16) full-layer blocks; a window of 8 spans at most 2 blocks
    want = reference(lm.model, prompt, greedy, 30, 96)
    with torch.inference_mode():
        top2 = lm.model(torch.tensor([prompt + want[:-1]]))[0, len(prompt) - 1 :].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # every step decided: CPUs agree
    assert h.result() == want
    again = eng.submit(prompt + want[:5], greedy, 12)
    eng.run_until_done()
    assert again.stats.cached_tokens == 32  # blocks 0 and 1 of the full layer; 1 of each sliding one
    assert again.result() == want[5:17]  # the decided steps above, now after a prefix hit
    eng.blocks.check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemma_embedding_scale_rounds_on_the_host_as_torch_does(dtype):
    """sqrt(hidden) rounded to the activation dtype in Python (no tensor in the forward): the value a
    tensor of that dtype holds, ties to even included."""
    from localllm.runtime.model import round_to

    values = [640 ** 0.5, 1152 ** 0.5, 2560 ** 0.5, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -11,
              *torch.rand(2000, generator=torch.Generator().manual_seed(0), dtype=torch.float64).mul(90).tolist()]
    assert [round_to(v, dtype) for v in values] == torch.tensor(values).to(dtype).tolist()


def test_gemma3_one_sequence_fills_a_tight_window_pool_without_failing(family):
    """A pool just large enough for its longest sequence: the engine's length limit counts each
    window group's blocks behind a whole prefill chunk, so a prompt near the limit, prefilled in
    chunks and decoded to the limit, never finds the pool short."""
    from localllm.loaders.load import load_model
    from localllm.runtime.batch import BatchEngine
    from localllm.runtime.sampling import SamplingParams

    lm = load_model(str(family("gemma3")[1]), quant="fp32")
    page = BatchEngine(lm.model, kv_budget_bytes=1 << 20).plan.bytes_per_block
    eng = BatchEngine(lm.model, kv_budget_bytes=12 * page, chunk_tokens=16)
    # 3 full-layer blocks, and 3 blocks for each of the 3 sliding layers (8 + 16 positions)
    assert eng.plan.n_blocks == 12 and eng.max_seq_len == 48
    h = eng.submit(tokens(44, seed=9)[0].tolist(), SamplingParams(temperature=0), 10)
    eng.run_until_done()
    assert h.stats.finish_reason == "length" and h.stats.generated_tokens == 5  # the last from position 47
    assert eng.blocks.num_used == 0 and eng.scheduler.preemptions == 0
    eng.blocks.check()
