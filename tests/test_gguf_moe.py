"""MoE GGUF files (loaders/gguf.py): llama.cpp's stacked ``ffn_{gate,up,down}_exps`` experts, the router
``ffn_gate_inp``, Qwen2-MoE's shared expert (``*_shexp``) and the MoE metadata of ``qwen3moe``,
``qwen2moe`` and llama-arch Mixtral. Files are written here as llama.cpp's converter lays them out, from
tiny random transformers models: in F32 their logits equal transformers'; quantized, every expert's
blocks import bit for bit (they dequantize as ``gguf.quants.dequantize`` gives them) and run through
the native expert kernel."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from localllm.loaders.gguf import GGUFCheckpoint
from localllm.loaders.load import load_model
from localllm.quant.expert_kernels import MoEBlocksCPU, block_type
from localllm.runtime.moe import MoE
from tests.conftest import TINY
from tests.test_gguf import _permute, add_model_shape
from tests.test_gguf_cpu import random_blocks

#: transformers' model_type -> the ``general.architecture`` llama.cpp's converter writes.
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
#: 4 experts of 256 (a K-quant's super-block), 2 active, 64 wide: a few seconds a family.
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)


def moe_model(arch: str, **overrides):
    """A tiny random transformers MoE of ``arch`` (fp32), weights wide enough for non-trivial logits."""
    import transformers

    cfg_cls, model_cls, extra = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                      dict(norm_topk_prob=True, head_dim=32)),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                      dict(shared_expert_intermediate_size=256, norm_topk_prob=False)),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(intermediate_size=256)),
    }[arch]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**TINY, **MOE, **extra, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08 if p.dim() >= 2 else 0.1)
            if p.dim() == 1 and "norm" in name:
                p.add_(1.0)
    return model


def write_moe_gguf(model, path: Path, types: dict[str, str] | None = None) -> Path:
    """A GGUF of a transformers Qwen3-MoE, Qwen2-MoE or Mixtral, laid out as llama.cpp's converter
    writes it: experts stacked (E, out, in) in ``ffn_{gate,up,down}_exps``, the router ``ffn_gate_inp``
    (F32), a byte-level tokenizer. Tensors are F32 but for those ``types`` names by their GGUF name's
    suffix (``{"_exps.weight": "Q8_0"}``), quantized by ``gguf.quants.quantize``, or given as
    ``(type, blocks)`` callables for the types it cannot quantize (see :func:`kquant_blocks`)."""
    from localllm.runtime.tokenizer import bytes_to_unicode

    c = model.config
    arch = GGUF_ARCH[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)

    def add(name: str, value: np.ndarray) -> None:
        kind = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), "F32")
        if kind == "F32":
            return w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
        if callable(kind):  # (type name, blocks) of its own quantizer
            type_name, blocks = kind(value)
            return w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[type_name])
        qtype = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(value, dtype=np.float32), qtype), raw_dtype=qtype)

    byte_tokens = sorted(set(bytes_to_unicode().values()))
    tokens = byte_tokens + ["Ġt"] + [f"<extra_{i}>" for i in range(c.vocab_size - len(byte_tokens) - 1)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(byte_tokens) + 1) + [3] * (len(tokens) - len(byte_tokens) - 1))
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(len(byte_tokens) + 1)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    add_model_shape(w, c)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(c.num_local_experts if arch == "llama" else c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_weights_norm(bool(c.norm_topk_prob))
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":  # llama.cpp's rope layout: q/k rows permuted
            q, k = _permute(q, c.num_attention_heads), _permute(k, c.num_key_value_heads)
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", q)
        add(f"blk.{i}.attn_k.weight", k)
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            if p + f"self_attn.{theirs}.bias" in sd:
                add(f"blk.{i}.{ours}.bias", sd[p + f"self_attn.{theirs}.bias"])
        if p + "self_attn.q_norm.weight" in sd:
            add(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            add(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])  # (E, D): never quantized
        gate, up = np.split(sd[p + "mlp.experts.gate_up_proj"], 2, axis=1)  # (E, F, D) each
        add(f"blk.{i}.ffn_gate_exps.weight", gate)
        add(f"blk.{i}.ffn_up_exps.weight", up)
        add(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])  # (E, D, F)
        if p + "mlp.shared_expert.gate_proj.weight" in sd:
            for proj in ("gate", "up", "down"):
                add(f"blk.{i}.ffn_{proj}_shexp.weight", sd[p + f"mlp.shared_expert.{proj}_proj.weight"])
            add(f"blk.{i}.ffn_gate_inp_shexp.weight", sd[p + "mlp.shared_expert_gate.weight"].reshape(-1))  # (D,)
    add("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models():
    """arch, overrides -> the tiny transformers model, made once per module."""
    made: dict[str, torch.nn.Module] = {}

    def get(arch: str, **overrides):
        key = f"{arch} {sorted(overrides.items())}"
        if key not in made:
            made[key] = moe_model(arch, **overrides)
        return made[key]

    return get


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_f32_moe_gguf_logits_equal_transformers(models, arch, tmp_path):
    ref = models(arch)
    path = write_moe_gguf(ref, tmp_path / f"{arch}.gguf")
    ckpt = GGUFCheckpoint(path)
    c = ckpt.config
    assert (c.arch, c.n_experts, c.n_active, c.expert_size) == (arch, 4, 2, 256)
    assert c.norm_topk_prob == (arch != "qwen2_moe")
    assert c.shared_expert_size == (256 if arch == "qwen2_moe" else None)
    lm = load_model(str(path), quant="fp32")
    assert all(isinstance(layer.mlp, MoE) for layer in lm.model.layers)
    ids = tokens(20)
    with torch.no_grad():
        want = ref(ids).logits
    with torch.inference_mode():
        got = lm.model(ids)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _stacked_blocks(type_name: str, shape: tuple[int, int, int]) -> np.ndarray:
    """Random blocks of ``type_name`` for E experts of (out, in): each expert its own draw."""
    E, out, inp = shape
    return np.stack([random_blocks(type_name, out, inp, seed=17 * e + out) for e in range(E)])


def test_experts_narrower_than_the_files_main_block_load_in_their_own_type(models, tmp_path):
    """llama-quantize's Q4_K_M of experts 384 wide writes their down projections in Q8_0 (a K-quant's
    super-block of 256 does not divide 384): the file's main type (Q4_K) must not be asked to hold them."""
    ref = models("qwen3_moe", hidden_size=256, moe_intermediate_size=384)

    def blocks_of(type_name: str):
        return lambda value: (type_name, _stacked_blocks(type_name, value.shape))

    types = {"ffn_down_exps.weight": blocks_of("Q8_0"), "_exps.weight": blocks_of("Q4_K"),
             **{f"{n}.weight": lambda v: ("Q4_K", random_blocks("Q4_K", *v.shape)) for n in ("attn_q", "attn_k", "attn_v")}}
    path = write_moe_gguf(ref, tmp_path / "q4km.gguf", types)
    assert GGUFCheckpoint(path).default_scheme().gguf_type == "Q4_K"  # the file's main type, as in a Q4_K_M
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    want = gguf.quants.dequantize(t.data, t.tensor_type)  # (E, D, 384) fp32
    lm = load_model(str(path), check_kernels=True)
    down = lm.model.layers[0].mlp.experts.down
    assert down.in_features == 384 and down.kernel is MoEBlocksCPU
    held = gguf.GGMLQuantizationType[block_type(down)]  # the blocks the kernel multiplies
    for e in range(want.shape[0]):
        np.testing.assert_array_equal(gguf.quants.dequantize(down.blocks[e].numpy(), held), want[e])
    with torch.inference_mode():
        assert torch.isfinite(lm.model(tokens(9))).all()


