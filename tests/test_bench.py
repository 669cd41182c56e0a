"""``localllm bench`` and scripts/bench_gpu.py: every figure present, a stable JSON schema, the table,
the PNG, consistent figures, and one-line refusals of bad input. No test asserts a time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from localllm import bench, native
from localllm.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ["fp32", "bf16", "int8", "int4", "nf4"]

TOP_KEYS = {"schema", "model", "device", "settings", "machine", "bandwidth", "schemes", "quality",
            "kv_cache_comparison", "notes"}
SETTINGS_KEYS = {"schemes", "baseline", "prompt_tokens", "gen_tokens", "ctx", "runs", "warmup_runs", "threads",
                 "text", "text_tokens", "quality", "kv_compare", "compile", "step_kinds"}
MACHINE_KEYS = {"cpu_model", "cpu_count", "threads", "gpu_name", "gpu_capability", "gpu_memory_bytes",
                "torch_version", "localllm_version", "python_version", "platform", "load_average"}
BANDWIDTH_KEYS = {"method", "tensor_bytes", "repeats", "read_bytes_per_s", "copy_bytes_per_s", "bytes_per_s"}
SCHEME_KEYS = {"label", "activation_dtype", "kernels", "weight_bytes", "read_bytes_per_token", "load_s", "memory",
               "kv_cache", "ttft_s", "prefill_tps", "decode_tps", "inter_token_s", "runs", "roofline", "quality",
               "ratios", "decode_step", "placement"}
MEMORY_KEYS = {"method", "peak_bytes", "peak_reserved_bytes", "after_load_bytes", "weights_kv_bytes",
               "ratio_to_weights_kv", "bound_bytes", "within_bound", "process", "library_bytes"}
KV_KEYS = {"kv_dtype", "bytes_per_token", "ctx", "ctx_bytes", "max_seq_len", "max_seq_len_bytes"}
SPREAD_KEYS = {"median", "min", "max"}
RUN_KEYS = {"ttft_s", "prefill_tps", "decode_s", "decode_tps", "inter_token_s"}
ROOFLINE_KEYS = {"decode_bytes_per_s", "fraction", "ceiling_tps"}
RATIO_KEYS = {"weight_bytes", "peak_bytes", "ttft_s", "prefill_tps", "decode_tps", "decode_bytes_per_s"}
QUALITY_KEYS = {"tokens", "perplexity", "ref_perplexity", "ppl_ratio", "kld", "top1"}
QUALITY_SUMMARY_KEYS = {"reference", "window", "tokens", "skipped"}
KV_COMPARE_KEYS = {"scheme", "prompt_tokens", "steps"}
KV_STEP_KEYS = {"step", "seq_len", "no_cache_s", "cache_s", "speedup"}


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, ["bench", *args], env={"LOCALLLM_DEBUG": ""})


def assert_one_line_error(result, *needles: str) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""


def assert_schema(result: dict, quality: bool, kv: bool) -> None:
    """The JSON's key set, level by level: a change here is a schema change (bump bench.SCHEMA)."""
    assert set(result) == TOP_KEYS and result["schema"] == bench.SCHEMA
    assert set(result["settings"]) == SETTINGS_KEYS
    assert set(result["machine"]) == MACHINE_KEYS
    assert set(result["bandwidth"]) == BANDWIDTH_KEYS
    assert set(result["quality"]) == QUALITY_SUMMARY_KEYS
    assert list(result["schemes"]) == result["settings"]["schemes"]
    for f in result["schemes"].values():
        assert set(f) == SCHEME_KEYS
        assert set(f["memory"]) == MEMORY_KEYS and set(f["kv_cache"]) == KV_KEYS
        for key in ("ttft_s", "prefill_tps", "decode_tps", "inter_token_s"):
            assert set(f[key]) == SPREAD_KEYS
        assert len(f["runs"]) == result["settings"]["runs"] and all(set(r) == RUN_KEYS for r in f["runs"])
        assert set(f["roofline"]) == ROOFLINE_KEYS and set(f["ratios"]) == RATIO_KEYS
        assert (set(f["quality"]) == QUALITY_KEYS) if quality else f["quality"] is None
    kvc = result["kv_cache_comparison"]
    if kv:
        assert set(kvc) == KV_COMPARE_KEYS and all(set(r) == KV_STEP_KEYS for r in kvc["steps"])
    else:
        assert kvc is None


