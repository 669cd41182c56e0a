"""Mixture-of-Experts families (Qwen3-MoE, Qwen2-MoE, Mixtral): tiny random-weight models saved by
transformers, loaded by localllm, against transformers' logits (fp32), through the batch engine's
chunked prefill and cached decode, several sequences in one step, and with int4 experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.loaders.build import fuse_projections, load_weights
from localllm.loaders.checkpoint import HFCheckpoint
from localllm.loaders.load import load_model, model_tensors
from localllm.quant.experts import QuantExperts, ReferenceExperts, experts_ffn, prepare_experts
from localllm.quant.formats import dequantize, parse_scheme, quantize
from localllm.runtime.config import ModelConfig
from localllm.runtime.moe import MoE, prepare_moe
from tests.conftest import TINY, hf_folders

ATOL = RTOL = 1e-4
#: 8 experts of 64 (a size every int4 group and nf4 block divides), 2 active.
MOE = dict(num_experts=8, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)


def _widen(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights wide enough that logits are not near zero; norms around 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08 if p.dim() >= 2 else 0.1)
            if p.dim() == 1 and "norm" in name:
                p.add_(1.0)
    return model.eval()


def qwen3_moe_model():
    import transformers

    # 3 layers, the middle one dense (mlp_only_layers): sparse and dense blocks side by side
    kw = {**TINY, **MOE, "num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True, "head_dim": 24}
    torch.manual_seed(0)
    return _widen(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw)))


def qwen2_moe_model():
    import transformers

    kw = {**TINY, **MOE, "shared_expert_intermediate_size": 64, "norm_topk_prob": False}
    torch.manual_seed(0)
    return _widen(transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**kw)))


def mixtral_model():
    import transformers

    kw = {**TINY, **MOE, "intermediate_size": 64}
    torch.manual_seed(0)
    return _widen(transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw)))


MAKERS = {"qwen3_moe": qwen3_moe_model, "qwen2_moe": qwen2_moe_model, "mixtral": mixtral_model}
FAMILIES = list(MAKERS)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """arch -> (transformers model, its HF folder saved by ``save_pretrained``), made once per module."""
    return hf_folders(MAKERS, "moe", tmp_path_factory)


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _reference(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids).logits


def _quantized(folder: Path, scheme: str):
    """The model with its experts (and linears) in ``scheme``, rounded to nearest as they stream."""
    ckpt = HFCheckpoint(folder)
    model, tensors, _ = model_tensors(ckpt, parse_scheme(scheme))
    fuse_projections(model)
    load_weights(model, tensors, torch.device("cpu"), torch.float32, str(folder))
    prepare_moe(model, torch.float32)
    return model


def assert_logits_match(ref, model: torch.nn.Module, n: int = 24) -> None:
    """One forward of ``n`` tokens gives transformers' fp32 logits (which are well away from zero)."""
    ids = tokens(n)
    want = _reference(ref, ids)
    with torch.inference_mode():
        got = model(ids)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", FAMILIES)
def test_logits_match_transformers(family, arch):
    ref, folder = family(arch)
    lm = load_model(str(folder), quant="fp32")
    assert any(isinstance(layer.mlp, MoE) for layer in lm.model.layers)
    assert_logits_match(ref, lm.model)


def test_config_fields_read(family):
    q3 = HFCheckpoint(family("qwen3_moe")[1]).config
    assert (q3.n_experts, q3.n_active, q3.expert_size, q3.norm_topk_prob) == (8, 2, 64, True)
    assert q3.moe_layers == [0, 2] and q3.shared_expert_size is None and q3.qk_norm
    assert [q3.is_moe_layer(i) for i in range(3)] == [True, False, True]
    q2 = HFCheckpoint(family("qwen2_moe")[1]).config
    assert q2.shared_expert_size == 64 and not q2.norm_topk_prob and q2.attention_bias and q2.moe_layers is None
    mx = HFCheckpoint(family("mixtral")[1]).config
    assert (mx.n_experts, mx.expert_size, mx.norm_topk_prob) == (8, 64, True)
    # every expert counted in the total, the routed ones only in the active count
    assert mx.num_parameters() - mx.active_parameters() == 2 * 6 * 3 * 64 * 64


@pytest.mark.parametrize("arch", FAMILIES)
def test_prefill_then_cached_decode_equals_full_forward(family, arch):
    """Prefill in chunks of 13, then decode steps from the paged cache, against one whole forward."""
    from localllm.runtime.batch import BatchEngine

    lm = load_model(str(family(arch)[1]), quant="fp32")
    ids = tokens(30, seed=2)
    with torch.inference_mode():
        full = lm.model(ids)[0]
    engine = BatchEngine(lm.model, kv_budget_bytes=1 << 20, chunk_tokens=13, max_seq_len=30)
    got = engine.forced_logits(ids[0, :19].tolist(), ids[0, 19:].tolist())
    torch.testing.assert_close(got, full[18:], atol=1e-5, rtol=1e-5)


