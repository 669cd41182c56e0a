"""Read a safetensors file one tensor at a time with plain reads, not a memory map.

``safetensors.safe_open`` maps the whole file: every tensor read stays resident as mapped file
pages until the file is closed, so the process's RSS grows to the file's size while streaming it.
Reading each tensor into its own buffer keeps the footprint at one tensor, which is what makes
quantizing a checkpoint memory-bounded (:func:`read_array` does the same for GGUF tensors). The
format is an 8-byte little-endian header length, a JSON header
``{name: {dtype, shape, data_offsets: [begin, end]}}``, then the data.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from localllm.errors import LocalLLMError
from localllm.quant.experts import split_expert_name

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}


def tensor_dtypes(path: Path) -> dict[str, torch.dtype]:
    """Each tensor's dtype in the file ``path``, from its header alone."""
    header, _ = read_header(path)
    return {name: _DTYPES[info["dtype"]] for name, info in header.items() if info.get("dtype") in _DTYPES}


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header (without ``__metadata__``) and the offset where tensor data begins."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _damaged(path, "shorter than a header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise _damaged(path, "header longer than the file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _damaged(path, f"unreadable header ({e})") from e
    header.pop("__metadata__", None)
    start = 8 + n
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if info["dtype"] not in _DTYPES:
            raise LocalLLMError(f"{path.name}: tensor '{name}' has unsupported dtype {info['dtype']}")
        if start + end > size:
            raise _damaged(path, f"truncated: tensor '{name}' ends past the end of the file")
        numel = 1
        for d in info["shape"]:
            numel *= d
        if end - begin != numel * torch.empty(0, dtype=_DTYPES[info["dtype"]]).element_size():
            raise _damaged(path, f"tensor '{name}' has {end - begin} bytes for shape {info['shape']}")
    return header, start


def read_into(f: BinaryIO, offset: int, buffer: memoryview) -> bool:
    """Fill ``buffer`` (bytes) from ``f`` at ``offset`` with plain reads; False when the file ends first."""
    f.seek(offset)
    got = 0
    while got < len(buffer):
        n = f.readinto(buffer[got:])
        if not n:
            return False
        got += n
    return True


def read_array(f: BinaryIO, offset: int, shape: tuple[int, ...], dtype: np.dtype, what: str = "a tensor") -> np.ndarray:
    """A fresh, writable array of ``shape`` and ``dtype`` read from ``f`` at ``offset``: the bytes live
    in this buffer only, not as pages of a memory map that stay resident until the map is closed."""
    out = np.empty(shape, dtype=dtype)
    if out.size and not read_into(f, offset, memoryview(out.reshape(-1).view(np.uint8))):
        raise LocalLLMError(f"{getattr(f, 'name', 'the file')} is truncated while reading {what}",
                            "download or pull the model again")
    return out


def iter_safetensors(path: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in file order; each tensor is a fresh CPU buffer. ``keep``: read only the
    tensors whose name it accepts (the others are not read)."""
    header, start = read_header(path)
    with open(path, "rb", buffering=0) as f:
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if keep is not None and not keep(name):
                continue
            begin, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            view = memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")
            if not read_into(f, start + begin, view):
                raise _damaged(path, f"truncated while reading '{name}'")
            yield name, t


def _damaged(path: Path, why: str) -> LocalLLMError:
    return LocalLLMError(f"{path} is damaged: {why}", "download or pull the model again")


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"no safetensors dtype for {dtype}")


def write_safetensors(path: Path, layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                      tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file whose tensors arrive one at a time, in any order.

    The header is written first from ``layout`` (name -> shape, dtype), so no tensor has to wait in
    memory for the others: peak memory is one tensor, whatever the file's size. Every name in the
    layout must arrive exactly once with its shape; the tensor is converted to the layout's dtype.
    A stacked experts tensor (E, ...) may arrive one expert at a time instead, each under its expert's
    name (``layers.0.mlp.experts.7.gate.qweight``: :func:`quant.experts.split_expert_name`), written
    into its slice.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name in sorted(layout):
        shape, dtype = layout[name]
        nbytes = torch.empty(0, dtype=dtype).element_size()
        for d in shape:
            nbytes *= d
        header[name] = {"dtype": _dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data that follows starts 8-byte aligned
    start = 8 + len(blob)
    written: set[str] = set()
    experts: dict[str, set[int]] = {}  # a stacked tensor written one expert at a time -> those written
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(start + offset)
        for name, t in tensors:
            split = split_expert_name(name) if name not in layout else None
            whole, expert = split if split is not None else (name, None)
            if whole not in layout or name in written or (expert is not None and expert >= layout[whole][0][0]):
                raise ValueError(f"tensor '{name}' is {'repeated' if name in written else 'not in the layout'}")
            shape, dtype = layout[whole]
            at = header[whole]["data_offsets"][0]  # type: ignore[index]
            if expert is not None:
                shape = shape[1:]
                at += expert * (header[whole]["data_offsets"][1] - at) // layout[whole][0][0]  # type: ignore[index]
                experts.setdefault(whole, set()).add(expert)
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"tensor '{name}' has shape {tuple(t.shape)}, the layout says {tuple(shape)}")
            data = t.detach().to(device="cpu", dtype=dtype).contiguous()
            f.seek(start + at)
            if data.numel():
                f.write(memoryview(data.view(torch.uint8).reshape(-1).numpy()))
            written.add(name)
        f.flush()
        os.fsync(f.fileno())
    written |= {whole for whole, done in experts.items() if len(done) == layout[whole][0][0]}
    missing = sorted(set(layout) - written)
    if missing:
        raise ValueError(f"tensors never written: {', '.join(missing[:3])}")
