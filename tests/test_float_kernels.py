"""The ``bf16-rows-cpu`` and ``fp16-rows-cpu`` kernels (quant/float_kernels.py, csrc/float_mm.cpp): 16-bit
float weights as stored, by fp32, bf16 or fp16 activations with fp32 sums.

``localllm::float_mm`` is held to ``F.linear`` in fp32 math on the same (widened) weights: within fp32
summation rounding for fp32 activations, and within one rounding of the output for 16-bit ones, for
each of its paths this CPU runs (portable, AVX2 + F16C, AVX-512; ``tests/test_isa.py`` narrows them by
``ATEN_CPU_CAPABILITY``), at shapes whose widths leave remainders of every vector width. A float model
on the CPU holds its linears in the kernel (the tied head serving as the embedding), and its compiled
decode step gives the eager step's logits, as does an int8 model's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from localllm import native
from localllm.loaders.load import load_model
from localllm.quant import kernels
from localllm.quant.float_kernels import FLOAT_PORTABLE, FloatRowsCPU
from localllm.quant.formats import QuantScheme
from localllm.quant.linear import QuantLinear, TiedHeadEmbedding
from localllm.runtime import compiled_step
from localllm.runtime.batch import BatchEngine

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler for localllm's CPU kernels")

WEIGHTS = (torch.bfloat16, torch.float16)
ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
#: (M, K, N): one row and a decode batch; K with remainders past 16 and 8 columns; N past 4 rows.
SHAPES = ((1, 576, 67), (2, 200, 21), (3, 40, 19), (4, 7, 5), (5, 131, 33), (9, 64, 16))
#: Relative error (norm) against fp32 math: fp32 sums in another order, or one rounding of the output.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def paths() -> list[int]:
    """The paths this CPU and build run (``csrc/float_mm.cpp``'s ``Isa``), narrowest first."""
    assert native.available(kernels.LIBRARY)
    return list(range(torch.ops.localllm.float_isa() + 1))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("wdtype", WEIGHTS)
@pytest.mark.parametrize("xdtype", ACTIVATIONS)
def test_every_path_is_f_linear_in_fp32_math(wdtype, xdtype):
    g = torch.Generator().manual_seed(0)
    for M, K, N in SHAPES:
        w = torch.randn(N, K, generator=g).to(wdtype)
        x = torch.randn(M, K, generator=g).to(xdtype)
        want = F.linear(x.double(), w.double())
        for isa in paths():
            got = torch.ops.localllm.float_mm_isa(x, w, isa)
            assert got.dtype == xdtype and got.shape == (M, N)
            assert rel_err(got, want) < TOLERANCE[xdtype], (isa, M, K, N)
            # each output alone: no row borrows another's sums (a wrong tail or a swapped row shows)
            assert rel_err(got[:, -1], want[:, -1]) < TOLERANCE[xdtype] * 4, (isa, M, K, N)
        assert rel_err(torch.ops.localllm.float_mm(x, w), want) < TOLERANCE[xdtype]  # the widest path


def test_the_paths_agree_and_a_path_beyond_the_cpu_is_refused():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(37, 200, generator=g).bfloat16()
    x = torch.randn(2, 200, generator=g)
    base = torch.ops.localllm.float_mm_isa(x, w, FLOAT_PORTABLE)
    for isa in paths():
        assert (torch.ops.localllm.float_mm_isa(x, w, isa) - base).abs().max().item() < 1e-4
    with pytest.raises(RuntimeError, match="not one this CPU"):
        torch.ops.localllm.float_mm_isa(x, w, paths()[-1] + 1)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        torch.ops.localllm.float_mm(x, w.float())


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_a_float_layer_takes_the_kernel_for_few_rows_and_the_panels_for_more(name):
    """prepare() picks the scheme's row kernel (checked against the reference), and the layer's product
    is the fp32 product of its weights through the row kernel up to GEMV_ROWS rows and the panel GEMM
    above (an fp16 layer under bf16 activations: its weights widened to fp32, never rounded to bf16)."""
    torch.manual_seed(0)
    scheme = QuantScheme(name)
    layer = QuantLinear(96, 50, scheme)
    w = torch.randn(50, 96).to(layer.weight.dtype)
    layer.weight = w
    assert layer.prepare(torch.bfloat16) == f"{name}-rows-cpu"
    assert layer.weight is w  # the stored weight is the kernel's layout: nothing is copied
    for rows in (1, FloatRowsCPU.GEMV_ROWS, FloatRowsCPU.GEMV_ROWS + 3):
        x = torch.randn(rows, 96).bfloat16()
        assert rel_err(layer(x), F.linear(x.double(), w.double())) < TOLERANCE[torch.bfloat16], rows


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
def test_many_rows_run_in_fp32_panels_unless_torch_multiplies_bf16_natively(onednn, wdtype, monkeypatch):
    """A prefill's product: torch's bf16 GEMM where x and the weight are bf16 and torch has a native
    bf16 GEMM (oneDNN on AVX-512); else the fp32 panels, which widen an fp16 weight exactly (never
    to bf16). Either is the fp32 product within one rounding to x's dtype."""
    from localllm.quant import float_kernels

    monkeypatch.setattr(float_kernels, "torch_bf16_gemm", lambda: onednn)
    calls = []
    real = float_kernels.F.linear
    monkeypatch.setattr(float_kernels.F, "linear", lambda x, w: calls.append(w.dtype) or real(x, w))
    torch.manual_seed(0)
    x, w = torch.randn(40, 96).bfloat16(), torch.randn(70, 96).to(wdtype)
    got = float_kernels.many_rows(x, w)
    native = onednn and wdtype == torch.bfloat16
    assert got.dtype == torch.bfloat16 and calls == ([torch.bfloat16] if native else [])
    assert rel_err(got, F.linear(x.double(), w.double())) < TOLERANCE[torch.bfloat16]
    if not native:  # the panels sum in fp32: fp32 activations get the fp32 product
        xf = x.float()
        assert rel_err(float_kernels.many_rows(xf, w), F.linear(xf.double(), w.double())) < TOLERANCE[torch.float32]


@pytest.fixture(scope="module")
def tied_folder(tiny_folder):
    return tiny_folder("llama", tie_word_embeddings=True)[1]


@pytest.fixture(scope="module")
def fp16_model(tied_folder):
    return load_model(str(tied_folder), quant="fp16", device="cpu")


def test_a_16bit_model_on_the_cpu_runs_its_linears_through_the_kernels(tied_folder, fp16_model):
    """--quant fp16 on the CPU: fp16 weights, fp32 activations, every linear (head included) on the
    kernel, the tied head's weight serving as the embedding (held once); logits near the fp32 model's."""
    lm = fp16_model
    assert lm.scheme_label == "fp16" and lm.dtype == torch.float32
    linears = sum(1 for m in lm.model.modules() if isinstance(m, QuantLinear))
    assert lm.kernels["fp16-rows-cpu"] == linears and linears > 0
    assert lm.model.output.weight.dtype == torch.float16 and isinstance(lm.model.embed, TiedHeadEmbedding)
    fp32 = load_model(str(tied_folder), quant="fp32", device="cpu")
    tokens = torch.tensor([[1, 17, 42, 99, 5, 7]])
    with torch.no_grad():
        got, want = lm.model(tokens).float(), fp32.model(tokens).float()
    assert rel_err(got, want) < 3e-2 and want.std() > 0.1
    bf16 = load_model(str(tied_folder), quant="bf16", device="cpu")
    assert bf16.kernels["bf16-rows-cpu"] == linears and bf16.scheme_label == "bf16"


@pytest.mark.parametrize("scheme", ["bf16", "fp16"])
def test_an_untied_16bit_model_holds_its_embedding_in_16_bits(tiny_folder, scheme):
    """Untied, the embedding table is not a linear: it is held in the scheme's dtype apart from the fp32
    activations (a row widened as it is looked up), so every weight of the model takes two bytes."""
    model, folder = tiny_folder("llama")
    lm = load_model(str(folder), quant=scheme, device="cpu")
    dtype = torch.bfloat16 if scheme == "bf16" else torch.float16
    assert lm.dtype == torch.float32 and lm.model.embed.weight.dtype == lm.model.output.weight.dtype == dtype
    assert torch.equal(lm.model.embed.weight, model.model.embed_tokens.weight.detach().to(dtype))
    floats = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert lm.weight_bytes == 2 * floats + 4 * norms
    tokens = torch.tensor([[1, 17, 42, 99, 5, 7]])
    with torch.no_grad():
        got, want = lm.model(tokens), model(tokens).logits
    assert got.dtype == torch.float32 and rel_err(got, want) < 3e-2 and want.std() > 0.1


needs_compiler = pytest.mark.skipif(compiled_step.compile_unavailable_reason(torch.device("cpu")) is not None,
                                    reason="no C++ compiler for AOTInductor")


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """A LOCALLLM_HOME of the test's own: packages start missing."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return tmp_path


def compiled_matches_eager(model) -> None:  # type: ignore[no-untyped-def]
    """A lone sequence's compiled decode steps (built now: one package, batches of 1) give the eager
    steps' logits, teacher-forced on the same tokens."""
    budget = 8 << 20
    compiled = BatchEngine(model, kv_budget_bytes=budget, max_running=1, compile=True, speculate=False)
    assert compiled.compiled and compiled.compile_note is None
    eager = BatchEngine(model, kv_budget_bytes=budget, max_running=1, speculate=False)
    prompt, fed = [1, 17, 42, 99, 5], [7, 300, 12, 64, 8, 250]
    got, want = compiled.forced_logits(prompt, fed), eager.forced_logits(prompt, fed)
    assert want.std() > 0.1
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@needs_compiler
def test_an_fp16_models_compiled_decode_step_gives_the_eager_logits(fp16_model, home):
    compiled_matches_eager(fp16_model.model)


@needs_compiler
def test_an_int8_models_compiled_decode_step_gives_the_eager_logits(tied_folder, home):
    lm = load_model(str(tied_folder), quant="int8", device="cpu")
    assert "reference" not in lm.kernels and any(k.startswith("int8-") for k in lm.kernels)  # inside the step
    compiled_matches_eager(lm.model)


@needs_compiler
def test_an_fp16_models_step_for_many_sequences_exports_its_panel_products(fp16_model, home):
    """Above GEMV_ROWS sequences a 16-bit layer takes the panel GEMM, its weight viewed as bytes (GGUF
    F16 rows): the compiled step's package for those batches exports and compiles with that view."""
    engine = BatchEngine(fp16_model.model, kv_budget_bytes=8 << 20, max_running=1, speculate=False)
    ranges = compiled_step.batch_ranges(fp16_model.model)
    assert (2, FloatRowsCPU.GEMV_ROWS) in ranges  # the row kernel's batches, then the panels'
    lo, hi = next(r for r in ranges if r[0] > FloatRowsCPU.GEMV_ROWS)
    path = home / "many.pt2"
    compiled_step.build_package(fp16_model.model, engine.pool, engine.runner.kernel, path, (lo, min(hi, 32)))
    assert compiled_step.load_runner(path) is not None
