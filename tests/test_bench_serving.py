"""``localllm bench --concurrency/--workload``: the serving benchmark's figures on a tiny model, through
the CLI (JSON, table, PNG). Counts are asserted exactly (tokens generated, prompt tokens, prefix-cache
hits); no test asserts a time beyond its sign and order."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from localllm.bench.serving import (
    AGENT_REPLY,
    AGENT_TURNS,
    MIXED_LONG,
    MIXED_REQUESTS,
    MIXED_SHORT,
    SCHEMA,
    compare_levels,
    ideal_batching,
    percentiles,
)
from localllm.cli import main

ROW_KEYS = {"level", "requests", "wall_s", "generated_tokens", "throughput_tok_s", "ttft_ms", "ttft_mean_ms", "itl_ms",
            "prompt_tokens", "cached_prompt_tokens", "prefill_tokens", "preemptions", "kv_blocks_peak", "kv_blocks",
            "steps", "decode_steps", "decode_step_ms", "decode_steps_s", "prefill_steps_s"}


def serving(folder, out, workload: str, levels: str, *extra: str) -> tuple[dict, str]:  # type: ignore[no-untyped-def]
    path = out / f"{workload}.json"
    result = CliRunner().invoke(main, ["bench", str(folder), "--workload", workload, "--concurrency", levels,
                                       "--device", "cpu", "--threads", "2", "--json", str(path), *extra],
                                env={"LOCALLLM_DEBUG": ""})
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text()), result.stdout


def assert_row(row: dict) -> None:
    assert ROW_KEYS <= set(row)
    assert row["throughput_tok_s"] > 0 and row["wall_s"] > 0
    for key in ("ttft_ms", "itl_ms"):
        assert 0 <= row[key]["p50"] <= row[key]["p99"]
    assert row["prefill_tokens"] == row["prompt_tokens"] - row["cached_prompt_tokens"]
    assert 0 < row["kv_blocks_peak"] <= row["kv_blocks"]
    assert 0 < row["decode_steps"] < row["steps"] and row["decode_steps_s"] > 0 and row["prefill_steps_s"] > 0
    assert 0 < row["decode_step_ms"]["p50"] <= row["decode_step_ms"]["p99"]
    assert row["decode_steps_s"] + row["prefill_steps_s"] <= row["wall_s"]


@pytest.fixture(scope="module")
def llama(tiny_folder):
    """A tiny Llama whose context holds the agent workload's longest turn (and the long prompt)."""
    return tiny_folder("llama", max_position_embeddings=4096)[1]


def test_percentiles_are_nearest_rank():
    assert percentiles([]) == {"p50": None, "p99": None}
    values = list(range(1, 101))  # 1..100
    assert percentiles(values) == {"p50": 50.5, "p99": 99}


def test_uniform_levels_with_a_long_prompt_and_a_plot(llama, tmp_path):
    data, stdout = serving(llama, tmp_path, "uniform", "1,2", "--prompt-tokens", "24", "--gen-tokens", "6",
                           "--plot", str(tmp_path / "serving.png"), "--speculate", "off")
    assert data["schema"] == SCHEMA and data["workload"] == "uniform"
    assert [r["level"] for r in data["concurrency"]] == [1, 2]
    for row in data["concurrency"]:
        assert_row(row)
        assert row["requests"] == row["level"] and row["generated_tokens"] == 6 * row["level"]
        assert row["prompt_tokens"] == 24 * row["level"] and row["cached_prompt_tokens"] == 0  # distinct prompts
        # every prompt fits the first step's chunk budget (256): one step with prompt tokens, then 5 decode-only
        assert row["steps"] == 6 and row["decode_steps"] == 5
    c = data["comparison"]
    assert c["decode_step_c8_over_c1"] is None and c["throughput_c8_over_c1_if_c8_steps_cost_c1"] is None  # no c8
    long = data["comparison"]["with_long_prompt"]
    assert long["level"] == 2 and long["long_prompt_tokens"] == 2000 and long["long_prompt_ttft_ms"] > 0 and long["itl_ms"]["p99"] >= long["itl_ms"]["p50"]
    assert data["comparison"]["itl_p99_with_long_prompt_over_p50_c1"] > 0
    assert stdout.splitlines()[1].split()[:3] == ["level", "tok/s", "TTFT"]
    assert (tmp_path / "serving.png").stat().st_size > 10_000


