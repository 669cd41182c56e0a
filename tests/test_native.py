"""localllm's C++ CPU kernels as a library: built once under a key, nothing half-written left behind,
and a failed build leaves torch's kernels running with one warning saying why."""

from __future__ import annotations

import warnings

import pytest

from localllm import native
from localllm.loaders.load import load_model
from localllm.runtime import cpu_attention
from tests.conftest import NATIVE_LIBRARIES


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler to build the kernels")
def test_library_is_built_once_under_its_key(kernels_dir):
    """The session's build left one library per layer, named by its key, and no temporary; another
    process finds them there and builds nothing."""
    import subprocess
    import sys

    libs = sorted(kernels_dir.iterdir())  # the layers' libraries (and any a test builds), no temporaries
    names = {p.name for p in libs}
    assert {f"{lib.name}-{native.library_key(lib)}.so" for lib in NATIVE_LIBRARIES} <= names
    assert all(name.endswith(".so") and not name.startswith(".") for name in names)
    before = [p.stat().st_mtime_ns for p in libs]
    code = ("import sys; from pathlib import Path; from localllm import native; "
            "from localllm.runtime.cpu_attention import LIBRARY; print(native.load(LIBRARY, Path(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, str(kernels_dir)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(native.library_path(cpu_attention.LIBRARY, kernels_dir))
    assert "building" not in out.stderr  # loaded, not built
    assert sorted(kernels_dir.iterdir()) == libs and [p.stat().st_mtime_ns for p in libs] == before


def test_failed_build_leaves_torch_kernels_and_says_why_once(monkeypatch, tmp_path, tiny_folder):
    monkeypatch.setattr(native, "registered", lambda lib: False)
    monkeypatch.setattr(native, "compiler", lambda: None)
    monkeypatch.setattr(native, "_failures", {})
    monkeypatch.setenv("LOCALLLM_KERNELS", str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_attention.paged_kernel(tmp_path) is None
        assert not native.available(cpu_attention.LIBRARY, tmp_path)  # remembered: not tried, nor said, again
        _, folder = tiny_folder("llama")
        lm = load_model(str(folder), quant="int8")
    msgs = [str(w.message) for w in caught if "CPU kernels" in str(w.message)]
    assert msgs == ["localllm's CPU kernels are unavailable (no C++ compiler (g++) to build localllm's CPU "
                    "kernels); using torch's own (slower)"]
    assert list(tmp_path.iterdir()) == []  # nothing half-built
    assert "attention-cpu" not in lm.kernels  # SDPA over gathered blocks decodes


@pytest.mark.slow
def test_cli_without_a_working_compiler_says_so_in_one_line_and_answers(tmp_path, smollm2_path, france_fp32):
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": "false", "LOCALLLM_KERNELS": str(tmp_path), "LOCALLLM_HOME": str(tmp_path / "home")}
    env.pop("LOCALLLM_DEBUG", None)
    # fp32: the greedy answer is decided by wide margins on every CPU (france_fp32 checks them).
    out = subprocess.run([sys.executable, "-m", "localllm", "run", "smollm2", "What is the capital of France?",
                          "-n", "12", "--temperature", "0", "--quant", "fp32"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "Paris" in out.stdout
    lines = [line for line in out.stderr.splitlines() if "CPU kernels are unavailable" in line]
    assert lines == ["warning: localllm's CPU kernels are unavailable (building localllm's CPU kernels failed: "
                     "(no output)); using torch's own (slower)"], out.stderr
    assert "Traceback" not in out.stderr and "warnings.warn" not in out.stderr
    assert list(tmp_path.glob("*.so")) == [] and list(tmp_path.glob("*.tmp*")) == []  # nothing half-built
