"""The memory plan (loaders.memory_plan): its parts on tiny configs, against the bench's measured peaks
on SmolLM2, and each branch of ``localllm run``'s check forced with LOCALLLM_AVAILABLE_MEMORY."""

from __future__ import annotations

import re

import pytest
import torch

from localllm.loaders.memory_plan import (
    AVAILABLE_ENV,
    RUNTIME_BYTES,
    Footprint,
    activation_bytes,
    available_memory,
    gpu_kv_budget,
    parse_size,
    plan_for,
    plan_memory,
)
from localllm.runtime.config import FULL, SLIDING, ModelConfig
from localllm.runtime.cache import head_row_bytes
from localllm.runtime.kv_pool import cache_bytes
from tests.test_cli import assert_one_line_error, run_cli

CPU = torch.device("cpu")
TINY = dict(vocab_size=384, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, intermediate_size=192, max_seq_len=8192)


def _footprint(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> Footprint:
    return Footprint(config, "bf16", 1_000_000, dtype, CPU)


def test_sizes_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1.5GiB") == 3 * 2**29 and parse_size("800") == 800
    monkeypatch.setenv(AVAILABLE_ENV, "700MB")
    assert available_memory(CPU) == (700 * 10**6, AVAILABLE_ENV)
    monkeypatch.delenv(AVAILABLE_ENV)
    avail, source = available_memory(CPU)
    assert source == "psutil" and avail > RUNTIME_BYTES["cpu"]


def test_kv_cache_counts_sliding_layers_by_their_window_and_the_kv_dtype() -> None:
    full = ModelConfig(**TINY)
    sliding = ModelConfig(**TINY, sliding_window=512, layer_types=[SLIDING] * 5 + [FULL])
    avail = (10**12, "test")
    a, b = (plan_for(_footprint(c), 8192, available=avail) for c in (full, sliding))
    rope = 2 * 8192 * full.rotary_dim * 2
    assert a.kv_cache - rope == 2 * 6 * 8192 * full.kv_dim * 2
    # as the pool holds them: a sliding layer's window behind a 512-token prefill chunk, a partial block
    # at each end: (512 + 512 - 2) // 16 + 2 = 65 blocks of 16 tokens
    assert b.kv_cache - rope == 2 * (5 * 65 * 16 + 8192) * full.kv_dim * 2
    int8 = plan_for(_footprint(full), 8192, kv_dtype="int8", available=avail)
    assert int8.kv_cache - rope == 2 * 6 * 8192 * full.n_kv_heads * (full.head_dim + 4)  # codes + fp32 scales
    assert head_row_bytes("16bit", torch.float32, 64) == 4 * 64 and head_row_bytes("16bit", torch.bfloat16, 64) == 2 * 64
    # Two sequences: twice the cache; a prompt of the whole context: the largest activations.
    assert plan_for(_footprint(full), 8192, concurrency=2, available=avail).kv_cache == 2 * a.kv_cache - rope
    assert a.activations == activation_bytes(full, 8192, 1, 2) > activation_bytes(full, 64, 1, 2)
    assert a.fits and not plan_for(_footprint(full), 8192, available=(a.total - 1, "test")).fits


def test_a_sparse_layers_expert_buffers_count() -> None:
    """A MoE step's transient holds each row's k routed copies (fp32 in the expert kernel) and their
    gate|up: with 8 active experts far more than the dense MLP of the same expert width."""
    dense = ModelConfig(**{**TINY, "intermediate_size": 32})
    moe = ModelConfig(**{**TINY, "intermediate_size": 32, "n_experts": 64, "n_active": 8, "expert_size": 32})
    d, k = moe.dim, 8
    routed = 4 * (2 * 64 + k * (2 * d + 3 * 32) + d)
    assert activation_bytes(moe, 100, 1, 2) - activation_bytes(dense, 100, 1, 2) >= 100 * (routed - 8 * d * 2)


def test_a_gpu_servers_kv_pool_takes_the_cards_free_memory() -> None:
    """``serve`` on a GPU without ``--kv-memory``: room for ``--parallel`` sequences of the context
    (capped at run's 4096) when the card has it; else the free memory less a step's activations and
    the 10% reserve for graphs and workspaces; never less than one block."""
    config = ModelConfig(**TINY)  # max_seq_len 8192: capped at 4096
    per_token = 2 * 6 * config.kv_dim * 2  # bf16 keys and values of every layer
    rope = 2 * 4096 * config.rotary_dim * 2
    act = activation_bytes(config, 256 + 8, 8, 2)
    assert gpu_kv_budget(config, torch.bfloat16, "16bit", 8, 256, free=10**12) == 8 * 4096 * per_token + rope
    small = 10 * 10**6  # less than the 25 MB the 8 sequences would take
    assert gpu_kv_budget(config, torch.bfloat16, "16bit", 8, 256, free=small) == int(small * 0.9) - act
    assert gpu_kv_budget(config, torch.bfloat16, "int8", 8, 256, free=10**12) < 8 * 4096 * per_token  # half-ish
    assert gpu_kv_budget(config, torch.bfloat16, "16bit", 8, 256, free=0) > 0


@pytest.mark.parametrize("model,quant,head", [
    ("smollm2", "int4", None),  # tied embedding, read from the int8 head
    ("tiny", "int4", "int8"),  # its own float embedding table, held in 16 bits
    ("tiny", "int4", False),  # and a 16-bit head
    ("tiny", "fp16", None),  # 16-bit weights
    ("tiny", "fp32", None),
])
def test_plan_takes_the_activation_dtype_load_model_takes(tiny_folder, model: str, quant: str, head) -> None:
    """On the CPU every model runs fp32 activations, its float tables held in 16 bits apart from them
    (a 16-bit or quantized model's): the plan sizes weights and KV cache as the load holds them."""
    from localllm.loaders.load import load_model

    ref = str(tiny_folder("llama")[1]) if model == "tiny" else model
    plan = plan_memory(ref, quant, 64, device="cpu", quantize_head=head)
    lm = load_model(ref, device="cpu", quant=quant, quantize_head=head)
    want = torch.float32
    assert lm.model.dtype == want and plan.dtype == str(want).removeprefix("torch.")
    assert plan.weights == lm.weight_bytes
    kv = cache_bytes(lm.config, 64, want)  # 64 positions of every layer's keys and values
    assert plan.kv_cache == kv + 2 * 64 * lm.config.head_dim * want.itemsize  # + RoPE


PROBED = ("bf16", "int8")
PROMPT, CTX = 64, 72


@pytest.fixture(scope="module")
def measured(smollm2_path) -> dict[str, dict]:
    """The bench's memory row for each scheme of PROBED, each in a fresh process, the processes side by
    side (each measures its own resident set)."""
    import json
    import os
    import subprocess

    from localllm.bench.memprobe import probe_command

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = {s: subprocess.Popen(probe_command("smollm2", s, PROMPT, 2, CTX, "cpu", None, None), env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for s in PROBED}
    out = {}
    for s, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out[s] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("scheme", PROBED)
def test_plan_is_within_10_percent_of_the_measured_peak(measured: dict[str, dict], scheme: str) -> None:
    """The bench's memory row (peak RSS growth over the process after imports, in a fresh process)
    against the plan less its runtime (the process before any model, which the probe's baseline holds)."""
    plan = plan_memory("smollm2", scheme, CTX, device="cpu", prefill_tokens=PROMPT)
    figures = measured[scheme]
    # The weights exactly: the probe's weights + KV cache less the cache it counts (the model dtype's).
    kv = figures["weights_kv_bytes"] - plan.weights
    assert kv == 2 * 30 * 192 * CTX * getattr(torch, plan.dtype).itemsize  # 30 layers, 3 kv heads of 64
    planned = plan.total - plan.runtime
    assert abs(planned - figures["peak_bytes"]) <= 0.10 * figures["peak_bytes"], (planned, figures)


def _run(monkeypatch: pytest.MonkeyPatch, cap: str, *args: str):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(AVAILABLE_ENV, cap)  # run_cli's subprocess inherits it
    return run_cli("run", "smollm2", "Hi", "-n", "1", "--temperature", "0", *args)


NEEDS = re.compile(r"smollm2 needs ([\d.]+ [KMG]B) \(fp32 weights .* \+ KV cache .* for ctx (\d+) .*\), ([\d.]+ [KMG]B) "
                   rf"available \({AVAILABLE_ENV}\); use (.*), or free memory$")


@pytest.mark.slow
def test_run_refuses_what_does_not_fit_with_the_cheapest_fix(smollm2_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # fp32 at ctx 4096 plans ~1.2 GB: 1 GB fits at a shorter context, 800 MB only in a smaller scheme.
    ctx_fix = _run(monkeypatch, "1GB", "--quant", "fp32")
    assert_one_line_error(ctx_fix, "smollm2 needs", "for ctx 4096", "1.0 GB available")
    m = NEEDS.search(ctx_fix.stderr.strip())
    assert m and m.group(4).startswith("--ctx "), ctx_fix.stderr
    suggested = int(m.group(4).split()[1])
    assert 256 <= suggested < 4096
    quant_fix = _run(monkeypatch, "800MB", "--quant", "fp32")
    assert_one_line_error(quant_fix, "800 MB available", "use --quant int8, or free memory")
    nothing = _run(monkeypatch, "300MB", "--quant", "fp32")
    assert_one_line_error(nothing, "300 MB available", "free memory, or run a smaller model")
    # The fix the first line gave fits: the run goes ahead and generates.
    fits = _run(monkeypatch, "1GB", "--quant", "fp32", "--ctx", str(suggested))
    assert fits.returncode == 0, fits.stderr
    assert fits.stdout.strip() and "Error" not in fits.stderr


def test_show_prints_the_plan_for_a_few_context_lengths(smollm2_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm.commands.store import show_text
    from localllm.loaders.describe import describe_ref

    monkeypatch.setenv(AVAILABLE_ENV, "600MB")
    facts, _ = describe_ref("smollm2")
    plans = facts["memory_plan"]
    assert [p["ctx"] for p in plans] == [2048, 8192]  # SmolLM2's own context is 8192
    assert all(p["scheme"] == "int4" and p["available"] == 600 * 10**6 for p in plans)
    assert plans[0]["fits"] and not plans[1]["fits"] and plans[0]["total"] < plans[1]["total"]
    text = show_text(facts)
    assert "Memory plan (cpu, int4, 600 MB available)" in text
    assert re.search(r"ctx 8192 .* = weights .* \+ KV cache .* does not fit", text)
