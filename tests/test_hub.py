"""loaders.hub against a local Hub-protocol server (tests/hub_server.py), with the real huggingface_hub client."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save
from tqdm import tqdm

from localllm.loaders.hub import ProgressBar, Snapshot, download, hub_cache_paths, parse_ref, prune, select_files
from localllm.errors import LocalLLMError
from tests.hub_server import HubServer, closed_port_url, hub_env, hub_fixture, no_retry_sleep, set_offline

__all__ = ["hub_fixture"]  # the `hub` fixture: server running, client pointed at it

REPO = "org/tiny-llama"
RUNTIME = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def _weights(seed: int) -> bytes:
    """A couple of MB of random tensors in safetensors format (big enough for a resume to mean something)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "model.embed_tokens.weight": torch.randn(256, 1024, generator=g),
        "lm_head.weight": torch.randn(256, 1024, generator=g),
        "model.norm.weight": torch.ones(64),
    }
    return save(tensors, metadata={"format": "pt"})


def _model_files(seed: int = 0, **config_overrides: object) -> dict[str, bytes]:
    config = {**TINY_LLAMA, **config_overrides}
    return {
        "config.json": json.dumps(config).encode(),
        "generation_config.json": b'{"eos_token_id": 2, "do_sample": false}',
        "model.safetensors": _weights(seed),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}).encode(),
        "tokenizer_config.json": b'{"bos_token": "<s>", "eos_token": "</s>"}',
        "README.md": b"# tiny llama\n",
        "pytorch_model.bin": b"\x80\x04pickle that must never be fetched",
        "onnx/model.safetensors": b"not for us",
    }


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    return _model_files()


def _assert_identical(snapshot: Snapshot, expected: dict[str, bytes]) -> None:
    assert snapshot.files == RUNTIME
    for name in RUNTIME:
        assert (snapshot.path / name).read_bytes() == expected[name], name


def _blobs(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "hf" / "hub").rglob("blobs/*") if p.is_file()]


def _partials(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "hf" / "hub").rglob("blobs/*.incomplete"))


# --------------------------------------------------------------------------- happy paths
def test_download_fetches_only_runtime_files_byte_identical(
    hub: HubServer, files: dict[str, bytes], tmp_path: Path
) -> None:
    sha = hub.add_repo(REPO, files).refs["main"]
    hub.tree_page_size = 3  # the client must follow the Link header

    snap = download(REPO, progress=False)

    assert (snap.repo_id, snap.revision, snap.commit_sha) == (REPO, "main", sha)
    assert snap.path == tmp_path / "hf" / "hub" / "models--org--tiny-llama" / "snapshots" / sha
    _assert_identical(snap, files)
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.requests_for("/resolve/")}
    assert fetched == set(RUNTIME)  # no README, no pytorch_model.bin, nothing from onnx/
    pages = hub.requests_for("/tree/")
    assert len(pages) == 3 and pages[-1].query["cursor"] == ["6"]  # 9 entries, 3 a page, Link followed


def test_second_download_uses_cache(hub: HubServer, files: dict[str, bytes]) -> None:
    hub.add_repo(REPO, files)
    download(REPO, progress=False)
    hub.requests.clear()
    snap = download(REPO, progress=False)
    _assert_identical(snap, files)
    assert hub.file_gets("model.safetensors") == []


def test_tag_and_commit_revisions(hub: HubServer, files: dict[str, bytes]) -> None:
    repo = hub.add_repo(REPO, files, tags=("v1",))
    v1_sha = repo.refs["v1"]
    newer = _model_files(seed=1, num_hidden_layers=3)
    main_sha = repo.add_revision(newer)  # main moves on, v1 stays

    assert download(REPO, progress=False).commit_sha == main_sha
    by_tag = download(f"{REPO}@v1", progress=False)
    assert (by_tag.revision, by_tag.commit_sha) == ("v1", v1_sha)
    _assert_identical(by_tag, files)
    by_sha = download(f"{REPO}@{v1_sha}", progress=False)
    assert by_sha.commit_sha == v1_sha and by_sha.path == by_tag.path
    _assert_identical(download(f"{REPO}@{main_sha}", progress=False), newer)


# --------------------------------------------------------------------------- faults
def test_dropped_connection_is_resumed_with_a_range_request(hub: HubServer, files: dict[str, bytes]) -> None:
    hub.add_repo(REPO, files)
    half = len(files["model.safetensors"]) // 2
    hub.fault(REPO, "model.safetensors", drop_at=half, drop_times=1)

    snap = download(REPO, progress=False)

    _assert_identical(snap, files)
    gets = hub.file_gets("model.safetensors")
    assert len(gets) == 2 and gets[0].range_start is None
    assert gets[1].range_start is not None and 0 < gets[1].range_start <= half


