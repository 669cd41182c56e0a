"""The ``gguf-q8-cpu`` kernel (quant/q8_kernels.py): a GGUF's Q5_0, Q4_K and Q6_K blocks in the opt-in
int8-activation family, which ``--kernel int4-q8-cpu`` takes for them.

The blocks become the integer grid that holds their codes (``quant.gguf_blocks.integer_grid``): Q5_0's
values exactly, the K-quants' within the rounding of their sub-block scale (and offset) products to
fp16. The layer's product is then the int8-quantized activations by that grid's weights, as
``tests/test_q8_kernels.py`` holds the int4 and int8 members to; the blocks are gone once the
layer is prepared; other GGUF types stay on the exact block kernel; a model loads with it and stays close to
the file's weights.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from localllm import native
from localllm.quant import kernels
from localllm.quant.formats import dequantize, parse_scheme
from localllm.quant.gguf_blocks import INTEGER_GRIDS, integer_grid
from tests.test_tile_kernels import FP32_BOUND
from tests.test_gguf_cpu import gguf_layer, random_blocks
from tests.test_q8_kernels import quantized_activations

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler for localllm's CPU kernels")


def grid_weights(type_name: str, blocks: torch.Tensor) -> torch.Tensor:
    """The float64 weights of ``integer_grid``'s tensors for these blocks."""
    canonical = integer_grid(type_name, blocks)
    return dequantize(canonical, parse_scheme(*INTEGER_GRIDS[type_name]), torch.float64)


