"""The transformer against transformers' reference, and cached decode against a full forward."""

from __future__ import annotations

import pytest
import torch

from localllm.loaders.build import empty_model, load_weights
from localllm.loaders.checkpoint import HFCheckpoint
from localllm.runtime.generate import decode_one_token, prefill

ARCHS = ["llama", "mistral", "qwen2"]


def ours_from(folder, dtype=torch.float32):
    ckpt = HFCheckpoint(folder)
    return load_weights(empty_model(ckpt.config), ckpt.iter_tensors(), torch.device("cpu"), dtype, str(folder))


def tokens(n: int, vocab: int = 384, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=g)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_folder, arch):
    ref, folder = tiny_folder(arch)
    ours = ours_from(folder)
    ids = tokens(24)
    with torch.no_grad():
        expected = ref(ids).logits
    got = ours(ids)
    assert got.shape == expected.shape
    assert expected.abs().max() > 0.5  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_cached_decode_equals_full_forward(tiny_folder, arch):
    _, folder = tiny_folder(arch)
    model = ours_from(folder)
    ids = tokens(20, seed=2)
    full = model(ids)  # (1, 20, V), no cache
    cache = model.new_cache(64)
    n = 12
    last = prefill(model, cache, ids[:, :n])
    torch.testing.assert_close(last, full[:, n - 1], atol=1e-5, rtol=1e-5)
    for pos in range(n, ids.shape[1]):
        logits = decode_one_token(model, cache, ids[:, pos : pos + 1], torch.tensor([pos]), pos)
        torch.testing.assert_close(logits, full[:, pos], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_from_an_offset_matches(tiny_folder):
    """A second prefill chunk starting mid-sequence (a chat's new turn) sees the cached prefix."""
    _, folder = tiny_folder("llama")
    model = ours_from(folder)
    ids = tokens(30, seed=3)
    full = model(ids)
    cache = model.new_cache(64)
    prefill(model, cache, ids[:, :10])
    last = prefill(model, cache, ids[:, 10:], start=10)
    torch.testing.assert_close(last, full[:, -1], atol=1e-5, rtol=1e-5)


def test_sliding_window_matches_transformers():
    """Mistral's local attention: with a window shorter than the sequence, masks must agree."""
    from tests.conftest import make_hf_model, save_hf_folder
    import tempfile
    from pathlib import Path

    ref = make_hf_model("mistral", sliding_window=8)
    with tempfile.TemporaryDirectory() as d:
        folder = save_hf_folder(ref, Path(d))
        model = ours_from(folder)
    assert model.config.sliding_window == 8
    ids = tokens(20, seed=4)
    with torch.no_grad():
        expected = ref(ids).logits
    torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=1e-4)
    cache = model.new_cache(32)
    prefill(model, cache, ids[:, :15])
    for pos in range(15, 20):
        logits = decode_one_token(model, cache, ids[:, pos : pos + 1], torch.tensor([pos]), pos)
        torch.testing.assert_close(logits, expected[:, pos], atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    from tests.conftest import make_hf_model, save_hf_folder

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    ref = make_hf_model("llama", rope_scaling=scaling, rope_theta=500000.0)
    model = ours_from(save_hf_folder(ref, tmp_path))
    assert model.config.rope_scaling["rope_type"] == "llama3"
    ids = tokens(40, seed=5)
    with torch.no_grad():
        expected = ref(ids).logits
    torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=1e-4)


def test_bf16_close_to_fp32(tiny_folder):
    _, folder = tiny_folder("llama")
    ids = tokens(16, seed=6)
    full = ours_from(folder)(ids)
    half = ours_from(folder, torch.bfloat16)(ids).float()
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() > 0.9
    assert (half - full).abs().max() < 0.1 * full.abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_change_nothing(tiny_folder, arch):
    """q/k/v and gate/up merged into single matmuls (qwen2: with biases) give the same logits."""
    from localllm.loaders.build import fuse_projections

    _, folder = tiny_folder(arch)
    plain, fused = ours_from(folder), fuse_projections(ours_from(folder))
    assert fused.layers[0].attn.qkv is not None and not hasattr(fused.layers[0].attn, "q")
    ids = tokens(16, seed=7)
    torch.testing.assert_close(fused(ids), plain(ids), atol=1e-5, rtol=1e-5)
    cache = fused.new_cache(32)
    prefill(fused, cache, ids[:, :10])
    logits = decode_one_token(fused, cache, ids[:, 10:11], torch.tensor([10]), 10)
    torch.testing.assert_close(logits, plain(ids[:, :11])[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_static_whole_cache_decode_matches(tiny_folder, arch):
    """The fixed-shape decode (whole cache + mask, for CUDA graphs) gives the prefix-slicing result."""
    _, folder = tiny_folder(arch)
    model = ours_from(folder)
    ids = tokens(20, seed=8)
    full = model(ids)
    cache = model.new_cache(48)
    prefill(model, cache, ids[:, :12])
    for pos in range(12, 20):
        with torch.no_grad():
            logits = model(ids[:, pos : pos + 1], cache, torch.tensor([pos]), static=True)[:, -1]
        torch.testing.assert_close(logits, full[:, pos], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant", ["bf16", "int4"])
def test_loading_does_not_import_the_compiler(tiny_folder, quant):
    """A cold start pays for torch alone: torch._dynamo (0.8 s to import) only comes with --compile.

    Random initialisation of the modules built on meta used to pull it in through torch's reference ops.
    """
    import subprocess
    import sys

    _, folder = tiny_folder("llama")
    code = ("import sys; from localllm.loaders.load import load_model; "
            f"lm = load_model({str(folder)!r}, quant={quant!r}); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