def test_two_sequences_in_one_step_equal_each_alone(family):
    """Routing is per row of the flattened step: two sequences of different lengths prefilled and
    decoded together give each one's logits alone (Qwen2-MoE: routed and shared experts)."""
    from localllm.runtime.batch import BatchEngine
    from localllm.runtime.sampling import SamplingParams

    lm = load_model(str(family("qwen2_moe")[1]), quant="fp32")
    prompts = [tokens(n, seed=30 + n)[0].tolist() for n in (5, 17)]
    fed = [tokens(6, seed=40 + i)[0].tolist() for i in range(2)]
    alone = [BatchEngine(lm.model, kv_budget_bytes=1 << 20).forced_logits(p, f) for p, f in zip(prompts, fed)]
    engine = BatchEngine(lm.model, kv_budget_bytes=1 << 20, chunk_tokens=64)
    handles = [engine.submit(p, SamplingParams(temperature=0), forced=f) for p, f in zip(prompts, fed)]
    engine.run_until_done()
    for h, want, f in zip(handles, alone, fed):
        got = torch.stack(h._seq.logits[: len(f) + 1])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_transformers5_experts_load_like_per_expert_ones(family, tmp_path):
    """A checkpoint with transformers 5's fused experts (``mlp.experts.gate_up_proj`` (E, 2F, D),
    ``down_proj`` (E, D, F)) loads to the same logits as the per-expert one."""
    from safetensors.torch import load_file, save_file

    ref, folder = family("qwen3_moe")
    tensors = load_file(str(folder / "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    for i in (0, 2):
        p = f"model.layers.{i}.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")])
                   for e in range(8)]
        fused[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(8)])
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file({**tensors, **fused}, str(tmp_path / "model.safetensors"))
    ids = tokens(12, seed=5)
    with torch.inference_mode():
        got = load_model(str(tmp_path), quant="fp32").model(ids)
    torch.testing.assert_close(got, _reference(ref, ids), atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------ quantized experts
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_int4_experts_stay_close_to_fp32(family, arch):
    """int4 experts (and linears), rounded to nearest while streaming: logits close to fp32's."""
    ref, folder = family(arch)
    model = _quantized(folder, "int4")
    assert all(layer.mlp.experts.down.scheme.name == "int4" for layer in model.layers if isinstance(layer.mlp, MoE))
    ids = tokens(24, seed=3)
    want = _reference(ref, ids)[0]
    with torch.inference_mode():
        got = model(ids)[0]
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    top2 = want.topk(2, dim=-1).values
    decided = top2[:, 0] - top2[:, 1] > 0.4  # random weights: int4 moves a logit by up to ~0.75
    assert decided.sum() >= 2
    assert kl < 0.03 and torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided]), kl


