"""GGUF tensors imported exactly (quant/gguf_blocks.py): every type's canonical tensors dequantize to
the values ``gguf`` gives for the same bytes, bit for bit, random blocks and SmolLM2's real ones; a
type goes to a canonical grid only where that grid holds it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from localllm import native
from localllm.quant import kernels
from localllm.quant.formats import dequantize, gguf_scheme
from localllm.quant.gguf_blocks import exact_import, exact_scheme, to_canonical
from tests.test_formats import rand_weight, scheme_of
from tests.test_gguf_cpu import BLOCK_TYPES, FLOAT_TYPES, gguf_values, type_bytes


@pytest.mark.parametrize("type_name", BLOCK_TYPES + FLOAT_TYPES)
def test_every_type_imports_to_the_values_gguf_gives(type_name):
    raw = type_bytes(type_name, 16, 512)
    want = gguf_values(type_name, raw)
    scheme = exact_scheme(type_name)
    assert scheme is not None and exact_import(type_name, scheme)
    canonical = to_canonical(type_name, raw)
    np.testing.assert_array_equal(dequantize(canonical, scheme).numpy(), want)
    if scheme.name == "gguf":  # the file's bytes as they are: 1.0x its memory
        assert canonical["blocks"].numel() == raw.nbytes


def test_real_tensors_of_smollm2_import_exactly(smollm2_path):
    """Rows of SmolLM2's real Q4_1 and Q8_0 tensors: as int4 / int8 (their canonical grids) and in
    their own blocks, both gguf's values bit for bit."""
    reader = gguf.GGUFReader(str(smollm2_path))
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in ("Q4_1", "Q8_0") or kind in seen or len(t.shape) != 2:
            continue
        seen.add(kind)
        raw = np.array(t.data[:64])  # 64 rows
        want = gguf_values(kind, raw)
        np.testing.assert_array_equal(dequantize(to_canonical(kind, raw), exact_scheme(kind)).numpy(), want)
        blocks = to_canonical(kind, raw, gguf_scheme(kind))
        np.testing.assert_array_equal(dequantize(blocks, gguf_scheme(kind)).numpy(), want)
        if native.compiler() is not None:
            got = kernels.gguf_dequantize(blocks["blocks"], kind, want.shape[1]).numpy()
            np.testing.assert_array_equal(got, want)
    assert seen == {"Q4_1", "Q8_0"}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_import_exactly(qtype):
    w = rand_weight(64, 256, seed=4).numpy()
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, t)  # (out, bytes)
    want = gguf.quants.dequantize(raw, t)
    scheme = scheme_of("int8", 32) if qtype == "Q8_0" else scheme_of("int4", 32, qtype == "Q4_0")
    assert exact_import(qtype, scheme)
    got = dequantize(to_canonical(qtype, raw), scheme).numpy()
    np.testing.assert_array_equal(got, want)


def test_q4_1_does_not_fit_the_symmetric_grid():
    assert not exact_import("Q4_1", scheme_of("int4", 32, True))
    assert exact_import("Q4_0", scheme_of("int4", 32, False))
    assert not exact_import("Q4_1", scheme_of("int4", 64))
