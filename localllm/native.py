"""localllm's own C++ CPU kernels, compiled once into one shared library and loaded as torch ops.

Two ops, each next to the code that uses it:

* ``localllm::decode_attention`` (``runtime/csrc``): one-query attention for decode steps
  (:mod:`runtime.cpu_attention`);
* ``localllm::int8_group_mm`` (``quant/csrc``): matmul with int8 weights scaled per group, a GGUF's
  Q8_0 blocks as they are (:class:`quant.kernels.Int8GroupCPU`).

The library is compiled with the C++ compiler inductor needs anyway (about 10 s, once; ``scripts/setup.sh``
does it at set-up) and stored under :func:`localllm.paths.kernels_dir` with a name keyed by its
sources, the torch and Python versions and the CPU's vector ISA. It is written to a temporary name
and renamed, so a crash or a concurrent build never leaves a broken library behind. Where it cannot be
built (no compiler), callers fall back to torch's own kernels and say so once.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parent.parent
SOURCES = (_ROOT / "runtime" / "csrc" / "decode_attention.cpp", _ROOT / "quant" / "csrc" / "int8_group_mm.cpp")

#: Why the library could not be built in this process (so it is tried, and said, once).
_failure: str | None = None


def _isa_flags() -> list[str]:
    """Compiler flags for at::vec's widest vectors this CPU runs (as inductor picks them)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        return ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]
    if cap == "AVX2":
        return ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return []  # at::vec's portable code: correct everywhere, not vectorised by hand


def _flags() -> list[str]:
    """Compiler flags, but for paths (those are in the key through the torch version)."""
    return ["-shared", "-fPIC", "-O3", "-std=c++20", "-fopenmp",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *_isa_flags()]


def library_key() -> str:
    """What the built library depends on, hashed: sources, flags, torch and Python versions, machine."""
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    for part in (torch.__version__, sys.version.split()[0], platform.machine(), *_flags()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def compiler() -> list[str] | None:
    """The C++ compiler's command (``$CXX`` may carry a wrapper: "ccache g++")."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    found = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    return [found] if found else None


def _build(out: Path) -> None:
    """Compile the sources to the shared library ``out`` (atomically: temp file, then rename)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) to build localllm's CPU kernels")
    torch_lib = library_paths()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = [
        *cxx, *map(str, SOURCES), "-o", str(tmp), *_flags(),
        *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}",
        # torch's own OpenMP runtime (already loaded in this process), not a second one
        f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu", "-lgomp",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            err = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"building localllm's CPU kernels failed: {err[:300]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _registered() -> bool:
    return hasattr(torch.ops.localllm, "decode_attention") and hasattr(torch.ops.localllm, "int8_group_mm")


def _register_fakes() -> None:
    """Shapes for tracing (torch.export, torch.compile): the ops' outputs without running them."""

    @torch.library.register_fake("localllm::decode_attention")
    def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("localllm::int8_group_mm")
    def _mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], qweight.shape[0]))


def load(cache_dir: Path) -> Path | None:
    """Make the ops available in this process, building the library under ``cache_dir`` if it is not
    there yet. Returns the library's path (None if the ops were already registered). Raises
    RuntimeError when it cannot be built."""
    if _registered():
        return None
    path = cache_dir / f"localllm_cpu-{library_key()}.so"
    if not path.exists():
        print("building localllm's CPU kernels (once, about 10 s)...", file=sys.stderr, flush=True)
        _build(path)
    torch.ops.load_library(str(path))
    _register_fakes()
    return path


def available(cache_dir: Path | None = None) -> bool:
    """Whether the ops are usable, loading (or building) them under ``cache_dir`` (default:
    :func:`localllm.paths.kernels_dir`) if needed. A failure is warned once and remembered."""
    global _failure
    if _registered():
        return True
    if _failure is not None:
        return False
    if cache_dir is None:
        from localllm.paths import kernels_dir

        cache_dir = kernels_dir()
    try:
        load(cache_dir)
    except (RuntimeError, OSError) as e:
        _failure = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        warnings.warn(f"localllm's CPU kernels are unavailable ({_failure}); using torch's own (slower)")
        return False
    return True


if __name__ == "__main__":  # scripts/setup.sh: build at set-up rather than on the first run
    from localllm.paths import kernels_dir

    if not available():
        sys.exit(1)
    print(f"localllm's CPU kernels ready in {kernels_dir()}", file=sys.stderr)
