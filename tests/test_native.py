"""localllm's C++ CPU kernels as a library: built once under a key, nothing half-written left behind,
and a failed build leaves torch's kernels running with one warning saying why."""

from __future__ import annotations

import warnings

import pytest

from localllm import native
from loaders.load import load_model
from runtime import cpu_attention


@pytest.mark.skipif(native._compiler() is None, reason="no C++ compiler to build the kernels")
def test_library_is_built_once_under_its_key(kernels_dir):
    """The session's build left one library named by its key; loading again builds nothing."""
    assert [p.name for p in kernels_dir.glob("*.so")] == [f"localllm_cpu-{native.library_key()}.so"]
    assert not list(kernels_dir.glob("*.tmp*"))  # no temporary left behind
    assert native.load(kernels_dir) is None  # already registered in this process


def test_failed_build_leaves_torch_kernels_and_says_why_once(monkeypatch, tmp_path, tiny_folder):
    monkeypatch.setattr(native, "_registered", lambda: False)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setattr(native, "_failure", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_attention.kernel(tmp_path) is None
        assert not native.available(tmp_path)  # remembered: not tried, nor said, again
        _, folder = tiny_folder("llama")
        lm = load_model(str(folder), quant="int8")
    msgs = [str(w.message) for w in caught if "CPU kernels" in str(w.message)]
    assert msgs == ["localllm's CPU kernels are unavailable (no C++ compiler (g++) to build localllm's CPU "
                    "kernels); using torch's own (slower)"]
    assert list(tmp_path.iterdir()) == []  # nothing half-built
    assert lm.model.decode_kernel is None and "attention-cpu" not in lm.kernels  # SDPA decodes
