"""gpt-oss from GGUF files as llama.cpp's converter and llama-quantize write them (arch ``gpt-oss``):
stacked ``ffn_{gate,up,down}_exps`` experts with their ``.bias``, ``attn_sinks``, the router's bias,
q/k/v/o biases, ``post_attention_norm`` before the MLP, YaRN and sliding-window metadata, the o200k
("gpt-4o") byte-level tokenizer and the harmony chat template. Files are written here from one tiny
random transformers ``GptOssForCausalLM`` (fp16 values, experts on the MXFP4 grid) in these layouts:
all F32; MXFP4 experts beside F16 (the converter's default from OpenAI's checkpoint) or BF16; MXFP4
experts beside Q8_0 (llama-quantize's MXFP4_MOE); all Q8_0. The F32 and MXFP4 + F16 files hold the
model exactly: their fp32 logits equal transformers' (prefill and cached decode). In every quantized
one each expert imports bit for bit as ``gguf.quants.dequantize`` gives it; the CLI runs, pulls and
shows such a file."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.loaders.gguf import GGUFCheckpoint
from localllm.loaders.load import load_model
from localllm.quant.expert_kernels import MoEBlocksCPU, block_type
from localllm.quant.formats import gguf_scheme, parse_scheme
from localllm.runtime.config import ModelConfig
from localllm.runtime.moe import MoE
from tests.test_gpt_oss import OSS, WINDOW, gpt_oss_model, tokens
from tests.test_harmony import SPECIALS, TEMPLATE
from tests.test_gguf import add_model_shape

ATOL = RTOL = 1e-4
#: The file layouts: what the experts and the other matrices are stored in (norms, biases, sinks and
#: the router stay F32 in every one, as the converter keeps them).
LAYOUTS = {"f32": ("F32", "F32"), "mxfp4": ("MXFP4", "F16"), "mxfp4_bf16": ("MXFP4", "BF16"),
           "mxfp4_moe": ("MXFP4", "Q8_0"), "q8_0": ("Q8_0", "Q8_0")}


def _mxfp4_grid(w: np.ndarray) -> np.ndarray:
    """``w`` (..., rows, in) rounded onto MXFP4 blocks along ``in``, as gguf-py packs them, dequantized."""
    q = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.MXFP4)
    return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4)


def oss_model() -> torch.nn.Module:
    """test_gpt_oss's tiny model at llama.cpp's clamp (its graph's constant limit 7, no metadata key),
    gate/up scaled twice more so that limit bites; every weight an fp16 value, the experts on the MXFP4
    grid (the F32 and MXFP4 + F16 layouts then hold it exactly)."""
    model = gpt_oss_model(swiglu_limit=7.0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
        for layer in model.model.layers:
            ex = layer.mlp.experts
            ex.gate_up_proj.mul_(2.0)
            for j in (0, 1):  # gate (even columns), up (odd): (E, D, F) as (E, F, D) rows along D
                ex.gate_up_proj[:, :, j::2] = torch.from_numpy(
                    _mxfp4_grid(ex.gate_up_proj[:, :, j::2].transpose(1, 2).numpy())).transpose(1, 2)
            ex.down_proj.copy_(torch.from_numpy(_mxfp4_grid(ex.down_proj.transpose(1, 2).numpy())).transpose(1, 2))
    return model


def hf_experts(layer) -> dict[str, torch.Tensor]:
    """A transformers gpt-oss layer's experts as the converter splits them: gate and up (E, F, D) from
    ``gate_up_proj``'s even and odd columns, down (E, D, F), each transposed to (out, in) rows."""
    ex = layer.mlp.experts
    return {"gate": ex.gate_up_proj[:, :, 0::2].transpose(1, 2), "up": ex.gate_up_proj[:, :, 1::2].transpose(1, 2),
            "down": ex.down_proj.transpose(1, 2)}


def _vocab(n: int) -> tuple[list[str], list[int]]:
    """o200k's shape in small: the byte alphabet, one merge's token, harmony's special tokens (control)."""
    from localllm.runtime.tokenizer import bytes_to_unicode

    normal = sorted(set(bytes_to_unicode().values())) + ["Ġt"]
    special = ["<|startoftext|>", "<|endoftext|>", *SPECIALS]
    special += [f"<|reserved_{i}|>" for i in range(n - len(normal) - len(special))]
    return normal + special, [1] * len(normal) + [3] * len(special)


def write_oss_gguf(model, path: Path, layout: str = "f32", **metadata) -> Path:
    """``model`` as llama.cpp's converter writes a gpt-oss (``conversion/gpt_oss.py``): experts split
    from the interleaved ``gate_up_proj`` (even columns gate, odd up) and transposed to (E, out, in),
    biases split alike, ``sinks`` as ``attn_sinks.weight``, 1-D tensors, norms, biases and the router in
    F32, the rest in ``layout``'s types. ``metadata``: keys to add or override (after ``gpt-oss.``)."""
    c = model.config
    experts_type, other_type = LAYOUTS[layout]
    w = gguf.GGUFWriter(str(path), "gpt-oss")

    def add(name: str, value: torch.Tensor) -> None:
        value = np.ascontiguousarray(value.detach().float().numpy())
        kind = "F32"  # 1-D, norms, biases (not .weight) and the router: F32 whatever the file's type
        if value.ndim > 1 and name.endswith(".weight") and not name.endswith("_norm.weight") and "gate_inp" not in name:
            kind = experts_type if "_exps." in name else other_type
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            return w.add_tensor(name, value)
        if kind == "F16":
            return w.add_tensor(name, value.astype(np.float16))
        w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)

    tokens_, types = _vocab(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens_)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(tokens_.index("<|startoftext|>"))
    w.add_eos_token_id(tokens_.index("<|return|>"))
    w.add_pad_token_id(tokens_.index("<|endoftext|>"))
    w.add_chat_template(TEMPLATE)
    rope = c.rope_parameters
    add_model_shape(w, c)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    w.add_expert_feed_forward_length(c.intermediate_size)
    for key, value in metadata.items():
        w.add_key_value(f"gpt-oss.{key}", value, gguf.GGUFValueType.FLOAT32 if isinstance(value, float)
                        else gguf.GGUFValueType.UINT32)
    add("token_embd.weight", model.model.embed_tokens.weight)
    for i, layer in enumerate(model.model.layers):
        a, m, b = layer.self_attn, layer.mlp, f"blk.{i}."
        add(b + "attn_norm.weight", layer.input_layernorm.weight)
        add(b + "post_attention_norm.weight", layer.post_attention_layernorm.weight)
        for ours, proj in (("attn_q", a.q_proj), ("attn_k", a.k_proj), ("attn_v", a.v_proj), ("attn_output", a.o_proj)):
            add(b + f"{ours}.weight", proj.weight)
            add(b + f"{ours}.bias", proj.bias)
        add(b + "attn_sinks.weight", a.sinks)
        add(b + "ffn_gate_inp.weight", m.router.weight)
        add(b + "ffn_gate_inp.bias", m.router.bias)
        ex = m.experts
        for proj, weight in hf_experts(layer).items():
            add(b + f"ffn_{proj}_exps.weight", weight)
        add(b + "ffn_gate_exps.bias", ex.gate_up_proj_bias[:, 0::2])  # (E, F)
        add(b + "ffn_up_exps.bias", ex.gate_up_proj_bias[:, 1::2])
        add(b + "ffn_down_exps.bias", ex.down_proj_bias)  # (E, D)
    add("output_norm.weight", model.model.norm.weight)
    add("output.weight", model.lm_head.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def ref():
    return oss_model()


@pytest.fixture(scope="module")
def files(ref, tmp_path_factory):
    """layout -> its GGUF file, written once on first use."""
    made: dict[str, Path] = {}
    folder = tmp_path_factory.mktemp("oss-gguf")

    def get(layout: str) -> Path:
        if layout not in made:
            made[layout] = write_oss_gguf(ref, folder / f"tiny-oss-{layout}.gguf", layout)
        return made[layout]

    return get


def _reference(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids).logits


def test_config_reads_what_llama_cpp_implies(ref, files):
    """The metadata the converter writes, and what llama.cpp's gpt-oss graph adds: even layers sliding,
    biases and sinks, the biased router's softmax over the top-k, the clamp at 7 and alpha 1.702, YaRN
    whose ramp is not rounded (gpt-oss's ``truncate: false``)."""
    c = GGUFCheckpoint(files("f32")).config
    assert c.arch == "gpt_oss" and c.is_moe and (c.n_experts, c.n_active, c.expert_size) == (8, 2, 64)
    assert c.layer_types == ["sliding", "full", "sliding"] and c.sliding_window == WINDOW
    assert c.attention_bias and c.o_bias and c.attn_sinks and c.router_bias and c.topk_softmax and c.expert_bias
    assert (c.mlp_act, c.swiglu_limit, c.swiglu_alpha) == ("swiglu_clamped", 7.0, 1.702)
    assert c.rope_theta == 150000.0 and c.rope_local_theta is None and not c.tie_embeddings
    # the HF config's own YaRN (its truncate: false), read back from the GGUF's keys
    assert c.rope_scaling == ModelConfig.from_hf(ref.config.to_dict()).rope_scaling
    assert c.num_parameters() == sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize("layout", ["f32", "mxfp4"])
def test_logits_equal_transformers(ref, files, layout):
    """All F32 loaded as fp32; MXFP4 experts beside F16 loaded as the file is (its experts' blocks on the
    native expert kernel, the F16 rows as they are) with fp32 activations: a prompt three windows long
    through sinks, sliding layers, the router and the clamped experts, against transformers."""
    lm = load_model(str(files(layout)), **({"quant": "fp32"} if layout == "f32" else {"dtype": "fp32"}))
    assert all(isinstance(layer.mlp, MoE) for layer in lm.model.layers)
    if layout == "mxfp4":
        down = lm.model.layers[0].mlp.experts.down
        assert block_type(down) == "MXFP4" and down.kernel is MoEBlocksCPU
    ids = tokens(3 * WINDOW)
    want = _reference(ref, ids)
    with torch.inference_mode():
        got = lm.model(ids)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_the_clamp_bites(ref):
    """The limit of 7 clamps some gate/up values: unclamped, transformers' logits move."""
    ids = tokens(16, seed=5)
    want = _reference(ref, ids)
    saved = ref.model.layers[0].mlp.experts.limit
    try:
        for layer in ref.model.layers:
            layer.mlp.experts.limit = 1e9
        loose = _reference(ref, ids)
    finally:
        for layer in ref.model.layers:
            layer.mlp.experts.limit = saved
    assert (loose - want).abs().max() > 100 * ATOL


def test_prefill_chunks_then_cached_decode_equal_transformers(ref, files):
    """The MXFP4 file through the batch engine: prefill in chunks of 7 past the window, then cached
    decode steps from the paged pool, against transformers' whole forward."""
    from localllm.runtime.batch import BatchEngine

    lm = load_model(str(files("mxfp4")), dtype="fp32")
    ids = tokens(30, seed=2)
    want = _reference(ref, ids)[0]
    engine = BatchEngine(lm.model, kv_budget_bytes=1 << 20, chunk_tokens=7, max_seq_len=32)
    got = engine.forced_logits(ids[0, :19].tolist(), ids[0, 19:].tolist())
    torch.testing.assert_close(got, want[18:], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("layout", ["mxfp4", "mxfp4_bf16", "mxfp4_moe", "q8_0"])
def test_tensors_import_bit_for_bit(ref, files, layout):
    """Each expert of each layer holds its blocks as the file has them (dequantized, as
    ``gguf.quants.dequantize`` gives that expert's bytes); biases, sinks and the router equal the file's
    F32 values; the file's default scheme keeps the experts' type whatever the other tensors' are. The
    MXFP4 files' experts dequantize to the reference's own weights (what the logits tests rely on)."""
    path = files(layout)
    experts_type, other_type = LAYOUTS[layout]
    # a float-majority file takes its experts' blocks; a Q8_0 one int8 (group 32), its experts their own
    assert GGUFCheckpoint(path).default_scheme() == (gguf_scheme("MXFP4") if other_type in ("F16", "BF16")
                                                     else parse_scheme("int8", 32))
    lm = load_model(str(path), dtype="fp32")
    files_ = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}

    def file_values(name: str) -> np.ndarray:
        t = files_[name]
        return gguf.quants.dequantize(t.data, t.tensor_type)

    for i, layer in enumerate(lm.model.layers):
        experts = layer.mlp.experts
        assert experts.down.kernel is MoEBlocksCPU
        for proj in ("gate", "up", "down"):
            want = file_values(f"blk.{i}.ffn_{proj}_exps.weight")  # (E, out, in)
            if experts_type == "MXFP4":
                np.testing.assert_array_equal(want, hf_experts(ref.model.layers[i])[proj].detach().numpy())
            p = getattr(experts, proj) if experts.gate_up is None or proj == "down" else experts.gate_up
            rows = slice(None)
            if p is experts.gate_up:
                f = experts.down.in_features
                rows = slice(0, f) if proj == "gate" else slice(f, 2 * f)
            held = gguf.GGMLQuantizationType[block_type(p)]  # the blocks the kernel multiplies
            assert held.name == experts_type
            got = np.stack([gguf.quants.dequantize(p.blocks[e, rows].numpy(), held) for e in range(want.shape[0])])
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(getattr(experts, f"{proj}_bias").numpy(),
                                          file_values(f"blk.{i}.ffn_{proj}_exps.bias"))
        np.testing.assert_array_equal(layer.attn.sinks.numpy(), file_values(f"blk.{i}.attn_sinks.weight"))
        np.testing.assert_array_equal(layer.mlp.router.bias.numpy(), file_values(f"blk.{i}.ffn_gate_inp.bias"))
        np.testing.assert_array_equal(layer.mlp.router.weight.numpy(), file_values(f"blk.{i}.ffn_gate_inp.weight"))
    with torch.inference_mode():
        assert torch.isfinite(lm.model(tokens(9))).all()


def test_gguf_tokenizer_is_o200k_with_harmony():
    """The converter's ``gpt-4o`` pre-tokenizer (o200k, as gpt-oss's tokenizer.json splits: case runs,
    contractions on their word, numbers of three digits; GPT-2's split differs on each), harmony's stop
    tokens and its chat template, from the file's metadata alone."""
    from localllm.runtime.textstream import template_channels
    from localllm.runtime.tokenizer import Tokenizer

    tokens_, types = _vocab(OSS["vocab_size"])
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.tokens": tokens_,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["Ġ t"],
            "tokenizer.ggml.eos_token_id": tokens_.index("<|return|>"), "tokenizer.chat_template": TEMPLATE}
    tok = Tokenizer.from_gguf_metadata(meta)
    pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("HelloWorld I'M 12345 ok?!\n")]
    assert pieces == ["Hello", "World", "ĠI'M", "Ġ", "123", "45", "Ġok", "?!Ċ"]
    assert template_channels(tok.chat_template)
    ids = tok.encode("<|start|>user<|message|>hi<|end|>")
    assert ids[0] == tokens_.index("<|start|>") and tokens_.index("<|end|>") in ids
    assert tok.decode(tok.encode("the cat 999")) == "the cat 999"