def test_ideal_batching_prices_the_decode_steps_at_the_base_levels_step():
    base = {"generated_tokens": 10, "prefill_steps_s": 0.1, "decode_steps_s": 0.9, "decode_steps": 9,
            "decode_step_ms": {"p50": 100.0}}  # 10 tokens in 1 s of steps
    row = {"generated_tokens": 80, "prefill_steps_s": 0.8, "decode_steps": 9}
    # at the base's 100 ms a step: 0.8 + 0.9 s for 80 tokens, against 10 tokens a second
    assert ideal_batching(row, base) == pytest.approx(80 / 1.7 / 10)
    assert ideal_batching(row, {**base, "decode_step_ms": {"p50": None}}) is None


def test_a_lone_streams_zero_itl_gives_no_ratio_rather_than_a_crash():
    """With speculation a lone stream that copies gets most tokens several to a step: its ITL p50 is 0
    (the bench died dividing by it). Ratios over it are None; the others stand."""
    base = {"level": 1, "throughput_tok_s": 100.0, "itl_ms": {"p50": 0.0, "p99": 9.0}, "decode_step_ms": {"p50": 5.0},
            "generated_tokens": 10, "prefill_steps_s": 0.1, "decode_steps_s": 0.9, "decode_steps": 9}
    at8 = {**base, "level": 8, "throughput_tok_s": 300.0, "itl_ms": {"p50": 20.0, "p99": 40.0},
           "decode_step_ms": {"p50": 15.0}, "generated_tokens": 80}
    c = compare_levels([base, at8], {"itl_ms": {"p50": 20.0, "p99": 60.0}})
    assert c["itl_p99_c8_over_p50_c1"] is None and c["itl_p99_with_long_prompt_over_p50_c1"] is None
    assert c["throughput_c8_over_c1"] == 3.0 and c["decode_step_c8_over_c1"] == 3.0


def test_mixed_runs_continuous_and_static_batching_on_the_same_requests(llama, tmp_path):
    data, stdout = serving(llama, tmp_path, "mixed", "4", "--prompt-tokens", "16", "--chunk-tokens", "24")
    assert data["settings"]["chunk_tokens"] == 24
    [row] = data["concurrency"]
    assert_row(row)
    want = MIXED_REQUESTS // 2 * (MIXED_SHORT + MIXED_LONG)
    assert row["generated_tokens"] == row["static"]["generated_tokens"] == want
    assert row["requests"] == row["static"]["requests"] == MIXED_REQUESTS
    assert row["continuous_over_static"] == pytest.approx(row["throughput_tok_s"] / row["static"]["throughput_tok_s"])
    assert row["continuous_over_static_if_steps_cost_static"] == ideal_batching(row, row["static"]) > 0
    assert "continuous" in stdout and "static" in stdout


def test_agent_turns_reuse_their_history_only_with_the_prefix_cache(llama, tmp_path):
    data, _ = serving(llama, tmp_path, "agent", "2")
    [row] = data["concurrency"]
    cold = row["no_cache"]
    assert_row(row)
    assert row["requests"] == cold["requests"] == 2 * AGENT_TURNS
    assert row["generated_tokens"] == cold["generated_tokens"] == 2 * AGENT_TURNS * AGENT_REPLY
    # greedy on the same model: the same replies, so the same conversations both ways
    assert row["prompt_tokens"] == cold["prompt_tokens"]
    assert cold["cached_prompt_tokens"] == 0
    # every turn after the first finds its history (all but the last, partial block) in the cache
    assert row["cached_prompt_tokens"] > 0.8 * (row["prompt_tokens"] - cold["prompt_tokens"] / AGENT_TURNS)
    assert row["prefill_fraction"] == pytest.approx(row["prefill_tokens"] / cold["prefill_tokens"])
    assert row["prefill_fraction"] < 0.5


