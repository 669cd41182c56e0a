"""The ``int4-group-cpu`` and ``int8-group-cpu`` kernels (quant/tile_kernels.py, csrc/tile_mm.cpp):
exact int4 and int8 on the CPU, the weights multiplied by fp32 activations.

The kernels are checked against ``x @ W^T`` in float64 with W the reference's dequantized weights,
within an fp32 summation bound (|x| @ |W|^T times a few fp32 epsilons), which holds on any x86-64
CPU whatever its vector width; the default SmolLM2 path against the file's own weights in fp32,
teacher-forced, within a KL divergence the bf16-activation path it replaces exceeds.
"""

from __future__ import annotations

import pytest
import torch

from localllm import native
from localllm.quant import kernels
from localllm.quant.formats import dequantize, parse_scheme, quantize
from localllm.quant.linear import QuantLinear

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler for localllm's CPU kernels")

#: fp32 rounding of a sum of K products, relative to sum |x_k w_k|: K * eps would be the worst case;
#: blocked sums stay far below it. 1e-5 is 80 ulps and still 1000x under a bf16 activation's rounding.
FP32_BOUND = 1e-5


def layer_of(scheme_name: str, group: int | None, out: int, inp: int, symmetric: bool = False,
             seed: int = 0) -> tuple[QuantLinear, torch.Tensor]:
    """A QuantLinear of random weights in the scheme, and its weights dequantized (float64)."""
    scheme = parse_scheme(scheme_name, group, symmetric)
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05
    canonical = quantize(w, scheme)
    layer = QuantLinear(inp, out, scheme)
    for k, v in canonical.items():
        setattr(layer, k, v)
    return layer, dequantize(canonical, scheme).double()


def int16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(M, N): how far x (M, K) @ w (N, K)^T may move when each activation is rounded to int16 steps of
    its 32 columns' max |x| / 32767, as the register kernels of int4, int5 and Q4_K codes take them
    where the CPU has vpmaddwd (tile_mm.cpp): half a step times |w|, summed."""
    x = x.double()
    step = x.abs().view(x.shape[0], -1, 32).amax(-1) / 32767  # (M, K/32)
    return 0.5 * step.repeat_interleave(32, dim=1) @ w.abs().t()


def assert_fp32_exact(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, int16: bool = False) -> None:
    """got (M, N) against x (M, K) @ w (N, K)^T in float64, within :data:`FP32_BOUND` of sum |x w|
    (``int16``: and the activations' int16 rounding, :func:`int16_bound`)."""
    x = x.double()
    want = x @ w.t()
    scale = x.abs() @ w.abs().t()
    err = (got.double() - want).abs()
    bound = FP32_BOUND * scale + (int16_bound(x, w) if int16 else 0)
    assert (err <= bound + 1e-30).all(), float((err / scale).max())


@pytest.mark.parametrize("group,out,symmetric", [(32, 192, False), (32, 200, True), (64, 13, False),
                                                 (128, 96, False), (256, 48, True)])
def test_int4_kernel_is_the_fp32_product_with_the_exact_weights(group, out, symmetric):
    """Every row count the kernel treats apart: one row (decode), 2 and 3 (rows sharing decoded columns,
    and the rest), with the activations in int16 steps, then the panel GEMM's groups of activation rows
    in fp32: 5 (one short group), 16 (8 + 8), 17 (9 + 8) and 40 (four of 10); output rows past a tile
    of 16."""
    inp = 512 if group >= 128 else 576
    layer, w = layer_of("int4", group, out, inp, symmetric)
    assert layer.prepare(torch.float32) == "int4-group-cpu"
    g = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 5, 16, 17, 40):
        x = torch.randn(rows, inp, generator=g)
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        assert_fp32_exact(got, x, w, int16=rows <= kernels.Int4GroupCPU.GEMV_ROWS)


