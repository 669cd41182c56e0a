"""The kernel choice (quant/kernels.py): each CPU kernel against the reference, the automatic and the
forced choice per device and activation dtype, a kernel that disagrees with the reference dropped, the
one-line warnings and reasons when the slow reference runs, and the CUDA kernels on a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from localllm import native
from localllm.quant import kernels
from localllm.quant.formats import dequantize, quantize
from localllm.quant.linear import QuantLinear, prepare_model
from tests.test_formats import rand_weight, scheme_of


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Fallback warnings are given once a process: each test starts with none given."""
    monkeypatch.setattr(kernels, "WARNED", set())


def make_layer(name, group, out=192, inp=576, bias=False, device="cpu"):
    scheme = scheme_of(name, group)
    layer = QuantLinear(inp, out, scheme, bias=bias)
    w = rand_weight(out, inp, seed=3)
    for k, v in quantize(w, scheme).items():
        setattr(layer, k, v.to(device))
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(out, device=device) * 0.1)
    return layer, w


HAS_NATIVE = native.compiler() is not None  # localllm's C++ CPU kernels can be built here
needs_native = pytest.mark.skipif(not HAS_NATIVE, reason="no C++ compiler for localllm's CPU kernels")
KERNEL_CASES = [("int4-tinygemm-cpu", "int4", 32), ("int4-tinygemm-cpu", "int4", 128),
                pytest.param("int4-group-cpu", "int4", 32, marks=needs_native),
                pytest.param("int4-group-cpu", "int4", 128, marks=needs_native),
                ("int8-weight-only", "int8", None),
                pytest.param("int8-group-cpu", "int8", 32, marks=needs_native),
                pytest.param("int8-group-cpu", "int8", 64, marks=needs_native),
                ("nf4-bitsandbytes", "nf4", 64),
                ("reference", "int4", 64), ("reference", "int8", 32), ("reference", "nf4", 64)]


@pytest.mark.parametrize("kernel,name,group", KERNEL_CASES)
def test_cpu_kernels_match_the_reference(kernel, name, group):
    inp = 512 if group == 128 else 576
    layer, _ = make_layer(name, group, inp=inp, bias=True)
    want_w = dequantize(layer.canonical(), layer.scheme)
    bias = layer.bias.detach().clone()
    assert layer.prepare(torch.bfloat16, kernel) == kernel
    x = torch.randn(5, 3, inp) * 0.5
    want = x @ want_w.t() + bias
    got = layer(x.to(torch.bfloat16)).float()
    assert got.shape == (5, 3, 192)
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-2, rel


def test_automatic_choice_on_cpu_is_the_fast_kernel():
    for name, group, want in [("int4", 32, "int4-tinygemm-cpu"), ("int8", None, "int8-weight-only"),
                              ("nf4", 64, "nf4-bitsandbytes"),
                              ("int8", 32, "int8-group-cpu" if HAS_NATIVE else "reference")]:
        layer, _ = make_layer(name, group)
        assert layer.prepare(torch.bfloat16) == want


@needs_native
def test_automatic_choice_on_cpu_with_fp32_activations_is_localllms_kernels():
    """fp32 activations (the CPU's default): int4 and int8 (grouped or per channel) on localllm's C++
    kernels, which multiply the exact weights in fp32, not on the reference."""
    for name, group, want in [("int4", 32, "int4-group-cpu"), ("int4", 128, "int4-group-cpu"),
                              ("int8", None, "int8-group-cpu"), ("int8", 32, "int8-group-cpu"),
                              ("nf4", 64, "nf4-bitsandbytes")]:
        layer, _ = make_layer(name, group, inp=512 if group == 128 else 576)
        assert layer.prepare(torch.float32) == want, (name, group)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_int8_kernel_computes_with_the_exact_weights(dtype):
    """q * scale is exact in fp32, so with fp32 activations the grouped kernel is the fp32 product with
    the dequantized weights up to summation order; one row or many."""
    layer, _ = make_layer("int8", 32, out=96, inp=320)
    w = dequantize(layer.canonical(), layer.scheme)
    assert layer.prepare(dtype) == "int8-group-cpu"
    for rows in (1, 7):
        x = (torch.randn(rows, 320) * 0.5).to(dtype)
        want = x.double() @ w.double().t()
        got = layer(x).double()
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # fp32 sums; bf16 output rounding
        assert ((got - want).abs() / want.abs().max()).max() < tol


def test_a_forced_kernel_leaves_layers_it_cannot_run_to_the_automatic_choice():
    """``--kernel int4-tinygemm-cpu`` on a model whose head is int8: the head gets its own kernel."""
    layer, _ = make_layer("int8", None)
    assert layer.prepare(torch.bfloat16, "int4-tinygemm-cpu") == "int8-weight-only"
    layer, _ = make_layer("int4", 32)
    assert layer.prepare(torch.bfloat16, "reference") == "reference"  # honoured where it can run


