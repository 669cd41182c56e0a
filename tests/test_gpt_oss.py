"""gpt-oss from a float checkpoint (a tiny random ``GptOssForCausalLM`` saved by transformers): the config
(alternating sliding/full layers, YaRN, the clamped SwiGLU), attention sinks, the biased router's
softmax over the top-k, the experts' interleaved gate/up columns and biases; fp32 logits equal
transformers' in one forward and through the batch engine (prefill chunks, cached decode, a window
the prompt outgrows), int4/int8 experts stay close, and the native expert kernel with biases and the
clamped activation equals the reference."""

from __future__ import annotations

import pytest
import torch

from localllm import native
from localllm.loaders.checkpoint import HFCheckpoint
from localllm.loaders.load import load_model
from localllm.quant.expert_kernels import MoEBlocksCPU
from localllm.quant.experts import ClampedSwiGLU, ExpertBiases, ReferenceExperts, activate
from localllm.runtime.config import ModelConfig
from localllm.runtime.model import rope_attention_factor, rope_inv_freq
from localllm.runtime.moe import MoE
from tests.conftest import hf_folders
from tests.test_moe import _quantized, _widen
from tests.test_moe_kernels import D, E, quantized_experts, relative_error, routed

ATOL = RTOL = 1e-4
WINDOW = 8
#: 3 layers (sliding, full, sliding), 8 experts of 64 (every int4 group divides), 2 active; YaRN
#: over an original context of 64.
OSS = dict(vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
           max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, swiglu_limit=1.5,
           rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0})


def gpt_oss_model(**overrides):
    """The tiny model of :data:`OSS` (with ``overrides``), random weights wide enough to matter."""
    import transformers

    torch.manual_seed(0)
    model = _widen(transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**OSS, **overrides})))
    with torch.no_grad():  # sinks and biases large enough to matter; some gate/up past the limit
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
            layer.mlp.router.bias.normal_(0, 0.5)
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.1)
            layer.mlp.experts.gate_up_proj.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    """(transformers model, its HF folder), made once per module."""
    return hf_folders({"gpt_oss": gpt_oss_model}, "oss", tmp_path_factory)("gpt_oss")


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, OSS["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _reference(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids).logits


def test_config_fields_read(oss):
    c = HFCheckpoint(oss[1]).config
    assert c.arch == "gpt_oss" and c.is_moe and c.moe_layers is None
    assert (c.n_experts, c.n_active, c.expert_size) == (8, 2, 64)
    assert c.layer_types == ["sliding", "full", "sliding"] and c.sliding_window == WINDOW
    assert [c.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert c.attention_bias and c.o_bias and c.attn_sinks and c.router_bias and c.topk_softmax and c.expert_bias
    assert (c.mlp_act, c.swiglu_limit, c.swiglu_alpha) == ("swiglu_clamped", 1.5, 1.702)
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_theta == 150000.0
    # every parameter transformers has, counted
    assert c.num_parameters() == sum(p.numel() for p in oss[0].parameters())


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("extra", [{}, {"mscale": 1.2, "mscale_all_dim": 0.8}, {"attention_factor": 1.3}])
def test_yarn_equals_transformers(truncate, extra):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**OSS["rope_parameters"], "truncate": truncate, **extra}
    hf = GptOssConfig(**{**OSS, "rope_parameters": params})
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = ModelConfig.from_hf(hf.to_dict())
    assert torch.equal(rope_inv_freq(ours), want)
    assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-12)