@pytest.mark.parametrize("kinds", [("Q4_K", "Q6_K"), ("Q8_0", "Q5_0"), ("Q4_0", "Q5_1")])
def test_quantized_experts_import_bit_for_bit(models, kinds, tmp_path):
    """A file's expert tensors of each type the MoE GGUFs use keep their blocks: each expert of the loaded
    model dequantizes as ``gguf.quants.dequantize`` gives that expert's bytes, and the native kernel runs them."""
    gate_up_type, down_type = kinds
    ref = models("qwen3_moe", hidden_size=256)  # a K-quant's rows are whole super-blocks of 256

    def blocks_of(type_name: str):
        return lambda value: (type_name, _stacked_blocks(type_name, value.shape))

    # attention in Q8_0, the file's most common type (its default scheme, int8); experts in their own
    types = {"ffn_down_exps.weight": blocks_of(down_type), "_exps.weight": blocks_of(gate_up_type),
             **{f"{n}.weight": "Q8_0" for n in ("attn_q", "attn_k", "attn_v", "attn_output")}}
    path = write_moe_gguf(ref, tmp_path / "q.gguf", types)
    lm = load_model(str(path), check_kernels=True)
    reader = gguf.GGUFReader(str(path))
    files = {t.name: t for t in reader.tensors}
    for i, layer in enumerate(lm.model.layers):
        experts = layer.mlp.experts
        assert experts.down.kernel is MoEBlocksCPU
        for proj, name in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
            t = files[f"blk.{i}.{name}.weight"]
            want = gguf.quants.dequantize(t.data, t.tensor_type)  # (E, out, in) fp32
            p = getattr(experts, proj) if experts.gate_up is None or proj == "down" else experts.gate_up
            rows = slice(None)
            if p is experts.gate_up:
                f = experts.down.in_features
                rows = slice(0, f) if proj == "gate" else slice(f, 2 * f)
            held = gguf.GGMLQuantizationType[block_type(p)]  # the blocks the kernel multiplies
            for e in range(t.data.shape[0]):
                got = gguf.quants.dequantize(p.blocks[e, rows].numpy(), held)
                np.testing.assert_array_equal(got, want[e])
    ids = tokens(9)
    with torch.inference_mode():
        logits = lm.model(ids)
    assert torch.isfinite(logits).all()