def test_persistent_drop_fails_clearly_and_next_pull_resumes(
    hub: HubServer, files: dict[str, bytes], tmp_path: Path
) -> None:
    hub.add_repo(REPO, files)
    half = len(files["model.safetensors"]) // 2
    hub.fault(REPO, "model.safetensors", drop_at=half, drop_times=None)

    with pytest.raises(LocalLLMError, match="interrupted") as err:
        download(REPO, progress=False)
    assert "\n" not in str(err.value) and "pull again" in str(err.value)
    ranges = [r.range_start for r in hub.file_gets("model.safetensors")]
    assert ranges[0] is None and all(r is not None and r > 0 for r in ranges[1:])  # it kept resuming in-call
    [partial] = _partials(tmp_path)  # the bytes received are kept for the next pull
    kept = partial.stat().st_size
    assert 0 < kept <= half and partial.read_bytes() == files["model.safetensors"][:kept]

    hub.clear_faults()
    hub.requests.clear()
    _assert_identical(download(REPO, progress=False), files)
    assert [r.range_start for r in hub.file_gets("model.safetensors")] == [kept]  # only the rest was asked for
    assert _partials(tmp_path) == []


_PULL = (
    # Ctrl-C as from a terminal, even when the suite runs as a background job (which starts with SIGINT
    # ignored, and a child inherits that: it would never see the test's signal)
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "import sys; from huggingface_hub import constants; "
    "constants.DOWNLOAD_CHUNK_SIZE = 64 * 1024; "  # as in the `hub` fixture: bytes reach the disk early
    "from localllm.loaders.hub import download; download(sys.argv[1], progress=False)"
)


