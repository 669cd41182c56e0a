"""Loading costs memory in proportion to the weights: a scheme with fewer bytes a weight needs less.

Each figure is measured in a fresh process: the growth of its peak resident set (VmHWM, reset after
the imports) over its resident set before the load, through loading SmolLM2 and generating a few
tokens. Memory is not timing: the figures move by a few MB between runs and machines, and the bounds
leave far more room than that (the load that held a dequantized head, the kernel layout beside the
canonical tensors and the file's mapped pages peaked at 3.6x the int4 weights and KV cache, above
bf16's peak).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")]

CTX = 4096  # what `localllm run` uses for SmolLM2
MB = 2**20

MEASURE = """
import json, sys
import torch
from localllm.loaders.load import load_model
from localllm.runtime.engine import Engine
from localllm.runtime.kv_pool import cache_bytes
from localllm.runtime.sampling import SamplingParams


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024


try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS, so the peak is the load's, not the imports'
except OSError:
    pass
base = status("VmRSS")
lm = load_model(sys.argv[1], device="cpu", quant=sys.argv[2])
engine = Engine(lm.model, lm.tokenizer, ctx=int(sys.argv[3]))
"".join(engine.complete("The capital of France is", SamplingParams(temperature=0), max_tokens=4))
kv = cache_bytes(lm.config, int(sys.argv[3]), lm.dtype)
print(json.dumps({"peak": status("VmHWM") - base, "weights": lm.weight_bytes, "kv": kv}))
"""


@pytest.fixture(scope="module")
def growth(smollm2_path):
    """Scheme -> {peak, weights, kv} in bytes, each measured in its own process."""
    figures = {}

    def measure(scheme: str) -> dict[str, int]:
        if scheme not in figures:
            out = subprocess.run([sys.executable, "-c", MEASURE, str(smollm2_path), scheme, str(CTX)],
                                 capture_output=True, text=True, timeout=300, check=True)
            figures[scheme] = json.loads(out.stdout.strip().splitlines()[-1])
        return figures[scheme]

    return measure


@pytest.mark.parametrize("scheme", ["int4", "int8", "bf16"])
def test_peak_memory_is_the_weights_and_cache_plus_little(growth, scheme):
    f = growth(scheme)
    bound = 1.5 * (f["weights"] + f["kv"]) + 100 * MB
    assert f["peak"] <= bound, (f"{scheme}: peak RSS growth {f['peak'] / MB:.0f} MB for {f['weights'] / MB:.0f} MB of "
                                f"weights and {f['kv'] / MB:.0f} MB of KV cache (bound {bound / MB:.0f} MB)")


def test_fewer_bits_need_less_memory(growth):
    int4, int8, bf16 = growth("int4"), growth("int8"), growth("bf16")
    assert int4["weights"] < int8["weights"] < bf16["weights"]
    assert int4["peak"] < bf16["peak"] and int8["peak"] < bf16["peak"], \
        {k: f["peak"] // MB for k, f in (("int4", int4), ("int8", int8), ("bf16", bf16))}