def test_kernel_layout_replaces_the_canonical_buffers():
    layer, _ = make_layer("int4", 32)
    layer.prepare(torch.bfloat16)
    names = {n for n, _ in layer.named_buffers()}
    assert "qweight" not in names and "offsets" not in names and {"packed", "scales_zeros"} <= names


def test_a_disagreeing_kernel_is_dropped(monkeypatch):
    """A kernel that computes garbage on some build falls back to the next choice, with a warning."""
    layer, _ = make_layer("int4", 32)
    monkeypatch.setattr(kernels.Int4TinygemmCPU, "matmul", staticmethod(lambda layer, x: torch.zeros(
        x.shape[0], layer.out_features, dtype=x.dtype)))
    with pytest.warns(UserWarning, match="disagrees"):
        assert layer.prepare(torch.bfloat16) == ("int4-group-cpu" if HAS_NATIVE else "reference")


def test_the_check_of_a_large_layer_samples_rows_up_to_the_last_block(monkeypatch):
    """The reference computes only a sample of a head's rows: a layout wrong in the last 64-row block
    of a 4096-row layer is still caught."""
    layer, _ = make_layer("int4", 32, out=4096)
    real = kernels.Int4TinygemmCPU.matmul

    def wrong_tail(layer, x):
        y = real(layer, x)
        y[:, -64:] = y[:, -64:].flip(-1)
        return y

    monkeypatch.setattr(kernels.Int4TinygemmCPU, "matmul", staticmethod(wrong_tail))
    with pytest.warns(UserWarning, match="disagrees"):
        assert layer.prepare(torch.bfloat16) == ("int4-group-cpu" if HAS_NATIVE else "reference")


def test_a_model_checks_each_kernel_once_per_layer_shape(monkeypatch):
    layers = torch.nn.ModuleList([make_layer("int4", 32)[0] for _ in range(3)]
                                 + [make_layer("int4", 32, out=64)[0] for _ in range(2)])
    checked = []
    real = kernels.agrees_with_reference
    monkeypatch.setattr(kernels, "agrees_with_reference",
                        lambda layer, k, t: checked.append((layer.out_features, k.name)) or real(layer, k, t))
    assert prepare_model(layers, torch.bfloat16) == {"int4-tinygemm-cpu": 5}
    assert sorted(checked) == [(64, "int4-tinygemm-cpu"), (192, "int4-tinygemm-cpu")]
    x = torch.randn(2, 576, dtype=torch.bfloat16)
    for layer in layers:  # every layer, checked or not, multiplies right
        w = make_layer("int4", 32, out=layer.out_features)[1]  # the same seeded weight
        want = x.float() @ dequantize(quantize(w, layer.scheme), layer.scheme).t()
        assert ((layer(x).float() - want).norm() / want.norm()) < 1e-2


def test_a_disagreeing_kernel_is_dropped_for_every_layer_of_its_shape_with_one_warning(monkeypatch):
    layers = torch.nn.ModuleList([make_layer("int4", 32)[0] for _ in range(3)])
    monkeypatch.setattr(kernels.Int4TinygemmCPU, "matmul", staticmethod(lambda layer, x: torch.zeros(
        x.shape[0], layer.out_features, dtype=x.dtype)))
    with pytest.warns(UserWarning, match="disagrees") as caught:
        assert prepare_model(layers, torch.bfloat16) == {"int4-group-cpu" if HAS_NATIVE else "reference": 3}
    assert len([w for w in caught if "disagrees" in str(w.message)]) == 1


def fallback_warnings(caught):
    return [str(w.message) for w in caught if "slow reference" in str(w.message)]


def test_a_fallback_to_the_reference_is_one_line_a_process_naming_scheme_and_reason(monkeypatch):
    """int4 with fp32 activations on the CPU without localllm's C++ kernels: tinygemm needs bf16, so
    every layer runs the reference, and the model says so once (not once a layer, nor again for the
    next model)."""
    import warnings

    monkeypatch.setattr(native, "available", lambda lib, cache_dir=None: False)
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no C++ compiler")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers = torch.nn.ModuleList([make_layer("int4", 32)[0] for _ in range(3)])
        assert prepare_model(layers, torch.float32) == {"reference": 3}
        assert prepare_model(torch.nn.ModuleList([make_layer("int4", 32)[0]]), torch.float32) == {"reference": 1}
        # per-channel int8 has a kernel for fp32 activations: no warning
        assert make_layer("int8", None)[0].prepare(torch.float32) == "int8-weight-only"
        # asked for by name: the reference is no surprise
        assert make_layer("int4", 64)[0].prepare(torch.bfloat16, "reference") == "reference"
    assert fallback_warnings(caught) == [
        "int4 (group 32, asymmetric) layers run on the slow reference kernel (it dequantizes the weight at every "
        "call): int4-tinygemm-cpu needs bfloat16 activations, not float32; int4-group-cpu needs localllm's CPU "
        "kernels, which could not be built (no C++ compiler)"]