def test_cli_runs_pulls_and_shows_a_gpt_oss_gguf(files, monkeypatch, tmp_path):
    """``run FILE.gguf`` answers, raw and through the embedded harmony template; ``pull`` stores the file
    (its MXFP4 experts kept as they are); ``show`` names its parts."""
    from click.testing import CliRunner

    from localllm.cli import main

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOCALLLM_DEBUG", raising=False)
    path = str(files("mxfp4"))
    runner = CliRunner()
    for model, extra in ((path, ["--raw"]), (path, []), ("tiny-oss", [])):
        if model == "tiny-oss":  # pulled as other GGUFs are: int4 unless --quant says otherwise
            pulled = runner.invoke(main, ["pull", path, "--name", "tiny-oss"], catch_exceptions=False)
            assert pulled.exit_code == 0, pulled.output
        ran = runner.invoke(main, ["run", model, "the cat", "-n", "4", "--temperature", "0", "--verbose", *extra],
                            catch_exceptions=False)
        assert ran.exit_code == 0, ran.output
        prompt = int(re.search(r"^prompt eval count:\s+(\d+)", ran.output, re.M).group(1))
        assert int(re.search(r"^eval count:\s+(\d+)", ran.output, re.M).group(1)) >= 1, ran.output
        # raw: the prompt's 7 bytes (no merge applies); chat: harmony's system message and the user's,
        # rendered from the file's template
        assert prompt == 7 if extra else prompt > 50, (prompt, extra)
        if extra:
            assert ran.stdout.strip(), ran.output
    for model in (path, "tiny-oss"):
        shown = runner.invoke(main, ["show", model], catch_exceptions=False)
        assert shown.exit_code == 0 and re.search(r"architecture\s+gpt_oss", shown.output), shown.output
        assert re.search(r"experts\s+8, 2 active", shown.output), shown.output
        if model == path:  # the file's tensor types and what each becomes: the experts' blocks, exact
            assert re.search(r"MXFP4\s+72 tensors -> MXFP4 blocks \(as in the file\), exact", shown.output), \
                shown.output


@pytest.mark.parametrize("key, value, said", [
    ("rope.scaling.yarn_log_multiplier", 0.1, "yarn_log_multiplier"),
    ("rope.freq_base_swa", 10000.0, "freq_base_swa"),
])
def test_what_llama_cpp_would_run_differently_is_refused_in_one_line(ref, tmp_path, key, value, said):
    """A YaRN log multiplier (an mscale localllm does not apply to gpt-oss) and a sliding-layer RoPE base
    of its own are refused in one line naming the key."""
    path = write_oss_gguf(ref, tmp_path / "odd.gguf", "f32", **{key: value})
    with pytest.raises(LocalLLMError) as e:
        GGUFCheckpoint(path)
    assert said in str(e.value) and "\n" not in str(e.value)