def test_logits_match_transformers(oss):
    """A prompt three windows long: the sliding layers' mask, the sinks, the routing and experts."""
    ref, folder = oss
    lm = load_model(str(folder), quant="fp32")
    assert all(isinstance(layer.mlp, MoE) for layer in lm.model.layers)
    ids = tokens(3 * WINDOW)
    want = _reference(ref, ids)
    with torch.inference_mode():
        got = lm.model(ids)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_sinks_matter(oss):
    """The sinks are not a no-op: zeroed out on the reference, its logits move well past the tolerance."""
    ref, folder = oss
    ids = tokens(12, seed=4)
    want = _reference(ref, ids)
    saved = [layer.self_attn.sinks.clone() for layer in ref.model.layers]
    try:
        with torch.no_grad():
            for layer in ref.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        plain = _reference(ref, ids)
    finally:
        with torch.no_grad():
            for layer, s in zip(ref.model.layers, saved):
                layer.self_attn.sinks.copy_(s)
    assert (plain - want).abs().max() > 100 * ATOL


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_prefill_chunks_then_cached_decode_equal_transformers(oss, kv_dtype):
    """Prefill in chunks of 7 past the window, then decode steps from the paged pool (the sliding
    layers' given-back blocks), against transformers' whole forward; an int8 pool stays close."""
    from localllm.runtime.batch import BatchEngine

    ref, folder = oss
    lm = load_model(str(folder), quant="fp32")
    ids = tokens(30, seed=2)
    want = _reference(ref, ids)[0]
    kw = {"kv_dtype": kv_dtype} if kv_dtype else {}  # the default pool holds the fp32 model's dtype
    engine = BatchEngine(lm.model, kv_budget_bytes=1 << 20, chunk_tokens=7, max_seq_len=32, **kw)
    got = engine.forced_logits(ids[0, :19].tolist(), ids[0, 19:].tolist())
    if kv_dtype is None:
        torch.testing.assert_close(got, want[18:], atol=ATOL, rtol=RTOL)
    else:
        assert (got - want[18:]).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_quantized_experts_stay_close_to_fp32(oss, scheme):
    """int4 / int8 experts and linears, rounded to nearest while streaming (de-interleaved first),
    through the native expert kernel: logits close to transformers' fp32 ones."""
    ref, folder = oss
    model = _quantized(folder, scheme)
    kernels = {layer.mlp.experts.down.kernel for layer in model.layers}
    assert kernels == {MoEBlocksCPU if native.compiler() is not None else ReferenceExperts}
    ids = tokens(24, seed=3)
    want = _reference(ref, ids)[0]
    with torch.inference_mode():
        got = model(ids)[0]
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    # random experts scaled up (so the clamp bites) take int4's rounding harder than test_moe's
    assert kl < (0.1 if scheme == "int4" else 0.002), kl


def test_compiled_step_refuses_sinks(oss):
    from localllm.runtime import compiled_step

    lm = load_model(str(oss[1]), quant="fp32")
    assert "sinks" in compiled_step.unsupported(lm.model, None, object())  # type: ignore[arg-type]
    assert not lm.model.layers[0].attn.takes_kernels


def test_clamped_swiglu_is_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(**{**OSS, "swiglu_limit": 0.7}))
    gate_up = torch.randn(50, 128) * 2
    got = activate(gate_up[:, 0::2], gate_up[:, 1::2], ClampedSwiGLU(0.7))
    torch.testing.assert_close(got, experts._apply_gate(gate_up), atol=0, rtol=0)


needs_native = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler for localllm's CPU kernels")


@needs_native
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rows", [3, 80])  # 80 rows over 4 experts: the panel GEMM
def test_native_kernel_with_biases_and_clamp_equals_the_reference(fused, rows):
    from localllm.quant.experts import concat_experts

    F_ = 256
    gate = quantized_experts("int8", None, F_, D, seed=1)
    up = quantized_experts("int8", None, F_, D, seed=2)
    down = quantized_experts("int4", 32, D, F_, seed=3)
    gate_up = concat_experts([gate, up]) if fused else (gate, up)
    g = torch.Generator().manual_seed(5)
    biases = ExpertBiases(torch.randn(E, F_, generator=g) * 0.5, torch.randn(E, F_, generator=g) * 0.5,
                          torch.randn(E, D, generator=g) * 0.1)
    act = ClampedSwiGLU(0.3)
    x, ids, weights = routed(rows, seed=rows)
    want = ReferenceExperts.ffn(x, ids, weights, gate_up, down, act, biases)
    got = _native(gate_up, down, x, ids, weights, act, biases)
    assert relative_error(got, want) < 1e-5
    # the biases and the clamp both matter
    assert relative_error(ReferenceExperts.ffn(x, ids, weights, gate_up, down, act), want) > 1e-2
    assert relative_error(ReferenceExperts.ffn(x, ids, weights, gate_up, down, ClampedSwiGLU(50.0), biases),
                          want) > 1e-2


def _native(gate_up, down, x, ids, weights, act, biases):  # type: ignore[no-untyped-def]
    """The kernel on its prepared layout, with biases (the canonical tensors put back for the reference)."""
    projs = [*gate_up, down] if isinstance(gate_up, tuple) else [gate_up, down]
    saved = [p.canonical() for p in projs]
    for p in projs:
        p.blocks = MoEBlocksCPU.prepare(p)["blocks"]
    try:
        return MoEBlocksCPU.ffn(x, ids, weights, gate_up, down, act, biases)
    finally:
        for p, s in zip(projs, saved):
            for name, v in s.items():
                setattr(p, name, v)