def assert_consistent(result: dict) -> None:
    """Positive figures, medians inside their min-max, the roofline arithmetic, the baseline's ratios."""
    S = result["schemes"]
    assert result["bandwidth"]["bytes_per_s"] > 0
    for f in S.values():
        assert f["weight_bytes"] > 0 and 0 < f["read_bytes_per_token"] <= f["weight_bytes"] and f["load_s"] > 0
        assert f["memory"]["peak_bytes"] >= 0 and f["kv_cache"]["bytes_per_token"] > 0
        assert f["kv_cache"]["ctx_bytes"] == f["kv_cache"]["bytes_per_token"] * result["settings"]["ctx"]
        mem = f["memory"]  # the target's figures: peak over weights + KV cache, and the bound check
        assert mem["weights_kv_bytes"] == f["weight_bytes"] + f["kv_cache"]["ctx_bytes"]
        assert mem["ratio_to_weights_kv"] == pytest.approx(mem["peak_bytes"] / mem["weights_kv_bytes"])
        assert mem["bound_bytes"] == int(1.15 * mem["weights_kv_bytes"] + 64e6)
        assert mem["within_bound"] == (mem["peak_bytes"] <= mem["bound_bytes"])
        for key in ("ttft_s", "prefill_tps", "decode_tps", "inter_token_s"):
            s = f[key]
            assert 0 < s["min"] <= s["median"] <= s["max"]
        roof = f["roofline"]
        assert roof["decode_bytes_per_s"] == pytest.approx(f["read_bytes_per_token"] * f["decode_tps"]["median"])
        assert roof["fraction"] == pytest.approx(roof["decode_bytes_per_s"] / result["bandwidth"]["bytes_per_s"])
    base = S[result["settings"]["baseline"]]
    assert all(v == pytest.approx(1.0) for v in base["ratios"].values() if v is not None)
    if base["quality"] is not None:
        assert base["quality"]["ppl_ratio"] == pytest.approx(1.0) and base["quality"]["kld"] == 0
        assert base["quality"]["top1"] == 1.0
        for f in S.values():
            q = f["quality"]
            assert q["perplexity"] > 1 and q["kld"] >= 0 and 0 <= q["top1"] <= 1
            assert q["tokens"] == result["quality"]["tokens"] > 0


def assert_png(path: Path) -> None:
    import matplotlib.image

    image = matplotlib.image.imread(path)  # decodes, or raises
    assert image.shape[0] >= 400 and image.shape[1] >= 600 and image.shape[2] in (3, 4)
    assert image.std() > 0  # not a blank canvas


def assert_table(stdout: str, schemes: list[str], quality: bool) -> None:
    lines = stdout.splitlines()
    assert lines[0].startswith("# ")
    header = next(line for line in lines if not line.startswith("#"))
    assert header.split() == schemes
    for label in ("kernels", "decode step", "weights", "peak memory", "mem/(w+kv)", "KV cache / token", "TTFT ms",
                  "prefill tok/s", "decode tok/s",
                  "inter-token ms", "decode bandwidth", "roofline tok/s"):
        assert any(line.startswith(label) or line.lstrip().startswith(label) for line in lines), label
    assert any(line.startswith("perplexity") for line in lines) == quality
    assert "run 1/" not in stdout and "note:" not in stdout  # progress and notes go to stderr


# ------------------------------------------------------------------------------ tiny model, fast
@pytest.fixture(scope="module")
def tiny_run(tiny_folder, tmp_path_factory):
    """One bench of the tiny model in every scheme, through the CLI, with JSON, PNG and --no-cache."""
    _, folder = tiny_folder("llama")
    out = tmp_path_factory.mktemp("bench")
    text = out / "text.txt"
    text.write_text(bench.EVAL_TEXT.read_text()[:1500])  # byte-level tokenizer: ~1.5k tokens, quick quality
    result = invoke(str(folder), "--quant", ",".join(SCHEMES), "--device", "cpu", "--prompt-tokens", "32",
                    "--gen-tokens", "8", "--runs", "2", "--threads", "2", "--text", str(text), "--no-cache",
                    "--json", str(out / "bench.json"), "--plot", str(out / "bench.png"))
    assert result.exit_code == 0, result.output
    return result, json.loads((out / "bench.json").read_text()), out


