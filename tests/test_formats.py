"""Weight formats (quant/formats.py): int4 packing, each scheme's quantize / dequantize round trip
within its bound, nf4 as bitsandbytes has it, and schemes or groups that cannot work refused."""

from __future__ import annotations

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.quant.formats import dequantize, pack_int4, parse_scheme, quantize, quiet_bitsandbytes, unpack_int4

SCHEMES = [("int8", None), ("int8", 64), ("int4", 32), ("int4", 64), ("int4", 128), ("nf4", 64)]


def scheme_of(name, group, symmetric=False):
    return parse_scheme(name, group, symmetric)


def rand_weight(out=96, inp=576, seed=0):
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int4_pack_unpack_is_exact():
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert packed[0, 0] == q[0, 0] | (q[0, 1] << 4)  # low nibble first
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("name,group", SCHEMES + [("int4-sym", 32)])
def test_round_trip_within_the_scheme_bound(name, group):
    sym = name == "int4-sym"
    scheme = scheme_of("int4" if sym else name, group, sym)
    w = rand_weight(inp=1024)
    t = quantize(w, scheme)
    err = (dequantize(t, scheme) - w).abs()
    if scheme.name == "int8":
        step = t["scales"].float()
        step = step[:, None] if step.dim() == 1 else step.repeat_interleave(group, 1)
        assert (err <= step * 0.5 + 1e-6).all()  # round to nearest: half a step at most
    elif scheme.name == "int4":
        step = t["scales"].float().repeat_interleave(group, 1)
        assert (err <= step * (1.0 if sym else 0.5) + 1e-4).all()
    else:  # nf4: the widest gap of the code book is ~0.2 of absmax
        absmax = t["absmax"].float().repeat_interleave(group, 1)
        assert (err <= absmax * 0.16).all()
    assert err.mean() < w.abs().mean() * (0.01 if scheme.name == "int8" else 0.15)


def test_nf4_reference_matches_bitsandbytes():
    import bitsandbytes.functional as bnbf

    w = rand_weight()
    scheme = scheme_of("nf4", 64)
    t = quantize(w, scheme)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    torch.testing.assert_close(dequantize(t, scheme), bnbf.dequantize_4bit(packed, state).float())


@pytest.mark.parametrize("bad", [("int3", None), ("int4", 48), ("nf4", 100), ("int8", 7)])
def test_bad_scheme_or_group_is_refused(bad):
    with pytest.raises(LocalLLMError):
        parse_scheme(*bad)


def test_group_that_divides_nothing_names_the_fit():
    scheme = scheme_of("int4", 128)
    with pytest.raises(LocalLLMError, match="does not divide the input width 576.*--group-size 64"):
        scheme.check_layer("layers.0.attn.q", 576)
    with pytest.raises(LocalLLMError, match="does not divide the input width 100"):
        quantize(torch.randn(4, 100), scheme_of("int4", 32))


def test_quieting_bitsandbytes_restores_its_logger():
    import logging

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    logger.setLevel(logging.INFO)
    try:
        with quiet_bitsandbytes():
            assert logger.level == logging.ERROR
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(logging.NOTSET)