def test_compiled_decode_steps_cover_moe_layers(models, tmp_path, monkeypatch):
    """A Q8_0 MoE GGUF on the native expert kernel: the compiled decode step traces through its MoE
    layers (the op's fake), and decodes a batch whose sequences join and leave as the eager engine does."""
    from localllm.runtime.batch import BatchEngine
    from tests.engines import GREEDY
    from tests.test_batch import assert_same
    from tests.test_compiled_step import counted

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))  # packages start missing
    ref = models("qwen3_moe", hidden_size=256)
    types = {"_exps.weight": "Q8_0", **{f"{n}.weight": "Q8_0" for n in ("attn_q", "attn_k", "attn_v", "attn_output")}}
    lm = load_model(str(write_moe_gguf(ref, tmp_path / "m.gguf", types)), dtype="fp32")
    assert all(layer.mlp.experts.down.kernel is MoEBlocksCPU for layer in lm.model.layers)
    built = BatchEngine(lm.model, kv_budget_bytes=1 << 22, max_running=4, compile=True, speculate=False)
    assert built.compiled and built.compile_note is None
    sizes = counted(built)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
    got = [built.submit(p, GREEDY, 6 + 2 * i) for i, p in enumerate(prompts)]
    built.run_until_done()
    assert max(sizes) >= 2  # batched decode steps ran compiled
    for i, (p, h) in enumerate(zip(prompts, got)):
        eager = BatchEngine(lm.model, kv_budget_bytes=1 << 22, max_running=1, speculate=False)
        alone = eager.submit(p, GREEDY, 6 + 2 * i)
        eager.run_until_done()
        assert_same(lm, p, h.result(), alone.result())