def test_a_non_finite_activation_reaches_every_output_as_in_fp32():
    """The decode rows' int16 activations (tile_mm.cpp) would lose a NaN or an inf in their rounding:
    its 32 columns' scale turns NaN instead, as fp32's product would."""
    layer, _ = layer_of("int4", 32, 64, 576)
    layer.prepare(torch.float32)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 576, generator=torch.Generator().manual_seed(4))
        x[1, 40] = bad
        y = layer(x)
        assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any(), bad


def test_int4_kernel_takes_16_bit_activations_widened_exactly():
    layer, w = layer_of("int4", 32, 64, 576)
    assert layer.prepare(torch.bfloat16, "int4-group-cpu") == "int4-group-cpu"
    x = torch.randn(3, 576).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    want = x.double() @ w.t()
    # the output's rounding, and the register kernel's int16 steps of the widened activations
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + int16_bound(x, w) + 1e-6).all()


def test_int4_dequantized_slices_are_the_reference_weights_bit_for_bit():
    """The prefill's fp32 weights are the reference's: q * scale is exact, so one rounding each."""
    layer, _ = layer_of("int4", 32, 200, 576)
    want = dequantize(layer.canonical(), layer.scheme)
    t = kernels.Int4GroupCPU.prepare(layer)
    got = torch.ops.localllm.int4_group_dequant(t["packed"], t["tile_scales"], t["tile_offsets"], 32, 200)
    assert torch.equal(got, want)


def test_int4_layout_repacked_in_slices_is_the_layout_of_the_whole():
    layer, _ = layer_of("int4", 32, 200, 576)
    whole = kernels.Int4GroupCPU.prepare(layer, rows=1 << 20)
    sliced = kernels.Int4GroupCPU.prepare(layer, rows=48)
    assert all(torch.equal(whole[k], sliced[k]) for k in whole)
    assert whole["packed"].shape == (13, 72, 64) and whole["tile_scales"].shape == (13, 18, 16)
    # rows 8-15 of the last tile are padding: their dwords (bytes 32-63 of each octet) and scales are zero
    assert (whole["packed"][-1, :, 32:] == 0).all() and (whole["tile_scales"][-1, :, 8:] == 0).all()
    assert (whole["packed"][-1, :, :32] != 0).any()


def panel_rows_are_batch_invariant(op, x: torch.Tensor) -> None:
    """``op(x)``'s every row bit for bit the same computed alone and within another batch: each output of
    the panel GEMM is one FMA chain over the inputs in order, whatever rows share the call."""
    whole = op(x)
    for i in (0, 7, x.shape[0] - 1):
        assert torch.equal(op(x[i : i + 1])[0], whole[i]), i
    assert torch.equal(op(x[3:20]), whole[3:20])


def test_panel_gemm_rows_do_not_depend_on_the_batch():
    """What makes a sequence's logits the same in any batch that takes the panel path; the
    int8 register kernel's rows too (a head's logits: rows sharing each decoded column two at a time,
    the last of an odd count alone, with the same chains of FMAs)."""
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(3))
    layer, _ = layer_of("int4", 32, 200, 576)
    t = kernels.Int4GroupCPU.prepare(layer)
    panel_rows_are_batch_invariant(
        lambda a: torch.ops.localllm.int4_group_gemm(a, t["packed"], t["tile_scales"], t["tile_offsets"], 32, 200), x)
    for out in (200, 201):  # a last tile of 8 rows, and of 9
        layer8, _ = layer_of("int8", 32, out, 576)
        t8 = kernels.Int8GroupCPU.prepare(layer8)
        for op in (torch.ops.localllm.int8_group_gemm, torch.ops.localllm.int8_group_mm):
            panel_rows_are_batch_invariant(lambda a: op(a, t8["packed"], t8["tile_scales"], 32, out), x)


