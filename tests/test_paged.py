"""A batch step over the paged pool (runtime/paged.py): built from the scheduler's chunks, one block
table per layer group."""

from __future__ import annotations

import pytest
import torch

from localllm.runtime.config import ModelConfig
from localllm.runtime.kv_pool import KVPool, plan_pool
from localllm.runtime.model import cache_rope_tables
from localllm.runtime.paged import PagedStep
from tests.engines import step_chunk


def test_a_step_over_layer_groups_needs_a_table_for_each():
    """A pool of several layer groups (Gemma 3 style) takes a chunk only with a table per group: one
    table alone would let every layer read the first group's blocks."""
    config = ModelConfig(vocab_size=32, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, intermediate_size=128,
                         head_dim=16, sliding_window=8, layer_types=["sliding", "full"])
    pool = KVPool.allocate(config, plan_pool(config, 1 << 16, torch.float32, 16), torch.device("cpu"))
    assert pool.group_of == [1, 0]
    cos, sin = cache_rope_tables(config, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"tables of \[1\] blocks \(2 layer groups"):
        PagedStep.build(pool, [step_chunk([1, 2, 3], 0, [0], True)], cos, sin)
    step, _ = PagedStep.build(pool, [step_chunk([1, 2, 3], 0, [0], True, ([5],))], cos, sin)
    assert step.layer(0, 8).step is step.groups[1] and step.layer(1, None).step is step
    assert step.groups[1].write_blocks.tolist() == [5, 5, 5] and step.write_blocks.tolist() == [0, 0, 0]