@pytest.mark.parametrize("gate_type,down_type", [("Q4_K", "Q8_0"), ("Q4_K", "Q5_0"), ("Q4_1", "Q4_0")])
def test_expert_rows_of_several_blocks_equal_the_reference(gate_type, down_type):
    """The types llama.cpp's MoE files give experts (Q4_K gate and up; Q8_0 or Q5_0 down, as for experts
    384 wide), in rows of several blocks (3 K-quant super-blocks; an odd count of 32-blocks, so both of
    the row kernel's chains and the last lone block are used; on AVX2 the fused form of the row kernel):
    equal to the reference for one row and a few, and a row's result is the same bits alone."""
    from localllm.quant.experts import QuantExperts, ReferenceExperts
    from localllm.quant.formats import gguf_scheme
    from tests.test_moe_kernels import native_ffn, relative_error

    E, D, F = 6, 768, 96

    def experts(type_name: str, out: int, inp: int, seed: int) -> QuantExperts:
        p = QuantExperts(E, inp, out, gguf_scheme(type_name))
        p.blocks = torch.from_numpy(np.stack([random_blocks(type_name, out, inp, seed * 10 + e) for e in range(E)]))
        return p

    gate, up, down = experts(gate_type, F, D, 1), experts(gate_type, F, D, 2), experts(down_type, D, F, 3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(5)])
    weights = torch.softmax(torch.randn(5, 3, generator=g), -1)
    batch = native_ffn((gate, up), down, x, ids, weights)
    want = ReferenceExperts.ffn(x, ids, weights, (gate, up), down, "silu")
    assert relative_error(batch, want) < 1e-5
    for r in (0, 4):
        alone = native_ffn((gate, up), down, x[r : r + 1], ids[r : r + 1], weights[r : r + 1])
        assert relative_error(alone, want[r : r + 1]) < 1e-5
        assert torch.equal(alone[0], batch[r])


@pytest.mark.parametrize("gate_type", ["Q4_K", "Q6_K"])
def test_q6_k_experts_equal_gguf_dequantize(gate_type):
    """Q6_K experts (the down projections of Qwen3-30B-A3B's Q4_K_M, whose experts are 768 wide; on AVX2
    the fused row kernel's byte-lane decoder): equal to the products of ``gguf.quants.dequantize``'s
    weights, in float64, for a few rows (the row kernel) and many (an expert of 16 rows or more: the
    panel GEMM); a row's result is the same bits alone as beside others."""
    from localllm.quant.experts import QuantExperts
    from localllm.quant.formats import gguf_scheme
    from tests.test_moe_kernels import native_ffn

    E, D, F, k = 6, 768, 256, 3
    raw = {"gate": (gate_type, F, D, 1), "up": (gate_type, F, D, 2), "down": ("Q6_K", D, F, 3)}
    projs, dense = {}, {}
    for name, (type_name, out, inp, seed) in raw.items():
        blocks = np.stack([random_blocks(type_name, out, inp, seed * 10 + e, scale=0.05) for e in range(E)])
        p = QuantExperts(E, inp, out, gguf_scheme(type_name))
        p.blocks = torch.from_numpy(blocks)
        projs[name] = p
        qtype = gguf.GGMLQuantizationType[type_name]  # (E, out, in) float64, as gguf-py decodes them
        dense[name] = torch.from_numpy(np.stack([gguf.quants.dequantize(b, qtype) for b in blocks])).double()

    def reference(x, ids, weights):  # type: ignore[no-untyped-def]
        y = torch.zeros(x.shape, dtype=torch.float64)
        for t in range(x.shape[0]):
            for j in range(k):
                e = int(ids[t, j])
                h = torch.nn.functional.silu(dense["gate"][e] @ x[t]) * (dense["up"][e] @ x[t])
                y[t] += float(weights[t, j]) * (dense["down"][e] @ h)
        return y

    g = torch.Generator().manual_seed(0)
    for rows in (5, 40):  # 40 rows: 20 an expert on average, the panel GEMM
        x = torch.randn(rows, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])
        weights = torch.softmax(torch.randn(rows, k, generator=g), -1)
        got = native_ffn((projs["gate"], projs["up"]), projs["down"], x, ids, weights)
        want = reference(x.double(), ids, weights.double())
        assert want.abs().max() > 0.1
        assert float((got.double() - want).norm() / want.norm()) < 1e-5
        if rows == 5:
            for r in (0, 4):
                alone = native_ffn((projs["gate"], projs["up"]), projs["down"], x[r : r + 1], ids[r : r + 1],
                                   weights[r : r + 1])
                assert torch.equal(alone[0], got[r])