def k4_terms(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K blocks (out, bytes) -> |d * sc * q| and |dmin * m| for every weight (float64), from gguf's
    own unpacking of the 6-bit scales: the sizes of the two products the grid rounds to fp16."""
    from gguf.quants import Q4_K

    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float64)
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())  # (blocks, 8) each
    q = np.concatenate([b[:, 16:].reshape(-1, 4, 1, 32) & 0x0F, b[:, 16:].reshape(-1, 4, 1, 32) >> 4], axis=2)
    q = q.reshape(-1, 8, 32).astype(np.float64)
    scaled = np.abs(d[:, :, None] * sc[:, :, None] * q)
    shifted = np.broadcast_to(np.abs(dmin[:, :, None] * m[:, :, None]), scaled.shape)
    return scaled.reshape(raw.shape[0], -1), shifted.reshape(raw.shape[0], -1)


@pytest.mark.parametrize("type_name", sorted(INTEGER_GRIDS))
def test_the_grid_holds_the_files_codes(type_name):
    """Random blocks (every code, every scale and minimum): Q5_0's grid is the file's values bit for
    bit; Q4_K's and Q6_K's differ only by the fp16 rounding of ``d * sc`` (and Q4_K's ``dmin * m``): half
    an ulp of each product, 2^-11 relative, far less than one code's step."""
    layer, w = gguf_layer(type_name, 48, 512, seed=2)
    got = grid_weights(type_name, layer.blocks)
    if type_name == "Q5_0":
        assert torch.equal(got, w.double())
        return
    if type_name == "Q6_K":  # w = d * sc * (q - 32): its own size bounds the scale's rounding
        assert ((got - w.double()).abs() <= 2.0**-11 * 1.001 * w.double().abs()).all()
        assert (got != w.double()).any()
        return
    scaled, shifted = k4_terms(layer.blocks.numpy())
    bound = 2.0**-11 * torch.from_numpy(scaled + shifted)
    assert ((got - w.double()).abs() <= bound).all()
    assert (got != w.double()).any()  # the rounding is real: the bound is what holds it


@pytest.fixture
def needs_avx2() -> None:
    if not (native.available(kernels.LIBRARY) and torch.ops.localllm.q8_isa() != kernels.Q8_PORTABLE):
        pytest.skip("the int8-activation kernels are offered on CPUs with AVX2 only")


@pytest.mark.usefixtures("needs_avx2")
@pytest.mark.parametrize("type_name", sorted(INTEGER_GRIDS))
def test_the_product_is_the_quantized_activations_by_the_grid(type_name, monkeypatch):
    """Named through its family (``int4-q8-cpu``), saying so where it rounds a K-quant's scales; the
    blocks are dropped for the kernel's layout; 1 to 40 rows over 90 outputs (a partial tile) equal the
    int8-per-32 activations by the grid's weights within fp32 summation; a tied head's rows read back
    as the grid's weights."""
    monkeypatch.setattr(kernels, "WARNED", set())
    layer, _ = gguf_layer(type_name, 90, 512, seed=3)
    w = grid_weights(type_name, layer.blocks)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert layer.prepare(torch.float32, "int4-q8-cpu") == "gguf-q8-cpu"
    rounded = [str(m.message) for m in said if "sub-block scales rounded to fp16" in str(m.message)]
    assert len(rounded) == (type_name != "Q5_0"), rounded
    assert not hasattr(layer, "blocks")
    g = torch.Generator().manual_seed(4)
    for rows in (1, 3, 9, 40):
        x = torch.randn(rows, 512, generator=g)
        xq = quantized_activations(x)
        err = (layer(x).double() - xq @ w.t()).abs()
        assert (err <= FP32_BOUND * (xq.abs() @ w.abs().t()) + 1e-30).all(), rows
    ids = torch.tensor([0, 15, 16, 89, 40])
    torch.testing.assert_close(kernels.GGUFQ8CPU.rows_of(layer, ids).double(), w[ids], rtol=0, atol=1e-7)


@pytest.mark.usefixtures("needs_avx2")
def test_other_gguf_types_keep_the_exact_block_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "WARNED", set())
    layer, _ = gguf_layer("Q5_K", 32, 512)
    with pytest.warns(UserWarning, match=r"kernel gguf-q8-cpu cannot run Q5_K .* it runs Q5_0, Q4_K, Q6_K blocks only"):
        assert layer.prepare(torch.float32, "int4-q8-cpu") == "gguf-blocks-cpu"
    default, _ = gguf_layer("Q5_0", 32, 512)
    assert default.prepare(torch.float32) == "gguf-blocks-cpu"  # opt-in: never taken unnamed


@pytest.mark.usefixtures("needs_avx2")
def test_a_k_quant_file_runs_its_q5_0_and_q4_k_layers_on_it(tmp_path, monkeypatch):
    """A tiny Q4_K_M-like file (Q5_0 attention and MLP, Q4_K output projection, Q6_K down and head,
    Q8_0 values) with ``--kernel int4-q8-cpu``: every layer on the family's integer kernels. Its logits are compared with the exact default's in a file whose output projection is
    Q5_0 too: the test file's random Q4_K blocks are all-positive codes under a random-signed scale,
    weights far from centred, whose products cancel so much that any rounding of the activations shows
    large in the logits (real Q4_K blocks are centred by their minimums; ``localllm bench`` reports a
    real file's KL divergence)."""
    from localllm.loaders.load import load_model
    from tests.test_gguf_cpu import K_TYPES, write_k_quant_gguf

    (tmp_path / "k").mkdir()
    lm = load_model(str(write_k_quant_gguf(tmp_path / "k", monkeypatch)), dtype="fp32", kernel="int4-q8-cpu")
    layer = lm.model.layers[0]
    assert layer.attn.o.kernel is kernels.GGUFQ8CPU and layer.mlp.down.kernel is kernels.GGUFQ8CPU
    assert lm.model.output.kernel is kernels.GGUFQ8CPU  # the Q6_K head
    assert set(lm.kernels) - {"attention-cpu"} == {"gguf-q8-cpu", "int8-q8-cpu"}
    path = write_k_quant_gguf(tmp_path, monkeypatch, {**K_TYPES, "attn_output.weight": "Q5_0"})
    lm, exact = load_model(str(path), dtype="fp32", kernel="int4-q8-cpu"), load_model(str(path), dtype="fp32")
    assert lm.kernels["gguf-q8-cpu"] >= 6
    ids = torch.tensor([[1, 5, 77, 300, 12, 9, 250, 3]])
    with torch.no_grad():
        got, want = lm.model(ids).log_softmax(-1), exact.model(ids).log_softmax(-1)
    kl = torch.nn.functional.kl_div(got, want, log_target=True, reduction="none").sum(-1).mean()
    assert 0 < kl < 1e-3  # lossy in the activations (so not 0), and nowhere near a misread block