def test_tiny_bench_returns_every_field(tiny_run):
    _, data, _ = tiny_run
    assert_schema(data, quality=True, kv=True)
    assert all(f["placement"] is None for f in data["schemes"].values())  # a CPU run places nothing
    assert data["settings"]["schemes"] == SCHEMES and data["settings"]["baseline"] == "fp32"
    assert data["settings"]["prompt_tokens"] == 32 and data["settings"]["ctx"] == 40
    assert data["settings"]["threads"] == 2 and data["machine"]["threads"] == 2
    assert data["machine"]["torch_version"] == torch.__version__ and data["machine"]["cpu_model"]
    assert data["device"] == "cpu" and "VmRSS" in data["schemes"]["fp32"]["memory"]["method"]
    # each scheme's memory in a process of its own (the order of --quant does not change it); the
    # kernels' build is a fixed cost taken before the baseline, reported beside it
    for f in data["schemes"].values():
        assert f["memory"]["process"] == "fresh" and "kernels" in f["memory"]["library_bytes"]
    assert "bitsandbytes" in data["schemes"]["nf4"]["memory"]["library_bytes"]


def test_tiny_figures_are_positive_and_consistent(tiny_run):
    _, data, _ = tiny_run
    assert_consistent(data)
    w = {name: f["weight_bytes"] for name, f in data["schemes"].items()}
    assert w["int4"] < w["int8"] < w["bf16"] < w["fp32"] and w["nf4"] < w["int8"]
    # the KV cache follows the activations: fp32 on the CPU for every scheme, 16-bit weights included
    kv = {name: f["kv_cache"]["bytes_per_token"] for name, f in data["schemes"].items()}
    assert {f["activation_dtype"] for f in data["schemes"].values()} == {"float32"} and len(set(kv.values())) == 1
    # the CPU attention kernel in every layer (where it could be built); a quantized matmul kernel only
    # where weights are quantized
    attention = {"attention-cpu"} if native.compiler() is not None else set()
    assert all(set(f["kernels"]) >= attention for f in data["schemes"].values())
    int4 = "int4-group-cpu" if native.compiler() is not None else "reference"
    assert int4 in data["schemes"]["int4"]["kernels"] and set(data["schemes"]["fp32"]["kernels"]) == attention
    # which step each scheme's decode ran, and why not compiled
    assert all(f["decode_step"] == {"kind": "eager", "why": "--compile not given"} for f in data["schemes"].values())


def test_tiny_memory_ratio_to_weights_and_kv_cache_is_reported(tiny_run):
    """Each scheme's peak memory over weights + KV cache, in the JSON and as a table row with the bound
    check (1.15 x (weights + KV) + 64 MB): "1.08 ok" or "1.40 over"."""
    result, data, _ = tiny_run
    [row] = [line for line in result.stdout.splitlines() if line.startswith("mem/(w+kv)")]
    cells = row.removeprefix("mem/(w+kv)").split()
    assert len(cells) == 2 * len(SCHEMES)
    for name, ratio, verdict in zip(SCHEMES, cells[::2], cells[1::2]):
        mem = data["schemes"][name]["memory"]
        assert float(ratio) == pytest.approx(mem["ratio_to_weights_kv"], abs=0.006)
        assert verdict == ("ok" if mem["within_bound"] else "over")
    # a model this small is far below 64 MB: any peak a tiny model reaches is within the bound
    assert all(f["memory"]["within_bound"] for f in data["schemes"].values())
    assert any(note.startswith("mem/(w+kv)") for note in data["notes"])


def test_tiny_no_cache_comparison(tiny_run):
    _, data, _ = tiny_run
    kv = data["kv_cache_comparison"]
    assert kv["scheme"] == "fp32" and [r["step"] for r in kv["steps"]] == list(bench.KV_REPORT_STEPS)
    assert all(r["seq_len"] == kv["prompt_tokens"] + r["step"] and r["cache_s"] > 0 and r["no_cache_s"] > 0
               for r in kv["steps"])
    assert all(r["speedup"] == pytest.approx(r["no_cache_s"] / r["cache_s"]) for r in kv["steps"])


def test_tiny_table_on_stdout_the_rest_on_stderr(tiny_run):
    result, _, _ = tiny_run
    assert_table(result.stdout, SCHEMES, quality=True)
    assert "KV cache ms" in result.stdout  # the --no-cache table
    assert "machine:" in result.stderr and "note: memory:" in result.stderr and "run 1/2" in result.stderr


def test_tiny_png_decodes(tiny_run):
    _, _, out = tiny_run
    assert_png(out / "bench.png")


