"""Building and loading localllm's own C++ CPU kernels as torch ops.

A leaf of the base layer: it knows nothing of the layers. Each layer describes its library (a
:class:`NativeLibrary`: its C++ sources and the ops they register) next to the code that uses it:

* ``localllm::decode_attention`` (:mod:`localllm.runtime.cpu_attention`, ``runtime/csrc``);
* ``localllm::int8_group_mm`` (:mod:`localllm.quant.native_ops`, ``quant/csrc``);
* ``localllm::apply_token_bitmask_`` (:mod:`localllm.runtime.constrain`, ``runtime/csrc``);
* ``localllm::rms_norm``, ``localllm::glu`` (:mod:`localllm.runtime.pointwise`, ``runtime/csrc``).

A library is compiled with the C++ compiler inductor needs anyway (seconds, once; ``scripts/setup.sh``
does it at set-up) and stored under the cache folder the caller gives (by default
:func:`localllm.paths.kernels_dir`) with a name keyed by its sources, flags, the torch and Python
versions and the CPU's vector ISA. It is written to a temporary name and renamed, so a crash or a
concurrent build never leaves a broken library behind. Where it cannot be built (no compiler), callers
fall back to torch's own kernels and say so once.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class NativeLibrary:
    """One shared library of torch ops in the ``localllm`` namespace."""

    name: str  # file name stem, e.g. "localllm_attention"
    sources: tuple[Path, ...]
    ops: tuple[str, ...]  # op names it registers under torch.ops.localllm
    #: Registers the ops' fake (meta) implementations, for torch.export / torch.compile tracing.
    register_fakes: Callable[[], None] | None = field(default=None, compare=False)
    #: Headers the sources include: part of the library's key, not compiled on their own.
    headers: tuple[Path, ...] = ()


#: Why a library could not be built in this process, by library name (so it is tried, and said, once).
_failures: dict[str, str] = {}


def _isa_flags() -> list[str]:
    """Compiler flags for at::vec's widest vectors this CPU runs (as inductor picks them)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        return ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mf16c"]
    if cap == "AVX2":
        return ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return []  # at::vec's portable code: correct everywhere, not vectorised by hand


def _flags() -> list[str]:
    """Compiler flags, but for paths (those are in the key through the torch version)."""
    return ["-shared", "-fPIC", "-O3", "-std=c++20", "-fopenmp",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *_isa_flags()]


def library_key(lib: NativeLibrary) -> str:
    """What the built library depends on, hashed: sources, flags, torch and Python versions, machine."""
    h = hashlib.sha256()
    for src in (*lib.sources, *lib.headers):
        h.update(src.read_bytes())
    for part in (torch.__version__, sys.version.split()[0], platform.machine(), *_flags()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def library_path(lib: NativeLibrary, cache_dir: Path) -> Path:
    return cache_dir / f"{lib.name}-{library_key(lib)}.so"


def compiler() -> list[str] | None:
    """The C++ compiler's command (``$CXX`` may carry a wrapper: "ccache g++")."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    found = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    return [found] if found else None


def _build(lib: NativeLibrary, out: Path) -> None:
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
        *cxx, *map(str, lib.sources), "-o", str(tmp), *_flags(),
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


def registered(lib: NativeLibrary) -> bool:
    """Whether the library's ops are already loaded in this process."""
    return all(hasattr(torch.ops.localllm, op) for op in lib.ops)


def load(lib: NativeLibrary, cache_dir: Path) -> Path | None:
    """Make ``lib``'s ops available in this process, building it under ``cache_dir`` if it is not
    there yet. Returns the library's path (None if the ops were already registered). Raises
    RuntimeError when it cannot be built."""
    if registered(lib):
        return None
    path = library_path(lib, cache_dir)
    if not path.exists():
        # One line a library, said before the wait: a build takes up to a minute or two on a few cores.
        print(f"building localllm's CPU kernels: {lib.name} (once for this torch and CPU)...", file=sys.stderr,
              flush=True)
        _build(lib, path)
    torch.ops.load_library(str(path))
    if lib.register_fakes is not None:
        lib.register_fakes()
    return path


def available(lib: NativeLibrary, cache_dir: Path | None = None) -> bool:
    """Whether ``lib``'s ops are usable, loading (or building) them under ``cache_dir`` (default:
    :func:`localllm.paths.kernels_dir`) if needed. A failure is warned once and remembered."""
    if registered(lib):
        return True
    if lib.name in _failures:
        return False
    if cache_dir is None:
        from localllm.paths import kernels_dir

        cache_dir = kernels_dir()
    try:
        load(lib, cache_dir)
    except (RuntimeError, OSError) as e:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        first = not _failures
        _failures[lib.name] = reason
        if first:  # one warning for all the libraries: they fail for the same reason
            warnings.warn(f"localllm's CPU kernels are unavailable ({reason}); using torch's own (slower)")
        return False
    return True


def unavailable_reason() -> str | None:
    """Why some library could not be built in this process (the first failure), or None."""
    return next(iter(_failures.values()), None)
