"""The batch engine's compiled decode step (runtime.compiled_step): decode-only steps through AOTInductor
packages give the eager engine's tokens, for one sequence and for batches whose sequences join and
leave, over fp32 and int8 pools and over a sliding-window model's layer groups (before and after the
window wraps); "auto" uses built packages and says when there are none; a failed build says why and
is not started again; what the step does not cover runs eagerly and says why; a first run builds the
step in the background for the next."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch import nn

from localllm.loaders.load import load_model
from localllm.quant import kernels
from localllm.runtime import compiled_step
from localllm.runtime.batch import BatchEngine
from localllm.runtime.compiled_step import MAX_BATCH, CompiledDecode, PackageMissing, batch_ranges
from localllm.runtime.speculate import MAX_DRAFT
from tests.engines import GREEDY
from tests.test_batch import BIG, DECIDED, MAX_TOKENS, PROMPTS, assert_same

needs_compiler = pytest.mark.skipif(compiled_step.compile_unavailable_reason(torch.device("cpu")) is not None,
                                    reason="no C++ compiler for AOTInductor")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def home(tmp_path_factory, monkeypatch_module):
    """A LOCALLLM_HOME of this module's own: packages start missing."""
    folder = tmp_path_factory.mktemp("compiled-step-home")
    monkeypatch_module.setenv("LOCALLLM_HOME", str(folder))
    monkeypatch_module.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return folder


@pytest.fixture(scope="module")
def gemma(tiny_folder):
    """A tiny Gemma 3: sliding layers with a window of 8 beside a full-context one (four layer groups in
    the paged pool), local and global RoPE bases, Gemma's norms and embedding scale."""
    _, folder = tiny_folder("gemma3", sliding_window=8, num_hidden_layers=4, head_dim=16, pad_token_id=0,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                         "sliding_attention"])
    return load_model(str(folder), quant="fp32")


def counted(engine: BatchEngine) -> list[int]:
    """The batch sizes of the steps that ran through the compiled step, appended as they run."""
    sizes: list[int] = []
    compiled = engine.runner.compiled
    assert compiled is not None

    class Counting:
        def __call__(self, ids, step):  # type: ignore[no-untyped-def]
            sizes.append(step.num_tokens)
            return compiled(ids, step)

        def takes(self, step):  # type: ignore[no-untyped-def]
            return compiled.takes(step)

    engine.runner.compiled = Counting()  # type: ignore[assignment]
    return sizes


def run_mixed(engine: BatchEngine, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    """Three requests, a few steps, then two more join; different lengths leave at different times."""
    handles = [engine.submit(prompts[i], GREEDY, max_tokens[i]) for i in range(3)]
    for _ in range(4):
        engine.step()
    handles += [engine.submit(prompts[i], GREEDY, max_tokens[i]) for i in range(3, 5)]
    engine.run_until_done()
    return [h.result() for h in handles]


def margins(engine: BatchEngine, prompt: list[int], tokens: list[int]) -> float:
    """The narrowest best-minus-second logit of ``tokens`` after ``prompt``, teacher-forced through
    ``engine`` (its pool's kind decides what "decided" means)."""
    if not tokens:
        return float("inf")
    top2 = engine.forced_logits(prompt, tokens[:-1]).topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).min().item()


def test_batch_ranges_follow_the_kernels_row_thresholds():
    """Kernels pick their path by row count; export bakes the choice in: one package per span."""

    class Kernel(kernels.Kernel):
        GEMV_ROWS = 4

    class Other(kernels.Kernel):
        GEMV_ROWS = 16

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].kernel, model[1].kernel = Kernel, Other
    assert batch_ranges(model) == [(1, 1), (2, 4), (5, 16), (17, MAX_BATCH)]
    model[0].kernel = model[1].kernel = None
    assert batch_ranges(model) == [(1, 1), (2, MAX_BATCH)]
    # A GGUF layer repacked into tiles (Gemma 3's Q5_0, Q4_K, Q6_K) takes the tile kernels' rows, not
    # the block kernel's: cut at the file's blocks' 16 alone, its 2-8 row package failed to export.
    model[0].kernel = model[1].kernel = kernels.GGUFBlocksCPU
    model[0].layout = model[1].layout = kernels.BLOCKS_LAYOUT
    assert batch_ranges(model) == [(1, 1), (2, 16), (17, MAX_BATCH)]
    model[1].layout = kernels.INT5_TILES
    assert batch_ranges(model) == [(1, 1), (2, kernels.Int4GroupCPU.GEMV_ROWS),
                                   (kernels.Int4GroupCPU.GEMV_ROWS + 1, 16), (17, MAX_BATCH)]


