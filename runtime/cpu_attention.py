"""The CPU decode step's attention kernel (``localllm::decode_attention``): one query per head over the
cached keys, built from ``csrc/decode_attention.cpp`` on first use and kept as a shared library.

Why a kernel of our own: torch's flash-attention CPU kernel costs 20-30 us a call on a decode step's
few hundred keys (blocking, buffers, GEMM set-up around ~0.1 MFLOP of work), 0.6-0.9 ms of a 5 ms
compiled SmolLM2 step; this one does the same arithmetic in a few us. ``loaders.load`` installs it in
every layer of a CPU model (:meth:`runtime.model.Transformer.set_decode_attention`), so eager and
compiled decode run the same attention and the compiled step stays the eager one fused. (With SDPA
left in eager decode, the two roundings drifted apart enough to change greedy tokens at near-ties.)

The library is compiled once with the C++ compiler inductor needs anyway (about 10 s) and stored under
a name keyed by its source, the torch and Python versions and the CPU's vector ISA; it is written to a
temporary name and renamed, so a crash or a concurrent build never leaves a broken library behind.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

import torch

from runtime.model import DecodeAttention

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
#: How the op appears in exported graphs and AOT packages.
OP_NAME = "localllm::decode_attention"


def _isa_flags() -> list[str]:
    """Compiler flags for at::vec's widest vectors this CPU runs (as inductor picks them)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        return ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]
    if cap == "AVX2":
        return ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return []  # at::vec's portable code: correct everywhere, not vectorised by hand


def library_key() -> str:
    """What the built library depends on, hashed."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, sys.version.split()[0], platform.machine(), *_isa_flags()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build(out: Path) -> None:
    """Compile the kernel to the shared library ``out`` (atomically: temp file, then rename)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) to build the decode attention kernel")
    torch_lib = library_paths()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = [
        cxx, str(SOURCE), "-o", str(tmp), "-shared", "-fPIC", "-O3", "-std=c++20", "-fopenmp",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *_isa_flags(),
        *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}",
        # torch's own OpenMP runtime (already loaded in this process), not a second one
        f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu", "-lgomp",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            err = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"building the decode attention kernel failed: {err[:300]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _registered() -> bool:
    return hasattr(torch.ops.localllm, "decode_attention")


def load(cache_dir: Path) -> Path | None:
    """Make ``torch.ops.localllm.decode_attention`` available in this process, building the library
    under ``cache_dir`` if it is not there yet. Returns the library's path (None if the op was already
    registered by an earlier call). Raises RuntimeError when it cannot be built."""
    if _registered():
        return None
    path = cache_dir / f"decode_attention-{library_key()}.so"
    if not path.exists():
        print("building the CPU attention kernel (once, about 10 s)...", file=sys.stderr, flush=True)
        _build(path)
    torch.ops.load_library(str(path))

    @torch.library.register_fake(OP_NAME)
    def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    return path


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one query per head: q (B, KV, G, hd), the G query heads that share each
    kv head; k, v (B, KV, L, hd), the cached keys and values (any strides but the last). Returns
    (B, KV, G, hd) in q's dtype, as ``F.scaled_dot_product_attention(q, k, v)`` does."""
    return torch.ops.localllm.decode_attention(q, k, v, 1.0 / math.sqrt(q.shape[-1]))


def kernel(cache_dir: Path) -> DecodeAttention | None:
    """:func:`decode_attention` once its library is loaded (built under ``cache_dir`` the first time);
    None, with a warning saying why, where it cannot be built (decode then runs SDPA)."""
    try:
        load(cache_dir)
    except (RuntimeError, OSError) as e:
        warnings.warn(f"CPU attention kernel unavailable ({str(e).splitlines()[0][:200]}); decode uses SDPA")
        return None
    return decode_attention


if __name__ == "__main__":  # scripts/setup.sh: build the kernel at set-up rather than on the first run
    from localllm.paths import kernels_dir

    if kernel(kernels_dir()) is not None:
        print(f"CPU attention kernel ready in {kernels_dir()}", file=sys.stderr)