@pytest.mark.parametrize("group", [None, 32])
def test_int8_kernel_with_fp32_activations_is_the_exact_product(group):
    """Per-channel int8 too (torch's int8 kernel is 4x slower with fp32 activations): every row count,
    the register kernel's (1, 3, 5, 8: rows sharing each decoded column, then the rest) and the panel
    GEMM's (9, 16, 17, 40), over a width with a last panel of fewer columns (576 = 2 x 256 + 64); a
    tied head's rows read back from the layout are the weights."""
    layer, w = layer_of("int8", group, 200, 576)
    assert layer.prepare(torch.float32) == "int8-group-cpu"
    assert set(layer._buffers) == {"packed", "tile_scales"}  # no canonical copy beside the layout
    g = torch.Generator().manual_seed(2)
    for rows in (1, 3, 5, 8, 9, 16, 17, 40):
        x = torch.randn(rows, 576, generator=g)
        assert_fp32_exact(layer(x), x, w)
    ids = torch.tensor([0, 15, 16, 199, 7])
    assert torch.equal(kernels.Int8GroupCPU.rows_of(layer, ids), w[ids].float())


def test_int4_kernel_refuses_a_layout_that_does_not_match():
    layer, _ = layer_of("int4", 32, 32, 64)
    t = kernels.Int4GroupCPU.prepare(layer)
    with pytest.raises(RuntimeError, match="rows do not fill"):
        torch.ops.localllm.int4_group_mm(torch.randn(1, 64), t["packed"], t["tile_scales"], t["tile_offsets"], 32, 48)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.localllm.int4_group_mm(torch.randn(1, 32), t["packed"], t["tile_scales"], t["tile_offsets"], 32, 32)


def teacher_forced_decode(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Log-probabilities (T, vocab) of ``ids`` (1, T) fed one token a step through the batch engine's
    decode steps: every matmul on the decode (one-row) path."""
    from tests.engines import forced

    tokens = ids[0].tolist()
    return forced(model, tokens[:1], tokens[1:]).log_softmax(-1)


def kld_top1(want: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Mean KL(want || got) and top-1 agreement of (T, vocab) log-probabilities."""
    return (float((want.exp() * (want - got)).sum(-1).mean()),
            float((want.argmax(-1) == got.argmax(-1)).float().mean()))


@pytest.fixture
def one_thread():
    """One thread for a token-by-token loop: on a shared machine a second thread waits on the first at
    every one of its ~120 small matmuls a token (minutes instead of seconds when the cores are busy)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.mark.slow
def test_smollm2_default_path_is_the_files_weights_in_fp32(smollm2_path, one_thread):
    """The default CPU path (Q4_1 int4 and the Q8_0 head on localllm's kernels, fp32 activations)
    against the file's weights dequantized to fp32, teacher-forced over 64 tokens: decoded a token a
    step (the one-row kernels), a KL divergence under 2e-4 and the same top-1 at 99.5% of positions,
    a bound the bf16-activation path it replaces (torch's int4 kernel) exceeds on the same tokens; read
    as one window (the prefill's fp32 slices and GEMM), the quality figures' way, the same bound."""
    from localllm.bench.settings import read_text
    from localllm.loaders.load import load_model
    from localllm.runtime.quality import compare

    ref = load_model(str(smollm2_path), device="cpu", quant="fp32")
    ids = torch.tensor([ref.tokenizer.encode(read_text(None)[1])[:64]])
    with torch.inference_mode():
        want = ref.model(ids).float().log_softmax(-1)[0]
    default = load_model(str(smollm2_path), device="cpu")
    assert default.dtype == torch.float32
    assert default.kernels["int4-group-cpu"] == 120 and default.kernels["int8-group-cpu"] == 1
    kld, top1 = kld_top1(want, teacher_forced_decode(default.model, ids))
    assert kld < 2e-4 and top1 >= 0.995, (kld, top1)
    window = compare(ref.model, {"default": default.model}, ids[0].tolist(), window=64)["default"]
    assert window.kld < 2e-4 and window.top1 >= 0.995, window
    del default
    bf16 = load_model(str(smollm2_path), device="cpu", dtype="bf16")
    assert bf16.kernels["int4-tinygemm-cpu"] == 120
    kld_bf16, _ = kld_top1(want, teacher_forced_decode(bf16.model, ids))
    assert kld_bf16 > 2e-4, kld_bf16