def test_int4_experts_stream_as_formats_quantizes_each_expert(family):
    """Each expert's stacked int4 tensors are ``quant.formats.quantize`` of its HF weight, and the
    reference kernel's product equals one made from ``quant.formats.dequantize``."""
    ref, folder = family("mixtral")
    ckpt = HFCheckpoint(folder)
    model, tensors, _ = model_tensors(ckpt, parse_scheme("int4"))
    load_weights(model, tensors, torch.device("cpu"), torch.float32, str(folder))  # unfused, unprepared
    experts = model.layers[1].mlp.experts
    hf = ref.model.layers[1].mlp.experts
    scheme = parse_scheme("int4")
    for e in (0, 5):
        w = hf.down_proj[e] if hasattr(hf, "down_proj") else hf[e].w2.weight  # transformers 5 or 4
        want = quantize(w.detach(), scheme)
        for k, t in experts.down.expert(e).items():
            assert torch.equal(t, want[k]), k
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 3], [3, 7], [5, 0], [7, 1], [2, 6]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
    got = ReferenceExperts.ffn(x, ids, weights, (experts.gate, experts.up), experts.down, "silu")
    want = torch.zeros_like(x)
    for n in range(5):
        for j in range(2):
            e = int(ids[n, j])
            g = x[n] @ dequantize(experts.gate.expert(e), scheme).T
            u = x[n] @ dequantize(experts.up.expert(e), scheme).T
            want[n] += weights[n, j] * (dequantize(experts.down.expert(e), scheme) @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_other_schemes_hold_experts(family, scheme):
    ref, folder = family("qwen2_moe")
    model = _quantized(folder, scheme)
    ids = tokens(16, seed=4)
    want = _reference(ref, ids)[0]
    with torch.inference_mode():
        got = model(ids)[0]
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert kl < 0.03, kl


def test_experts_ffn_reference_kernel_and_empty_batch():
    """The contract: stacked canonical tensors, any order of ids, zero rows."""
    scheme = parse_scheme("int8")
    g = torch.Generator().manual_seed(0)
    E, D, F = 4, 32, 16
    gate_up, down = QuantExperts(E, D, 2 * F, scheme), QuantExperts(E, F, D, scheme)
    for e in range(E):
        for proj, shape in ((gate_up, (2 * F, D)), (down, (D, F))):
            for k, t in quantize(torch.randn(shape, generator=g), scheme).items():
                proj.expert(e)[k].copy_(t)
    assert prepare_experts(gate_up, down, torch.float32, kernel="reference") == "reference"
    x = torch.randn(3, D, generator=g)
    ids, w = torch.tensor([[1, 2], [2, 1], [0, 3]]), torch.rand(3, 2, generator=g)
    y = experts_ffn(x, ids, w, gate_up, down)
    swapped = experts_ffn(x, ids.flip(-1), w.flip(-1), gate_up, down)
    torch.testing.assert_close(y, swapped, atol=1e-5, rtol=1e-5)
    assert experts_ffn(x[:0], ids[:0], w[:0], gate_up, down).shape == (0, D)


# ------------------------------------------------------------------------------ the store, refusals
def test_stored_int8_moe_loads_as_pulled(family, tmp_path):
    """Written to the store (stacked experts, one expert streamed at a time) and loaded back: the same
    logits as the direct load; ``show``'s facts say it is MoE."""
    from localllm.commands.store import show_text
    from localllm.loaders.convert import convert_to_store
    from localllm.loaders.describe import describe_stored
    from localllm.loaders.store import Store

    _, folder = family("qwen2_moe")
    store = Store(tmp_path / "store")
    entry, _ = convert_to_store(HFCheckpoint(folder), parse_scheme("int8"), "tiny-moe", store, {"path": str(folder)})
    direct = load_model(str(folder), quant="int8")
    stored = load_model(entry.ref, store=store)
    ids = tokens(10, seed=6)
    with torch.inference_mode():
        want = direct.model(ids)
        torch.testing.assert_close(stored.model(ids), want, atol=1e-5, rtol=1e-5)
        # the stored experts dequantized one at a time and quantized again, to int4
        again = load_model(entry.ref, store=store, quant="int4").model(ids)
    kl = torch.nn.functional.kl_div(again[0].log_softmax(-1), want[0].log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert kl < 0.03, kl
    facts = describe_stored(entry)
    assert facts["moe"] == {"experts": 8, "active": 2, "expert_size": 64, "shared_expert_size": 64,
                            "sparse_layers": 2, "active_parameters": facts["parameters"] - 2 * 6 * 3 * 64 * 64}
    assert "experts             8, 2 active a token (size 64; a shared expert of 64), 2 of 2 layers" in show_text(facts)


@pytest.mark.parametrize("model_type, says", [("deepseek_v3", "deepseek_v3")])
def test_architectures_it_cannot_run_are_one_line(model_type, says):
    with pytest.raises(LocalLLMError) as e:
        ModelConfig.from_hf({"model_type": model_type, "architectures": ["X"], "hidden_size": 64})
    assert says in str(e.value) and "\n" not in str(e.value)


def test_damaged_moe_config_is_one_line():
    hf = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 4,
          "num_experts_per_tok": 8}
    with pytest.raises(LocalLLMError, match="routes each token to 8 experts of 4"):
        ModelConfig.from_hf(hf)


def test_export_refuses_a_moe_model_in_one_line(family, tmp_path):
    from localllm.loaders.export_hf import export_hf_folder

    with pytest.raises(LocalLLMError, match="cannot export a mixtral model"):
        export_hf_folder(family("mixtral")[1], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_int4_load_of_a_moe_rounds_to_nearest_without_calibration(family):
    """``--quant int4`` from float weights calibrates dense models (AWQ); a MoE's int4 is rounded to
    nearest, the same weights as the plain stream gives."""
    _, folder = family("mixtral")
    lm = load_model(str(folder), quant="int4", dtype="fp32")
    assert lm.calibration is None
    ids = tokens(12, seed=8)
    with torch.inference_mode():
        torch.testing.assert_close(lm.model(ids), _quantized(folder, "int4")(ids), atol=1e-4, rtol=1e-4)