def test_serving_mode_refuses_single_stream_flags_and_scheme_lists(llama):
    for args, needle in ((["--compile"], "--compile and --no-cache"), (["--quant", "int4,int8"], "one scheme"),
                         (["--concurrency", "0"], "positive levels"), (["--concurrency", "a,b"], "not a list")):
        result = CliRunner().invoke(main, ["bench", str(llama), "--workload", "uniform", *args],
                                    env={"LOCALLLM_DEBUG": ""})
        assert result.exit_code == 1, result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], result.stderr


def test_an_int8_kv_pool_holds_about_twice_the_blocks_of_a_16_bit_one(llama, tmp_path):
    data16, _ = serving(llama, tmp_path, "uniform", "1", "--prompt-tokens", "16", "--gen-tokens", "4")
    data8, _ = serving(llama, tmp_path, "uniform", "1", "--prompt-tokens", "16", "--gen-tokens", "4",
                       "--kv-cache", "int8")
    assert data16["settings"]["kv_dtype"] == "16bit" and data8["settings"]["kv_dtype"] == "int8"
    [r16], [r8] = data16["concurrency"], data8["concurrency"]
    assert r8["generated_tokens"] == r16["generated_tokens"] == 4
    # the same budget: int8 codes plus an fp32 scale per token and head, against fp32 values (the tiny
    # model's activations), hold about 3.5x the blocks; against 16-bit ones about 2x
    assert r8["kv_blocks"] > 1.8 * r16["kv_blocks"]


def test_the_open_workload_runs_speculation_off_and_on_side_by_side(llama, tmp_path):
    """Each level with speculation off and on, interleaved rounds: the same tokens generated both
    ways, the drafts counted, and the table says the ratio."""
    from localllm.bench.speculation import ROUNDS

    data, stdout = serving(llama, tmp_path, "open", "1", "--prompt-tokens", "24", "--gen-tokens", "12")
    (row,) = data["concurrency"]
    assert_row(row)
    sp = row["speculation"]
    assert sp["off_tok_s"] > 0 and sp["on_tok_s"] > 0 and sp["on_over_off"] > 0
    assert sp["accepted_tokens"] <= sp["drafted_tokens"] and "1" in sp["step_ms_by_rows_off"]
    assert data["settings"]["speculate"] == "on" and f"{ROUNDS} interleaved rounds" in " ".join(data["notes"])
    assert "speculative decoding" in stdout and "level 1: off" in stdout
    # What bounds the gain, from the replies made without it: the engine's own steps (greedy fp32: the
    # same reply both ways; a decode step yields its accepted drafts plus one) take no fewer.
    engine_steps = row["generated_tokens"] - row["requests"] - row["accepted_tokens"]
    assert 1 <= sp["lookup_decode_steps"] <= engine_steps
    assert sp["lookup_tokens_per_step"] == pytest.approx((row["generated_tokens"] - 1) / sp["lookup_decode_steps"])
    assert sp["lookup_throughput_bound"] >= 1 and "the best lookup" in stdout


def test_the_lookup_bound_counts_the_fewest_steps_a_lookup_could_take():
    """A reply copying its prompt takes MAX_DRAFT + 1 tokens a step once its first two tokens are
    seen; a reply of new tokens one a step; and the engine's own proposer, drafting all it proposes
    every step, never takes fewer steps on random texts full of repeats."""
    import random

    from localllm.bench.speculation import lookup_steps
    from localllm.runtime.speculate import MAX_DRAFT, NgramIndex

    prompt = list(range(100, 160))
    # reply[0] from the prefill; reply[1] after an unseen pair; then whole drafts
    assert lookup_steps(prompt, prompt[3:40]) == 1 + -(-(37 - 2) // (MAX_DRAFT + 1))
    assert lookup_steps(prompt, list(range(10, 30))) == 19
    assert lookup_steps(prompt, [5]) == 0
    rng = random.Random(3)
    for _ in range(30):
        text = [rng.randrange(6) for _ in range(rng.randrange(20, 120))]
        prompt, reply = text[: len(text) // 2], text[len(text) // 2 :]
        index, steps, at = NgramIndex(), 0, 1
        while at < len(reply):
            draft, _ = index.propose([*prompt, *reply[:at]], MAX_DRAFT)
            kept = 0
            while kept < len(draft) and at + kept < len(reply) and draft[kept] == reply[at + kept]:
                kept += 1
            at += kept + 1
            steps += 1
        assert lookup_steps(prompt, reply) <= steps