@needs_compiler
def test_auto_without_packages_runs_eagerly_and_says_a_build_is_needed(tiny_fp32, home):
    engine = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=4, compile="auto")
    assert not engine.compiled and engine.needs_build and engine.compile_note is None
    with pytest.raises(PackageMissing, match="no decode step is built"):
        CompiledDecode(tiny_fp32.model, engine.pool, engine.kernel, 4)


@needs_compiler
def test_compiled_steps_give_the_eager_engines_tokens(tiny_fp32, home):
    """Built now (compile=True), then found by "auto" in a new engine; one sequence alone and five
    joining and leaving, every greedy token equal to the eager engine's (fp32: decided margins). The
    build changed no process-wide setting and left code only (no weights) in a package."""
    import torch._inductor.config as inductor_config

    casts = inductor_config.emulate_precision_casts
    built = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=4, compile=True)
    assert built.compiled and built.compile_note is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and inductor_config.emulate_precision_casts == casts
    packages = list((home / "inductor" / "aot").glob("paged-decode-*.pt2"))
    assert len(packages) == 2 and all(p.stat().st_size < 20e6 for p in packages)  # batch 1, and 2 on
    # one token per step here (the packages' batch sizes are what is checked); speculation below
    engine = BatchEngine(tiny_fp32.model, kv_budget_bytes=2 * BIG, max_running=4, compile="auto", speculate=False)
    assert engine.compiled and not engine.needs_build  # another pool size
    sizes = counted(engine)
    eager = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=4, speculate=False)
    got, want = run_mixed(engine), run_mixed(eager)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(tiny_fp32, PROMPTS[i], g, w)
    assert 1 in sizes and max(sizes) >= 2  # both packages ran: a lone sequence and a batch
    # Verify steps (a decode token and its draft per sequence: more rows than sequences) run through
    # the batch package too, and keep the tokens.
    from tests.test_speculate import Flat

    spec = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=4, compile="auto")
    spec.costs = Flat()
    verify_sizes = counted(spec)
    for i, g in enumerate(run_mixed(spec)):
        assert_same(tiny_fp32, PROMPTS[i], g, want[i])
    assert spec.verify_steps > 0 and spec.accepted_tokens > 0 and max(verify_sizes) > 4
    alone = engine.submit(PROMPTS[2], GREEDY, 12)
    engine.run_until_done()
    assert_same(tiny_fp32, PROMPTS[2], alone.result(), want[2][:12])
    # With the batch package not built (yet), the lone-sequence one still serves: a server whose
    # --parallel build is running decodes a single stream compiled, and says a build would serve.
    batch_package = max(packages, key=lambda p: p.name)  # ...-b2-1024.pt2
    aside = batch_package.rename(batch_package.with_suffix(".aside"))
    try:
        partial = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=4, compile="auto", speculate=False)
        assert partial.compiled and partial.needs_build
        sizes = counted(partial)
        run_mixed(partial)
        assert set(sizes) == {1}
        # A lone stream wants that package too when it speculates (its verify steps' rows would run
        # eagerly), and a background build for it covers them; without speculation it wants none.
        lone = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=1, compile="auto")
        assert lone.compiled and lone.needs_build and lone.build_batch == 1 + MAX_DRAFT
        plain = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=1, compile="auto", speculate=False)
        assert plain.compiled and not plain.needs_build and plain.build_batch == 1
    finally:
        aside.rename(batch_package)


