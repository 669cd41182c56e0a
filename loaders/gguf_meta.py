"""GGUF metadata as plain Python values."""

from __future__ import annotations

from typing import Any

import gguf


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields of a GGUF file: strings, numbers, and lists of them.

    Array fields (the tokenizer's tokens, merges and token types) come back as Python lists.
    The ``GGUF.*`` header pseudo-fields are left out.
    """
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
