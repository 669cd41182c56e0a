"""CUDA graphs for decode-only steps (:mod:`runtime.cuda_graphs`), checked without a GPU: the buckets,
and the static buffers and padding rows run on the CPU with the capture replaced by a rerun
(``eager_capture``), through the Triton paged kernel in its interpreter: the logits of each step equal
the eager step's, and the padding rows write nothing but their row 0's own slot. The fake-CUDA dry
run (``tests/test_cuda_dryrun.py``) runs the graphed step in the engine's loop; ``scripts/gpu_checks.sh``
captures real graphs (``test_real_graphs_replay_the_eager_steps``)."""

from __future__ import annotations

import pytest
import torch

from localllm import triton_kernels
from localllm.runtime import cuda_attention
from localllm.runtime.cuda_graphs import GraphedDecode, buckets_for, eager_capture
from localllm.runtime.kv_pool import KVPool, plan_pool
from localllm.runtime.model import cache_rope_tables
from localllm.runtime.paged import PagedStep
from localllm.runtime.scheduler import Chunk
from tests.engines import step_chunk

#: The kernel on CPU tensors runs in Triton's interpreter: tests/conftest.py turns it on where there is no GPU.
needs_triton = pytest.mark.skipif(not triton_kernels.available() or not triton_kernels.interpreting(),
                                  reason="triton is not installed (dev extra), or a GPU is here (the cuda test runs)")


def test_buckets_cover_every_batch_up_to_the_engines():
    assert buckets_for(1) == (1,)
    assert buckets_for(3) == (1, 2, 4)
    assert buckets_for(8) == (1, 2, 4, 8)
    assert buckets_for(9) == (1, 2, 4, 8, 16)
    assert buckets_for(64) == (1, 2, 4, 8, 16, 32)



def decode_steps(model, kv_dtype: str, graphed: bool, device: str = "cpu"):
    """Three prompts prefilled eagerly, then three decode steps of all three sequences (bucket 4: one
    padding row), graphed or eager. Returns each decode step's logits, the pool, the blocks used."""
    config = model.config
    plan = plan_pool(config, 1 << 20, model.dtype, 16, kv_dtype)
    pool = KVPool.allocate(config, plan, torch.device(device))
    n_groups = 1 + max(pool.group_of)
    cos, sin = (t.to(model.dtype) for t in cache_rope_tables(config, 64, torch.device(device)))
    kernel = cuda_attention.paged_span_attention
    graphs = GraphedDecode(model, pool, kernel, cos, sin, max_batch=3,
                           capture=eager_capture if device == "cpu" else None)
    prompts = [[(5 * i + 7 * s) % 300 + 3 for i in range(n)] for s, n in enumerate((21, 5, 33))]
    tables = [[9, 2, 14], [5, 11, 0], [7, 3, 12]]  # scattered blocks; the rest stay zero
    used = {b for t in tables for b in t}

    def chunk(s: int, tokens: list[int], start: int) -> Chunk:
        return step_chunk(tokens, start, tables[s], True, tuple(tables[s] for _ in range(n_groups - 1)))

    with torch.inference_mode():
        step, ids = PagedStep.build(pool, [chunk(s, p, 0) for s, p in enumerate(prompts)], cos, sin, kernel)
        model(ids, step)
        out = []
        for k in range(3):
            specs = [chunk(s, [40 + k + s], len(p) + k) for s, p in enumerate(prompts)]
            step, ids = PagedStep.build(pool, specs, cos, sin, kernel)
            if graphed:
                assert graphs.takes(step)
                out.append(graphs(ids, step).clone())
            else:
                out.append(model(ids, step)[0])
    return out, pool, used, graphs


@needs_triton
@pytest.mark.parametrize("arch,kv_dtype", [("llama", "16bit"), ("gemma3", "16bit"), ("llama", "int8")])
def test_graphed_steps_give_the_eager_steps_logits(span_models, arch, kv_dtype):
    """Each decode step through the static buffers (three sequences in bucket 4: one padding row
    repeating row 0) gives the eager step's logits; the pools agree, and every block no sequence
    holds is still zero: the padding row wrote only row 0's own slot."""
    model = span_models[arch]
    want, eager_pool, used, _ = decode_steps(model, kv_dtype, graphed=False)
    got, pool, _, graphs = decode_steps(model, kv_dtype, graphed=True)
    assert graphs.buckets == (1, 2, 4) and graphs.captured == (4,)
    for w, g in zip(want, got):
        assert g.shape == w.shape == (3, model.config.vocab_size)
        assert torch.allclose(g, w, atol=3e-5, rtol=0), (g - w).abs().max()
    free = [b for b in range(pool.n_blocks) if b not in used]
    for layer in range(model.config.n_layers):
        for mine, theirs in ((pool.k[layer], eager_pool.k[layer]), (pool.v[layer], eager_pool.v[layer])):
            mine, theirs = (mine.codes, theirs.codes) if kv_dtype == "int8" else (mine, theirs)
            assert not mine[free].any()
            if kv_dtype == "16bit":
                assert torch.allclose(mine, theirs, atol=1e-5, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_graphs_replay_the_eager_steps(span_models):
    """On a GPU: the same steps captured into real CUDA graphs give the eager steps' logits."""
    model = span_models["llama"].to("cuda")
    want, *_ = decode_steps(model, "16bit", graphed=False, device="cuda")
    got, _, _, graphs = decode_steps(model, "16bit", graphed=True, device="cuda")
    assert graphs.captured == (4,)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    span_models["llama"].to("cpu")