def _pull_in_subprocess(ref: str) -> subprocess.Popen:
    """``download(ref)`` in another process (the environment points it at the test server)."""
    return subprocess.Popen([sys.executable, "-c", _PULL, ref], cwd=Path(__file__).parents[1],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for_partial(tmp_path: Path, proc: subprocess.Popen, at_least: int) -> Path:
    """The partial file of the pull in ``proc``, once it holds ``at_least`` bytes."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the pull ended before the test could interrupt it"
        partials = _partials(tmp_path)
        if partials and partials[0].stat().st_size >= at_least:
            return partials[0]
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("the pull made no progress")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["killed", "ctrl-c"])
def test_interrupted_pull_resumes_on_the_next_pull(
    hub: HubServer, files: dict[str, bytes], tmp_path: Path, sig: signal.Signals
) -> None:
    hub.add_repo(REPO, files)
    size = len(files["model.safetensors"])
    hub.fault(REPO, "model.safetensors", rate=size / 2)  # two seconds for the file: the signal lands mid-way

    proc = _pull_in_subprocess(REPO)
    partial = _wait_for_partial(tmp_path, proc, size // 4)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) != 0
    kept = partial.stat().st_size
    assert size // 4 <= kept < size and partial.read_bytes() == files["model.safetensors"][:kept]

    hub.clear_faults()
    hub.requests.clear()
    _assert_identical(download(REPO, progress=False), files)
    assert [r.range_start for r in hub.file_gets("model.safetensors")] == [kept]
    assert _partials(tmp_path) == []


def test_concurrent_pulls_of_a_file_take_turns(hub: HubServer, files: dict[str, bytes], tmp_path: Path) -> None:
    hub.add_repo(REPO, files)
    size = len(files["model.safetensors"])
    hub.fault(REPO, "model.safetensors", rate=size / 2)

    proc = _pull_in_subprocess(REPO)
    _wait_for_partial(tmp_path, proc, 1)  # the other pull holds the file's lock
    snap = download(REPO, progress=False)  # waits for it, then uses its blob

    assert proc.wait(timeout=30) == 0
    _assert_identical(snap, files)
    assert [r.range_start for r in hub.file_gets("model.safetensors")] == [None]  # downloaded once


def test_wrong_bytes_in_a_kept_partial_are_deleted(hub: HubServer, files: dict[str, bytes], tmp_path: Path) -> None:
    hub.add_repo(REPO, files)
    weights = files["model.safetensors"]
    sha = hub.repos[REPO].commits[hub.repos[REPO].refs["main"]]["model.safetensors"].sha256
    blobs = tmp_path / "hf" / "hub" / "models--org--tiny-llama" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha}.incomplete").write_bytes(b"\0" * 1000)  # e.g. left by a crash of the machine

    with pytest.raises(LocalLLMError, match="model.safetensors is corrupted.*run the pull again"):
        download(REPO, progress=False)
    assert [r.range_start for r in hub.file_gets("model.safetensors")] == [1000]
    assert _partials(tmp_path) == [] and not (blobs / sha).exists()

    hub.requests.clear()
    _assert_identical(download(REPO, progress=False), files)
    assert [r.range_start for r in hub.file_gets("model.safetensors")] == [None]
    assert (blobs / sha).read_bytes() == weights


def test_wrong_bytes_are_detected_and_evicted(hub: HubServer, files: dict[str, bytes], tmp_path: Path) -> None:
    hub.add_repo(REPO, files)
    hub.fault(REPO, "model.safetensors", corrupt_times=1)

    with pytest.raises(LocalLLMError, match="model.safetensors is corrupted"):
        download(REPO, progress=False)
    assert not [p for p in _blobs(tmp_path) if p.stat().st_size > 1_000_000]  # bad blob gone

    _assert_identical(download(REPO, progress=False), files)  # fetched again, good this time
    assert len(hub.file_gets("model.safetensors")) == 2


def test_wrong_bytes_in_a_small_file_are_detected(hub: HubServer, files: dict[str, bytes]) -> None:
    hub.add_repo(REPO, files)
    hub.fault(REPO, "config.json", corrupt_times=1)
    with pytest.raises(LocalLLMError, match="config.json is corrupted"):
        download(REPO, progress=False)
    _assert_identical(download(REPO, progress=False), files)


# --------------------------------------------------------------------------- Hub errors
@pytest.mark.parametrize(
    ("setup", "ref", "expected"),
    [
        ({"status": 401}, REPO, ["rejected the token (401)", "HF_TOKEN"]),
        ({"gated": True}, REPO, ["gated", "request access on", "/org/tiny-llama", "HF_TOKEN"]),
        ({"status": 403}, REPO, ["forbidden (403)", "token"]),
        ({}, "org/missing", ["repository 'org/missing' not found", "private or gated", "HF_TOKEN", "hf auth login"]),
        ({}, f"{REPO}@nope", ["revision 'nope' not found in 'org/tiny-llama'", "branch, tag or commit"]),
        ({"status": 503}, REPO, ["failed (503)", "try again"]),
    ],
)
def test_hub_errors_are_one_line_with_the_fix(
    hub: HubServer, files: dict[str, bytes], setup: dict, ref: str, expected: list[str]
) -> None:
    hub.add_repo(REPO, files, **setup)
    with pytest.raises(LocalLLMError) as err:
        download(ref, progress=False)
    message = str(err.value)
    assert "\n" not in message
    for part in expected:
        assert part in message


def test_private_repo_needs_the_token(hub: HubServer, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_repo(REPO, files, token="hf_secret")
    with pytest.raises(LocalLLMError, match="not found.*HF_TOKEN"):
        download(REPO, progress=False)

    _assert_identical(download(REPO, token="hf_secret", progress=False), files)
    auth = {r.headers.get("authorization") for r in hub.requests_for("/resolve/")}
    assert auth == {"Bearer hf_secret"}

    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # the client reads HF_TOKEN at call time
    _assert_identical(download(f"{REPO}@main", progress=False), files)


def test_gated_repo_works_with_an_allowed_token(hub: HubServer, files: dict[str, bytes]) -> None:
    hub.add_repo(REPO, files, gated=True, allowed_tokens=("hf_ok",))
    _assert_identical(download(REPO, token="hf_ok", progress=False), files)


def test_pickle_only_repo_is_refused_without_downloading(hub: HubServer) -> None:
    hub.add_repo(REPO, {"config.json": b"{}", "pytorch_model.bin": b"\x80\x04...", "README.md": b"hi"})
    with pytest.raises(LocalLLMError, match="pickle") as err:
        download(REPO, progress=False)
    assert "safetensors" in str(err.value) and "run arbitrary code" in str(err.value)
    assert hub.requests_for("/resolve/") == []


def test_repo_without_config_is_refused(hub: HubServer, files: dict[str, bytes]) -> None:
    hub.add_repo(REPO, {k: v for k, v in files.items() if k != "config.json"})
    with pytest.raises(LocalLLMError, match="no config.json"):
        download(REPO, progress=False)


@pytest.mark.parametrize("overrides,needle", [({"num_hidden_layers": 1_000_000}, "num_hidden_layers 1000000"),
                                             ({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}, "mamba")])
def test_a_config_localllm_cannot_run_is_refused_before_the_weights(
        hub: HubServer, overrides: dict[str, object], needle: str) -> None:
    hub.add_repo(REPO, _model_files(**overrides))
    with pytest.raises(LocalLLMError, match=needle) as err:
        download(REPO, progress=False)
    assert "\n" not in str(err.value)
    assert {r.path.rsplit("/", 1)[-1] for r in hub.requests_for("/resolve/")} == {"config.json"}


# --------------------------------------------------------------------------- offline / no network
def test_offline_with_warm_cache(hub: HubServer, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    sha = hub.add_repo(REPO, files, tags=("v1",)).refs["main"]
    online = download(REPO, progress=False)
    download(f"{REPO}@v1", progress=False)
    hub.requests.clear()

    by_flag = download(REPO, offline=True)
    set_offline(monkeypatch)
    by_env = download(REPO)
    by_tag = download(f"{REPO}@v1")

    assert hub.requests == []
    for snap in (by_flag, by_env, by_tag):
        assert snap.commit_sha == sha and snap.path == online.path
        _assert_identical(snap, files)


def test_offline_with_cold_cache(hub: HubServer, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_repo(REPO, files)
    set_offline(monkeypatch)
    with pytest.raises(LocalLLMError, match="not in the local cache; run without HF_HUB_OFFLINE"):
        download(REPO)
    assert hub.requests == []


def test_server_down_says_cannot_reach(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = closed_port_url()
    hub_env(monkeypatch, url, tmp_path / "hf")
    no_retry_sleep(monkeypatch)
    with pytest.raises(LocalLLMError) as err:
        download(REPO, progress=False)
    assert str(err.value) == (
        f"cannot reach {url}; check your connection, or set HF_HUB_OFFLINE=1 to use models already downloaded"
    )


def test_server_down_with_warm_cache_still_says_cannot_reach(
    hub: HubServer, files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.add_repo(REPO, files)
    download(REPO, progress=False)
    url = closed_port_url()
    hub_env(monkeypatch, url, tmp_path / "hf")  # same cache, dead endpoint
    with pytest.raises(LocalLLMError, match=f"cannot reach {url}; .*HF_HUB_OFFLINE=1"):
        download(REPO, progress=False)
    assert download(REPO, offline=True).files == RUNTIME


# --------------------------------------------------------------------------- helpers
def test_prune_deletes_weights_from_the_hf_cache(hub: HubServer, files: dict[str, bytes]) -> None:
    hub.add_repo(REPO, files)
    snap = download(REPO, progress=False)
    paths = hub_cache_paths(snap)
    assert snap.path / "model.safetensors" in paths and any("blobs" in p.parts for p in paths)

    freed = prune(snap)

    assert freed == len(files["model.safetensors"])
    assert not any(p.exists() for p in paths)
    assert (snap.path / "config.json").read_bytes() == files["config.json"]
    hub.requests.clear()
    _assert_identical(download(REPO, progress=False), files)  # fetched again on demand
    assert len(hub.file_gets("model.safetensors")) == 1


def test_select_files_rules() -> None:
    names = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "consolidated.safetensors", "original/model.safetensors",
             "tokenizer.json", "chat_template.jinja", "README.md", "training_args.bin"]
    assert select_files("o/r", names) == [
        "chat_template.jinja", "config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
    ]
    assert select_files("o/r", ["config.json", "weights.safetensors"]) == ["config.json", "weights.safetensors"]
    both = ["config.json", "model.safetensors", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert select_files("o/r", both) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"
    ]
    stray_index = ["config.json", "model.safetensors", "model.safetensors.index.json"]
    assert select_files("o/r", stray_index) == ["config.json", "model.safetensors"]
    with pytest.raises(LocalLLMError, match="no \\*.safetensors weights"):
        select_files("o/r", ["config.json", "model.gguf"])


def test_parse_ref() -> None:
    assert parse_ref("org/name") == ("org/name", None)
    assert parse_ref("org/name@v1.0") == ("org/name", "v1.0")
    for bad in ("", "@main", "org/name@"):
        with pytest.raises(LocalLLMError, match="not a model reference"):
            parse_ref(bad)


def test_invalid_repo_id(hub: HubServer) -> None:
    with pytest.raises(LocalLLMError, match="not a valid Hub repo id"):
        download("org/na--me/x", progress=False)


def test_progress_bar_shows_sizes_and_rate() -> None:
    out = io.StringIO()
    bar = ProgressBar(total=2_000_000, unit="B", unit_scale=True, bar_format="{n_fmt}B{postfix}",
                       name="huggingface_hub.snapshot_download", file=out, disable=False, mininterval=0)
    bar.update(1_000_000)
    bar.set_description("Reconstruction complete")
    bar.close()
    text = out.getvalue()
    assert "Downloaded" in text and "2.00M" in text and "B/s" in text


def test_download_progress_goes_to_stderr_with_sizes_and_rate(
    hub: HubServer, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    hub.add_repo(REPO, files)
    stderr = Terminal()
    monkeypatch.setattr("sys.stderr", stderr)
    download(REPO)
    text = stderr.getvalue()
    assert "Fetching 5 files" in text and "Downloaded: 100%" in text and "B/s" in text
    total = tqdm.format_sizeof(sum(len(files[n]) for n in RUNTIME))
    assert f"{total}/{total}" in text

    quiet = Terminal()
    monkeypatch.setattr("sys.stderr", quiet)
    download(f"{REPO}@main", progress=False)
    assert quiet.getvalue() == ""
