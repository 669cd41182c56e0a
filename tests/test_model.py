"""The transformer against transformers' reference, and the batch engine's paged steps (prefill, chunked
prefill, decode through the paged kernel) against a full forward."""

from __future__ import annotations

import pytest
import torch

from localllm.loaders.build import empty_model, load_weights
from localllm.loaders.checkpoint import HFCheckpoint
from localllm.runtime.batch import BatchEngine
from tests.engines import forced

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
    n = 12
    got = forced(model, ids[0, :n].tolist(), ids[0, n:].tolist())  # prefill, then decode steps
    torch.testing.assert_close(got, full[0, n - 1 :], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_from_an_offset_matches(tiny_folder):
    """Prefill chunks after the first (a long prompt in pieces, a chat's new turn) see the blocks
    written before them."""
    _, folder = tiny_folder("llama")
    model = ours_from(folder)
    ids = tokens(30, seed=3)
    full = model(ids)
    engine = BatchEngine(model, kv_budget_bytes=1 << 20, chunk_tokens=10)
    got = engine.forced_logits(ids[0].tolist(), [])
    torch.testing.assert_close(got[0], full[0, -1], atol=1e-5, rtol=1e-5)


def test_sliding_window_matches_transformers(tiny_folder):
    """Mistral's local attention: with a window shorter than the sequence, masks must agree."""
    ref, folder = tiny_folder("mistral", sliding_window=8)
    model = ours_from(folder)
    assert model.config.sliding_window == 8
    ids = tokens(20, seed=4)
    with torch.no_grad():
        expected = ref(ids).logits
    torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=1e-4)
    got = forced(model, ids[0, :15].tolist(), ids[0, 15:].tolist())  # windowed decode in the paged kernel
    torch.testing.assert_close(got, expected[0, 14:], atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers(tiny_folder):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    ref, folder = tiny_folder("llama", rope_scaling=scaling, rope_theta=500000.0)
    model = ours_from(folder)
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
    got = forced(fused, ids[0, :10].tolist(), ids[0, 10:11].tolist())
    torch.testing.assert_close(got[-1], plain(ids[:, :11])[0, -1], atol=1e-5, rtol=1e-5)


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
