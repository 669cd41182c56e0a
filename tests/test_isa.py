"""The CPU kernels' tests again under every vector ISA narrower than this machine's.

torch picks its kernels, and localllm's builder its compiler flags (``localllm.native``), from the
CPU capability that ``ATEN_CPU_CAPABILITY`` may narrow at process start: so an AVX-512 machine also
checks the AVX2 and the portable (``default``) code, which most users' CPUs run, and an AVX2 machine
the portable code. The capability is fixed per process, so each runs the kernel tests in a pytest of
its own: a subset (the kernels against their references), not the whole suite again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

#: Widest first: torch's names (``torch.backends.cpu.get_cpu_capability()``) and ATEN_CPU_CAPABILITY's.
ORDER = (("AVX512", "avx512"), ("AVX2", "avx2"), ("DEFAULT", "default"))

#: Every test of a CPU kernel against its reference, at each kernel's shapes and paths.
KERNEL_TESTS = (
    "tests/test_gguf_cpu.py",
    "tests/test_cpu_attention.py",
    "tests/test_q8_kernels.py",
    "tests/test_q8_kernels_gguf.py::test_the_product_is_the_quantized_activations_by_the_grid",
    "tests/test_tile_kernels.py",
    "tests/test_float_kernels.py::test_every_path_is_f_linear_in_fp32_math",
    "tests/test_hub_formats.py::test_int4z_kernel_is_exact_where_fp16_offsets_are_not",
    "tests/test_kernels.py::test_cpu_kernels_match_the_reference",
    "tests/test_kernels.py::test_grouped_int8_kernel_computes_with_the_exact_weights",
    "tests/test_gguf_blocks.py",
    "tests/test_kv_int8.py::test_paged_kernel_matches_sdpa_over_an_int8_pool",
    "tests/test_constrain.py::test_the_mask_kernel_numpy_and_torch_paths_agree",
    "tests/test_pointwise.py::test_rms_norm_is_the_fp32_formula",
    "tests/test_pointwise.py::test_glu_is_the_activation_times_up",
    "tests/test_pointwise.py::test_rope_is_the_torch_formula_bit_for_bit",
)


def narrower_capabilities() -> list[str]:
    """ATEN_CPU_CAPABILITY values below this process's own capability."""
    names = [torch_name for torch_name, _ in ORDER]
    own = torch.backends.cpu.get_cpu_capability()
    if own not in names:  # not an x86 capability (ZVECTOR, VSX...): nothing narrower to force here
        return []
    return [env for _, env in ORDER[names.index(own) + 1:]]


def capability_env(capability: str) -> dict[str, str]:
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    env.pop("PYTEST_ADDOPTS", None)
    return env


#: Run under the capability: torch's capability, and the ISA flags localllm's kernels are built with
#: there (the inner pytest builds them, once, in its session's kernel folder).
PROBE = """
import torch
from localllm import native
print(torch.backends.cpu.get_cpu_capability())
print(" ".join(f for f in native._isa_flags() if f.startswith("-m")) or "portable")
"""

#: Whole-model checks, slow on the portable code (which few CPUs run): under ``avx2`` only.
WHOLE_MODEL = ("tests/test_tile_kernels.py::test_smollm2_default_path_is_the_files_weights_in_fp32",
               "tests/test_q8_kernels.py::test_smollm2_with_int8_activations_stays_close_to_the_files_weights")


@pytest.mark.parametrize("capability", narrower_capabilities() or [pytest.param("none", marks=pytest.mark.skip(
    reason="this CPU has no narrower vector capability to force"))])
def test_kernels_match_their_references_under_a_narrower_isa(capability):
    env = capability_env(capability)
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-2000:]
    seen, flags = probe.stdout.split("\n")[:2]
    assert seen == dict((e, t) for t, e in ORDER)[capability], "ATEN_CPU_CAPABILITY did not narrow torch's kernels"
    assert ("-mavx512f" in flags) is False and ("-mavx2" in flags) is (capability == "avx2"), flags
    deselect = [f"--deselect={t}" for t in WHOLE_MODEL] if capability == "default" else []
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-rs", *KERNEL_TESTS, *deselect],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
    assert done.returncode == 0, f"kernel tests under ATEN_CPU_CAPABILITY={capability} failed:\n{tail}"
    assert "localllm's CPU kernels" not in tail, f"kernel tests were skipped for want of the kernels:\n{tail}"