def test_grouped_int8_without_the_cpp_library_says_why(monkeypatch):
    import warnings

    monkeypatch.setattr(native, "available", lambda lib, cache_dir=None: False)
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no C++ compiler")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert make_layer("int8", 32)[0].prepare(torch.bfloat16) == "reference"
    assert fallback_warnings(caught) == [
        "int8 (group 32) layers run on the slow reference kernel (it dequantizes the weight at every call): "
        "int8-group-cpu needs localllm's CPU kernels, which could not be built (no C++ compiler); int8-weight-only "
        "needs one scale per output channel, not per group"]


def test_reasons_the_gpu_kernels_give(monkeypatch):
    """Without a GPU: what an sm75 card, or grouped int8 on CUDA, would be told."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    cuda = torch.device("cuda")
    layer = make_layer("int4", 32)[0]
    triton = "needs a GPU of compute capability 8.0 or newer for bfloat16 activations (this one has 7.5)"
    assert kernels.why_not_fast(layer, cuda, torch.bfloat16) == [
        f"int4-triton-cuda {triton}", "int4-tinygemm-cuda needs a GPU of compute capability 8.0 or newer (this one has 7.5)"]
    assert kernels.why_not_fast(make_layer("int8", 32)[0], cuda, torch.bfloat16) == [
        f"int8-triton-cuda {triton}", "int8-weight-only needs one scale per output channel, not per group"]
    assert kernels.why_not_fast(make_layer("int8", None)[0], cuda, torch.bfloat16) == [
        f"int8-triton-cuda {triton}"]  # int8-weight-only runs it
    # fp16 activations on that card: the Triton kernels run int4 and grouped int8 (nothing to say)
    assert kernels.candidates(layer, cuda, torch.float16)[0].name == "int4-triton-cuda"
    assert kernels.candidates(make_layer("int8", 32)[0], cuda, torch.float16)[0].name == "int8-triton-cuda"


def test_int4_repacked_in_slices_is_the_layout_of_the_whole():
    layer = make_layer("int4", 32, out=320)[0]
    whole = kernels.Int4TinygemmCPU.prepare(layer, rows=1 << 20)
    sliced = kernels.Int4TinygemmCPU.prepare(layer, rows=64)
    assert torch.equal(whole["packed"], sliced["packed"])


@pytest.mark.parametrize("name,group", [("int4", 32), ("int8", None), ("int8", 32), ("nf4", 64)])
def test_reference_by_slices_of_rows_equals_the_whole_weight(name, group):
    layer = make_layer(name, group, out=200)[0]
    x = torch.randn(3, 576)
    whole = x @ dequantize(layer.canonical(), layer.scheme).t()
    torch.testing.assert_close(kernels.reference_linear(layer.canonical(), layer.scheme, x, rows=64), whole)


NO_BNB = importlib.util.find_spec("bitsandbytes") is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel,name,group,inp", [
    ("int4-triton-cuda", "int4", 32, 4096), ("int4-triton-cuda", "int4", 128, 4096),
    ("int4-triton-cuda", "int4", 32, 576), ("int4-tinygemm-cuda", "int4", 32, 4096),
    ("int4-tinygemm-cuda", "int4", 32, 576),  # 576: k-tiles packed by 4
    ("int8-triton-cuda", "int8", None, 4096), ("int8-triton-cuda", "int8", 64, 4096),
    ("int8-weight-only", "int8", None, 4096),
    pytest.param("nf4-bitsandbytes", "nf4", 64, 4096,
                 marks=pytest.mark.skipif(NO_BNB, reason="bitsandbytes is not installed here"))])
def test_cuda_kernels_match_the_reference(kernel, name, group, inp):
    layer, _ = make_layer(name, group, out=4096, inp=inp, device="cuda")
    want_w = dequantize(layer.canonical(), layer.scheme)
    assert layer.prepare(torch.bfloat16, kernel) == kernel
    x = torch.randn(4, inp, device="cuda")
    want = x.cpu() @ want_w.cpu().t()
    got = layer(x.to(torch.bfloat16)).float().cpu()
    assert (got - want).norm() / want.norm() < 1e-2

