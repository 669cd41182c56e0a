"""The batch engine's compiled decode step (runtime.paged_aot): decode-only steps through AOTInductor
packages give the eager engine's greedy tokens, for one sequence and for batches whose sequences join
and leave; "auto" uses built packages and says when there are none; models and pools the step does
not cover run eagerly and say why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from localllm.loaders.load import load_model
from localllm.runtime import paged_aot
from localllm.runtime.aot import PackageMissing
from localllm.runtime.batch import BatchEngine
from localllm.runtime.compile import compile_unavailable_reason
from localllm.runtime.paged_aot import MAX_BATCH, PagedAotDecode, batch_ranges
from tests.test_batch import BIG, DECIDED, GREEDY, MAX_TOKENS, PROMPTS, assert_same

needs_compiler = pytest.mark.skipif(compile_unavailable_reason(torch.device("cpu")) is not None,
                                    reason="no C++ compiler for AOTInductor")


@pytest.fixture(scope="module")
def fp32(tiny_folder):
    _, folder = tiny_folder("llama")
    return load_model(str(folder), quant="fp32")


@pytest.fixture(scope="module")
def home(tmp_path_factory, monkeypatch_module):
    """A LOCALLLM_HOME of this module's own: packages start missing."""
    folder = tmp_path_factory.mktemp("paged-aot-home")
    monkeypatch_module.setenv("LOCALLLM_HOME", str(folder))
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def counted(engine: BatchEngine) -> list[int]:
    """The batch sizes of the steps that ran through the compiled step, appended as they run."""
    sizes: list[int] = []
    compiled = engine._compiled
    assert compiled is not None

    class Counting:
        def __call__(self, ids, step):  # type: ignore[no-untyped-def]
            sizes.append(step.num_tokens)
            return compiled(ids, step)

        def takes(self, step):  # type: ignore[no-untyped-def]
            return compiled.takes(step)

    engine._compiled = Counting()  # type: ignore[assignment]
    return sizes


def run_mixed(engine: BatchEngine) -> list[list[int]]:
    """Three requests, a few steps, then two more join; different lengths leave at different times."""
    handles = [engine.submit(PROMPTS[i], GREEDY, MAX_TOKENS[i]) for i in range(3)]
    for _ in range(4):
        engine.step()
    handles += [engine.submit(PROMPTS[i], GREEDY, MAX_TOKENS[i]) for i in range(3, 5)]
    engine.run_until_done()
    return [h.result() for h in handles]


def test_batch_ranges_follow_the_kernels_row_thresholds():
    """Kernels pick their path by row count; export bakes the choice in: one package per span."""

    class Kernel:
        GEMV_ROWS = 4

    class Other:
        GEMV_ROWS = 16

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].kernel, model[1].kernel = Kernel, Other
    assert batch_ranges(model) == [(1, 1), (2, 4), (5, 16), (17, MAX_BATCH)]
    model[0].kernel = model[1].kernel = None
    assert batch_ranges(model) == [(1, 1), (2, MAX_BATCH)]


@needs_compiler
def test_auto_without_packages_runs_eagerly_and_says_a_build_is_needed(fp32, home):
    engine = BatchEngine(fp32.model, kv_budget_bytes=BIG, max_running=4, compile="auto")
    assert not engine.compiled and engine.needs_build and engine.compile_note is None
    with pytest.raises(PackageMissing, match="no batch decode step is built"):
        PagedAotDecode(fp32.model, engine.pool, engine.kernel, home / "inductor" / "aot", 4)


@needs_compiler
def test_compiled_steps_give_the_eager_engines_tokens(fp32, home):
    """Built now (compile=True), then found by "auto" in a new engine; one sequence alone and five
    joining and leaving, every greedy token equal to the eager engine's (fp32: decided margins)."""
    built = BatchEngine(fp32.model, kv_budget_bytes=BIG, max_running=4, compile=True)
    assert built.compiled and built.compile_note is None
    engine = BatchEngine(fp32.model, kv_budget_bytes=BIG, max_running=4, compile="auto")
    assert engine.compiled and not engine.needs_build
    sizes = counted(engine)
    eager = BatchEngine(fp32.model, kv_budget_bytes=BIG, max_running=4)
    got, want = run_mixed(engine), run_mixed(eager)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(fp32, PROMPTS[i], g, w)
    assert 1 in sizes and max(sizes) >= 2  # both packages ran: a lone sequence and a batch
    alone = engine.submit(PROMPTS[2], GREEDY, 12)
    engine.run_until_done()
    assert_same(fp32, PROMPTS[2], alone.result(), want[2][:12])


@needs_compiler
def test_an_int8_pool_compiles_and_gives_the_eager_int8_engines_tokens(fp32, home):
    """The step takes an int8 pool's codes and scales, writes new rows quantized as the eager step does,
    and reads them through the int8 paged kernel: the eager int8 engine's tokens, with a package of its
    own (the fp32 pool's does not take int8 tensors)."""
    engine = BatchEngine(fp32.model, kv_budget_bytes=BIG, max_running=4, compile=True, kv_dtype="int8")
    assert engine.compiled and engine.compile_note is None
    fp32_pool = BatchEngine(fp32.model, kv_budget_bytes=BIG, max_running=4, compile=True)
    assert fp32_pool.compiled and set(engine._compiled.paths).isdisjoint(fp32_pool._compiled.paths)
    sizes = counted(engine)
    eager = BatchEngine(fp32.model, kv_budget_bytes=BIG, max_running=4, kv_dtype="int8")
    got, want = run_mixed(engine), run_mixed(eager)
    for i, w in enumerate(want):  # every expected token decided under int8 keys and values, not a near-tie
        cache = fp32.model.new_cache(256, kv_dtype="int8")
        with torch.inference_mode():
            logits = fp32.model(torch.tensor([PROMPTS[i] + w[:-1]]), cache)[0, len(PROMPTS[i]) - 1 :].float()
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min().item() >= DECIDED, "a near-tie in the expectation"
    assert got == want
    assert 1 in sizes and max(sizes) >= 2
    # the pools hold the same codes, each row in its slot, quantized as the eager step does: but for a
    # code in thousands one step off (the compiled step fuses its norms, so its fp32 rows differ in the
    # last bits, and a row at a rounding boundary goes the other way)
    differ = held = 0
    for a, b in zip(engine.pool.k + engine.pool.v, eager.pool.k + eager.pool.v):
        off = (a.codes.int() - b.codes.int()).abs()
        assert off.max() <= 2 and torch.allclose(a.scales, b.scales, rtol=1e-2, atol=0)
        differ, held = differ + int((off > 0).sum()), held + int((b.codes != 0).sum())
    assert held > 10_000 and differ < held / 200, (differ, held)


def test_what_the_step_does_not_cover_runs_eagerly_and_says_why(fp32, tiny_folder):
    sdpa = BatchEngine(fp32.model, kv_budget_bytes=BIG, compile="auto", attention="sdpa")
    assert not sdpa.compiled and "paged attention kernel" in sdpa.compile_note
    assert paged_aot.unsupported(fp32.model, sdpa.pool, None) is not None