def test_json_to_stdout(tiny_folder, tmp_path):
    _, folder = tiny_folder("llama")
    text = tmp_path / "t.txt"
    text.write_text("Bridges carry loads across gaps. " * 8)
    result = invoke(str(folder), "--quant", "int8,bf16", "--device", "cpu", "--prompt-tokens", "16",
                    "--gen-tokens", "4", "--runs", "1", "--no-quality", "--text", str(text), "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # nothing but the JSON on stdout; the table went to stderr
    assert_schema(data, quality=False, kv=False)
    assert data["settings"]["baseline"] == "bf16" and data["quality"]["skipped"] == "--no-quality"
    assert "decode tok/s" in result.stderr


@pytest.mark.slow
def test_compiled_decode_with_an_int8_head(tiny_folder, tmp_path):
    _, folder = tiny_folder("llama")
    text = tmp_path / "t.txt"
    text.write_text("Bridges carry loads across gaps. " * 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = invoke(str(folder), "--quant", "bf16,int4", "--quant-head", "int8", "--compile", "--device", "cpu",
                        "--prompt-tokens", "16", "--gen-tokens", "4", "--runs", "1", "--no-quality",
                        "--text", str(text), "--json", str(tmp_path / "b.json"))
    assert result.exit_code == 0, result.output
    # Both models really ran compiled ahead of time (a step built for the first taken for the second would
    # fail and fall back, with a warning).
    assert not [str(w.message) for w in caught if "eagerly" in str(w.message) or "AOTInductor" in str(w.message)]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["settings"]["compile"] is True and data["settings"]["step_kinds"] == ["aot"]
    assert any("decode step compiled before any run (not timed): aot" in n for n in data["notes"])
    assert any("output head of the quantized schemes: int8" in n for n in data["notes"])
    assert data["schemes"]["int4"]["kernels"]["int8-group-cpu"] == 1  # the head
    assert all(f["decode_step"]["kind"] == "compiled" for f in data["schemes"].values())
    assert "int8-group-cpu" not in data["schemes"]["bf16"]["kernels"]  # float schemes keep a float head


# ------------------------------------------------------------------------------ bad input
def test_unknown_scheme(tiny_folder):
    assert_one_line_error(invoke(str(tiny_folder("llama")[1]), "--quant", "fp32,fp8"), "unknown scheme 'fp8'", "int4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_cuda_without_cuda(tiny_folder):
    assert_one_line_error(invoke(str(tiny_folder("llama")[1]), "--device", "cuda"), "no CUDA GPU", "--device cpu")


def test_context_shorter_than_prompt_and_generation(tiny_folder):
    result = invoke(str(tiny_folder("llama")[1]), "--device", "cpu", "--prompt-tokens", "64", "--gen-tokens", "16",
                    "--ctx", "70")
    assert_one_line_error(result, "--ctx 70", "--ctx 80 or more")


def test_text_shorter_than_the_prompt(tiny_folder, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("too short")
    result = invoke(str(tiny_folder("llama")[1]), "--device", "cpu", "--prompt-tokens", "64", "--text", str(text))
    assert_one_line_error(result, "shorter than the 64", "--text")


def test_unwritable_json_path_fails_before_measuring(tiny_folder, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = invoke(str(tiny_folder("llama")[1]), "--quant", "fp32", "--json", str(blocker / "out.json"))
    assert_one_line_error(result, "cannot write", "a-file", "writable folder")
    assert "run 1/" not in result.stderr  # nothing was measured


def test_plot_without_matplotlib_fails_before_measuring(tiny_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = invoke(str(tiny_folder("llama")[1]), "--device", "cpu", "--plot", "x.png")
    assert_one_line_error(result, "matplotlib", "pip install localllm[plot]")


# ------------------------------------------------------------------------------ units
def test_baseline_is_the_highest_precision():
    assert bench.baseline_scheme(["int4", "bf16", "nf4"]) == "bf16"
    assert bench.baseline_scheme(["bf16", "fp16", "int8"]) == "fp16"
    assert bench.baseline_scheme(["nf4", "int4"]) == "int4"
    assert bench.parse_schemes(None, torch.device("cpu"))[0] == "fp32"
    assert bench.parse_schemes(" int4, int8,int4 ", torch.device("cpu")) == ["int4", "int8"]


def test_rss_meter_sees_an_allocation():
    meter = bench.RSSMeter()
    meter.start()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, written so its pages are resident
    time.sleep(0.3)  # the meter samples every 10 ms: hold the block across many samples
    del block
    bench.release_memory(torch.device("cpu"))
    figures = meter.stop()
    assert figures["peak_bytes"] >= 48 << 20


def test_a_busy_machine_is_warned_of():
    machine = {"cpu_count": 2, "threads": 2}
    assert "busy" in bench.busy_warning({**machine, "load_average": [3.1, 2.0, 1.0]})
    assert bench.busy_warning({**machine, "load_average": [0.1, 0.5, 1.0]}) is None
    assert bench.busy_warning({**machine, "load_average": None}) is None


# ------------------------------------------------------------------------------ the GPU script
def run_gpu_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_gpu_script_runs_on_the_cpu_with_the_tiny_shape(tmp_path):
    proc = run_gpu_script("--device", "cpu", "--shape", "tiny", "--quant", "fp16,int8,int4", "--runs", "1",
                          "--prompt-tokens", "16", "--gen-tokens", "4", "--threads", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "bench.json").read_text())
    data.pop("elapsed_s")
    assert_schema(data, quality=False, kv=False)
    assert_consistent(data)
    assert data["quality"]["skipped"] == "random weights: perplexity is meaningless"
    assert "perplexity is meaningless" in proc.stdout  # said in the table itself
    assert_table(proc.stdout, ["fp16", "int8", "int4"], quality=False)
    assert (tmp_path / "table.txt").read_text().strip() == proc.stdout.strip()
    w = {name: f["weight_bytes"] for name, f in data["schemes"].items()}
    assert w["int4"] < w["int8"] < w["fp16"]
    assert_png(tmp_path / "bench.png")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_gpu_script_without_cuda_fails_clearly(tmp_path):
    proc = run_gpu_script("--out", str(tmp_path))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: no CUDA GPU") and "--shape tiny" in lines[0]
    assert not any(tmp_path.iterdir())


def test_the_gpu_kernel_table_runs_on_the_cpu_with_the_tiny_shape(tmp_path):
    """scripts/linear_gpu.py's logic with the CPU's kernels: every shape has F.linear and a kernel of
    each scheme, each timed at every row count, with the bytes its layer reads."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "linear_gpu.py"), "--device", "cpu", "--shape",
                           "tiny", "--rows", "1,3", "--rounds", "1", "--calls", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "linears.json").read_text())
    assert data["rows"] == [1, 3] and data["read_bytes_per_s"] > 0
    by_layer: dict[str, set[str]] = {}
    for r in data["results"]:
        by_layer.setdefault(r["layer"], set()).add(r["scheme"])
        assert set(r["us_by_rows"]) == {"1", "3"} and all(t > 0 for t in r["us_by_rows"].values())
        assert r["bytes"] > 0 and r["bandwidth_share_1_row"] > 0
    assert by_layer == {"qkv": {"16-bit", "int4", "int8"}, "down": {"16-bit", "int4", "int8"}}
    assert (tmp_path / "linears.txt").read_text().strip() == proc.stdout.strip()


# ------------------------------------------------------------------------------ SmolLM2
@pytest.mark.slow
def test_smollm2_bench(smollm2_path, tmp_path):
    schemes = ["fp32", "int8", "int4"]
    text = tmp_path / "text.txt"
    text.write_text(bench.EVAL_TEXT.read_text()[:3000])  # ~600 tokens: two quality windows, not six
    result = invoke(str(smollm2_path), "--quant", ",".join(schemes), "--device", "cpu", "--runs", "2",
                    "--prompt-tokens", "64", "--gen-tokens", "16", "--threads", "2", "--text", str(text),
                    "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png"))
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "b.json").read_text())
    assert_schema(data, quality=True, kv=False)
    assert_consistent(data)
    assert_table(result.stdout, schemes, quality=True)
    assert_png(tmp_path / "b.png")
    S = data["schemes"]
    assert S["int4"]["weight_bytes"] < S["int8"]["weight_bytes"] < S["fp32"]["weight_bytes"]
    assert data["quality"]["tokens"] >= 500 and data["settings"]["text"] == str(text)
    assert S["int8"]["quality"]["ppl_ratio"] < 1.01 and S["int8"]["quality"]["top1"] > 0.9
    assert S["int4"]["quality"]["ppl_ratio"] < 1.01  # the GGUF's own Q4_1 grid, imported exactly