def test_stored_int4_loads_as_pulled_and_bf16_runs(oss, tmp_path):
    """Written to the store as int4 (experts one at a time, biases and sinks beside them) and loaded
    back: the direct load's logits; the float checkpoint in bf16 stays close to fp32."""
    from localllm.loaders.convert import convert_to_store
    from localllm.loaders.store import Store
    from localllm.quant.formats import parse_scheme

    from tests.conftest import save_hf_folder

    ref, folder = oss
    # bf16, as gpt-oss is published: the store keeps unquantized tensors (biases, sinks, norms) in bf16
    bf16 = save_hf_folder(gpt_oss_model().bfloat16(), tmp_path / "bf16")
    store = Store(tmp_path / "store")
    entry, _ = convert_to_store(HFCheckpoint(bf16), parse_scheme("int4"), "tiny-oss", store, {"path": str(bf16)})
    ids = tokens(20, seed=6)
    with torch.inference_mode():
        want = load_model(str(bf16), quant="int4").model(ids)
        torch.testing.assert_close(load_model(entry.ref, store=store).model(ids), want, atol=1e-5, rtol=1e-5)
        half = load_model(str(folder), quant="bf16").model(ids).float()
    fp32 = _reference(ref, ids)
    kl = torch.nn.functional.kl_div(half[0].log_softmax(-1), fp32[0].log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert kl < 0.01, kl


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("lens, window", [([1, 15, 16, 17, 53, 200], None), ([1, 15, 53, 200], 37),
                                          ([700], None)])  # one long stream: its task split across threads
def test_decode_kernel_with_sinks_equals_the_reference(dtype, lens, window):
    """The CPU decode kernel with sinks (the sink joins each head's softmax max and sum) against the
    reference over the gathered keys, scattered blocks, a window, float and int8 pools; the sinks move
    the result (some above every score, some below)."""
    from localllm.runtime import attention, cpu_attention
    from localllm.runtime.cache import quantize_kv
    from localllm.runtime.kv_pool import gather
    from tests.test_cpu_attention import _released, random_batch

    kv, g, hd, bs = 2, 3, 64, 16
    real = torch.float32 if dtype == "int8" else dtype
    q, k_pool, v_pool, tables, table, ctx = random_batch(real, kv, g, hd, bs, lens, n_blocks=60, seed=3)
    sinks = torch.tensor([-3.0, 0.0, 1.5, 4.0, 9.0, -20.0])  # (KV * G,)
    pools = (quantize_kv(k_pool), quantize_kv(v_pool)) if dtype == "int8" else (k_pool, v_pool)
    got = cpu_attention.paged_decode_attention(q, *pools, _released(table, lens, bs, window), ctx, window, sinks=sinks)
    plain = cpu_attention.paged_decode_attention(q, *pools, _released(table, lens, bs, window), ctx, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        if dtype == "int8":
            k, v = gather(pools[0], pools[1], tables[i], n, torch.float32)
        else:
            k, v = gather(k_pool, v_pool, tables[i], n)  # (1, KV, n, hd)
        first = 0 if window is None else max(0, n - window)
        k, v = k[:, :, first:].float(), v[:, :, first:].float()
        qi = q[i].reshape(1, kv * g, 1, hd).float()  # the query heads, kv head by kv head
        want = attention.reference(qi, k, v, None, None, None, sinks)[0, :, 0].reshape(kv, g, hd)
        assert (got[i].float() - want).abs().max() <= tol * max(1.0, want.abs().max().item()), i
    assert (got.float() - plain.float()).abs().max() > 0.1


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,q_pos,window", [(1, 0, None), (40, 0, None), (30, 100, None), (50, 60, 24)])
def test_chunk_kernel_with_sinks_equals_the_reference(dtype, n, q_pos, window):
    """The CPU chunk kernel with sinks (each row's online softmax starts at its head's sink) against
    float64 attention with the sink column over the gathered keys; the sinks move the result."""
    import math

    from localllm.runtime import cpu_attention
    from localllm.runtime.kv_pool import gather
    from tests.test_cpu_attention import chunk_case

    kv, g, hd, bs = 2, 3, 32, 16
    q, k_pool, v_pool, blocks, first = chunk_case(dtype, kv, g, hd, bs, n, q_pos, window, seed=n)
    sinks = torch.tensor([-3.0, 0.0, 1.5, 4.0, 9.0, -20.0])
    got = cpu_attention.paged_chunk_attention(q, k_pool, v_pool, blocks, first, q_pos, window, hd ** -0.5, sinks)
    plain = cpu_attention.paged_chunk_attention(q, k_pool, v_pool, blocks, first, q_pos, window, hd ** -0.5)
    ks, vs = gather(k_pool, v_pool, blocks, q_pos + n - first * bs, torch.float32)  # (1, KV, L, hd)
    keys = torch.arange(first * bs, q_pos + n)[None, :]
    rows = torch.arange(q_pos, q_pos + n)[:, None]
    seen = (keys <= rows) & (keys > rows - window if window is not None else True)  # (n, L)
    s = torch.einsum("nkgd,kld->kgnl", q.double(), ks[0].double()) / math.sqrt(hd)
    s = s.masked_fill(~seen, float("-inf"))
    sink = sinks.double().view(kv, g, 1, 1).expand(kv, g, n, 1)
    p = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    want = torch.einsum("kgnl,kld->nkgd", p, vs[0].double())
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)
    assert (got - plain).abs().max() > 0.1