@needs_compiler
def test_an_int8_pool_compiles_and_gives_the_eager_int8_engines_tokens(tiny_fp32, home):
    """The step takes an int8 pool's codes and scales, writes new rows quantized as the eager step does,
    and reads them through the int8 paged kernel: the eager int8 engine's tokens, with a package of its
    own (the fp32 pool's does not take int8 tensors)."""
    # speculate=False in engines whose step shapes are asserted: whether a step drafts follows the
    # step times this machine measures
    engine = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=4, compile=True, kv_dtype="int8",
                         speculate=False)
    assert engine.compiled and engine.compile_note is None
    fp32_pool = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=4, compile="auto")
    assert fp32_pool.compiled and set(engine.runner.compiled.paths).isdisjoint(fp32_pool.runner.compiled.paths)
    sizes = counted(engine)
    eager = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, max_running=4, kv_dtype="int8")
    got, want = run_mixed(engine), run_mixed(eager)
    judge = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, kv_dtype="int8")
    for i, w in enumerate(want):  # every expected token decided under int8 keys and values, not a near-tie
        assert margins(judge, PROMPTS[i], w) >= DECIDED, "a near-tie in the expectation"
    assert got == want
    assert 1 in sizes and max(sizes) >= 2


@needs_compiler
def test_a_sliding_window_model_compiles_and_decodes_as_eager(gemma, home):
    """Gemma 3's sliding layers: each layer group's block table enters the step and the paged kernel
    reads each query's last 8 keys, so one package serves every length: the eager engine's tokens in a
    batch whose contexts are within the window, at it and far past it (blocks given back on the way),
    at two context lengths; teacher-forced, the compiled logits stay at fp32 rounding of eager's."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [7, 8, 9, 10, 11, 12], PROMPTS[4]]  # 3 to 40 tokens
    lengths = [20, 7, 30, 12, 25]
    engine = BatchEngine(gemma.model, kv_budget_bytes=BIG, max_running=4, compile=True, speculate=False)
    assert engine.compiled and engine.compile_note is None and len(engine.plan.windows) == 4
    sizes = counted(engine)
    eager = BatchEngine(gemma.model, kv_budget_bytes=BIG, max_running=4)
    got, want = run_mixed(engine, prompts, lengths), run_mixed(eager, prompts, lengths)
    for i, w in enumerate(want):
        assert margins(eager, prompts[i], w) >= DECIDED, "a near-tie in the expectation"
    assert got == want and 1 in sizes and max(sizes) >= 2
    long = BatchEngine(gemma.model, kv_budget_bytes=BIG, max_seq_len=200, compile="auto")
    assert long.compiled
    prompt, fed = PROMPTS[3], PROMPTS[2][:30]  # 64 + 30 positions: the window wrapped many times over
    a, b = long.forced_logits(prompt, fed), eager.forced_logits(prompt, fed)
    assert (a - b).abs().max().item() < 1e-4 and b.std() > 0.1
    assert long.usage()["blocks_used"] == 0 and long.blocks.num_used == 0


@needs_compiler
@pytest.mark.slow
def test_compiled_int4_decode_picks_the_eager_tokens_on_smollm2(smollm2_path, home):
    """64 greedy tokens on each prompt, both steps fed eager's tokens (every step compared, not only those
    before a first difference): the compiled step picks eager's token at every step and its logits stay
    within rounding of eager's. The one allowance is a tie: where eager's top two are within a
    rounding of each other, a fused reduction summed in another order may reverse them. The rounding:
    a fused op's fp32 order moves an activation by an ulp, and where that crosses half an int16 step of
    the decode kernels' activations (tile_mm.cpp) the value moves by a step (2^-16 of its 32 columns'
    largest), which 30 layers carry to the logits at about 1e-2."""
    lm = load_model(str(smollm2_path), quant="int4")
    assert lm.kernels["attention-cpu"] == 30  # eager and compiled attend with the same kernel
    compiled = BatchEngine(lm.model, kv_budget_bytes=64 << 20, max_running=1, compile=True)
    eager = BatchEngine(lm.model, kv_budget_bytes=64 << 20, max_running=1)
    assert compiled.compiled
    ties = 0
    for text in ("The history of bridges begins", "def fibonacci(n):", "Paris is the capital of"):
        prompt = lm.tokenizer.encode(text)
        tokens = eager.submit(prompt, GREEDY, 64).result()
        assert len(tokens) == 64
        want, got = eager.forced_logits(prompt, tokens[:-1]), compiled.forced_logits(prompt, tokens[:-1])
        assert (want - got).abs().max().item() < 3e-2, (want - got).abs().max()
        for i, (w, g) in enumerate(zip(want, got)):
            pick = int(g.argmax())
            if pick != tokens[i]:
                assert w.max() - w[pick] <= 3e-2, (text, i, pick, tokens[i], w.topk(2))
                ties += 1
    assert ties <= 3


def test_what_the_step_does_not_cover_runs_eagerly_and_says_why(tiny_fp32, monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))  # nothing built: compile=True would have to build
    sdpa = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, compile="auto", attention="sdpa")
    assert not sdpa.compiled and "paged attention kernel" in sdpa.compile_note and not sdpa.needs_build
    monkeypatch.setattr(compiled_step.native, "compiler", lambda: None)
    assert "C++ compiler" in compiled_step.compile_unavailable_reason(torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said in the note, not warned
        none = BatchEngine(tiny_fp32.model, kv_budget_bytes=BIG, compile=True)
    assert not none.compiled and "C++ compiler" in none.compile_note


def test_a_failed_build_says_why_and_is_not_started_again(tiny_folder, monkeypatch, tmp_path):
    """`localllm compile` whose export fails: one line naming the cause, exit 1, and a record that keeps
    runs from starting the same build in the background after every reply."""
    from click.testing import CliRunner

    from localllm.cli import main

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    _, folder = tiny_folder("llama")

    def broken_export(*a, **k):
        raise RuntimeError("export exploded")

    monkeypatch.setattr(compiled_step, "build_package", broken_export)
    result = CliRunner().invoke(main, ["compile", str(folder), "--quant", "fp32"])
    assert result.exit_code == 1 and "export exploded" in result.output and "Traceback" not in result.output
    assert [p.read_text() for p in (tmp_path / "inductor" / "aot").glob("*.failed")] != []
    lm = load_model(str(folder), quant="fp32")
    engine = BatchEngine(lm.model, kv_budget_bytes=1 << 20, max_running=1, compile="auto")
    assert not engine.compiled and engine.needs_build is False


@needs_compiler
@pytest.mark.slow
def test_a_first_run_builds_the_step_in_the_background_for_the_next(tiny_folder, tmp_path):
    """The CLI: a run that finds no compiled step answers eagerly and then starts `localllm compile` in
    a detached process at low priority; the next run uses the step from its first token; `localllm
    compile` then finds it built. With the switch off, nothing is started."""
    _, folder = tiny_folder("llama")
    env = {**os.environ, "LOCALLLM_HOME": str(tmp_path), "LOCALLLM_BACKGROUND_BUILD": "1"}
    run = [sys.executable, "-m", "localllm", "run", str(folder), "hello", "--raw", "-n", "4", "--quant", "fp32",
           "--temperature", "0", "--verbose", "--threads", "1"]
    off = subprocess.run(run, env={**env, "LOCALLLM_BACKGROUND_BUILD": "0"}, capture_output=True, text=True, timeout=120)
    assert off.returncode == 0 and "decode step: eager" in off.stderr and "background" not in off.stderr
    first = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "decode step: eager" in first.stderr and "in the background" in first.stderr
    log = tmp_path / "logs" / "compile.log"
    deadline = time.monotonic() + 300
    while "built the compiled decode step" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(1)
    assert "--threads 1" in log.read_text()  # built for the run's thread count, which packages are keyed by
    assert f"--batch {1 + MAX_DRAFT}" in log.read_text()  # and the rows of its verify steps (speculation)
    second = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "decode step: aot" in second.stderr and "background" not in second.stderr
    assert second.stdout == first.stdout  # the same greedy tokens
    again = subprocess.run([sys.executable, "-m", "localllm", "compile", str(folder), "--quant", "fp32",
                            "--threads", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "already built" in again.stderr
