"""The paged KV pool (runtime/kv_pool.py): its blocks sized from a memory budget, a sequence's rows
read back in order, and a pool of window layers in groups."""

from __future__ import annotations

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.runtime.config import ModelConfig
from localllm.runtime.kv_pool import KVPool, plan_pool


def test_pool_is_sized_from_the_budget():
    config = ModelConfig(vocab_size=32, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128)
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # k+v, layers, kv heads, block, head_dim, fp32
    plan = plan_pool(config, per_block * 10 + 5, torch.float32, block_size=16)
    assert plan.n_blocks == 10 and plan.bytes_per_block == per_block and plan.tokens == 160
    assert "10 blocks x 16 tokens = 160 tokens" in plan.describe()
    pool = KVPool.allocate(config, plan, torch.device("cpu"))
    assert len(pool.k) == 2 and pool.k[0].shape == (10, 2, 16, 16)
    assert plan_pool(config, per_block * 10, torch.bfloat16, 32).n_blocks == 10  # half the bytes, twice the rows
    with pytest.raises(LocalLLMError, match=f"takes {per_block} bytes"):
        plan_pool(config, per_block - 1, torch.float32)


def test_gather_reads_a_sequence_back_in_order():
    config = ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64)
    pool = KVPool.allocate(config, plan_pool(config, 10**6, torch.float32, 4), torch.device("cpu"))
    blocks = [5, 2, 7]
    for i, b in enumerate(blocks):
        for r in range(4):
            pool.k[0][b, :, r] = 4 * i + r
    k, _ = pool.gather(0, torch.tensor(blocks), 10)
    assert k.shape == (1, 1, 10, 16) and k[0, 0, :, 0].tolist() == list(range(10))


def test_a_pool_of_gemma_layers_groups_them_by_window():
    config = ModelConfig(vocab_size=32, dim=64, n_layers=6, n_heads=4, n_kv_heads=1, intermediate_size=128,
                         head_dim=16, sliding_window=32, layer_types=["sliding"] * 5 + ["full"])
    per_block = 2 * 1 * 1 * 16 * 16 * 4  # k+v, 1 layer per block (the fewest of a kind), kv heads, rows, hd, fp32
    plan = plan_pool(config, per_block * 100, torch.float32, block_size=16)
    assert plan.windows == (None, 32, 32, 32, 32, 32) and plan.n_blocks == 100
    # one sequence alone: every block of the full group, at most 3 per window group
    assert plan.tokens == (100 - 5 * 3) * 16
    assert "6 layer groups (1 full-context, 5 holding only their 32-token window)" in plan.describe()
    pool = KVPool.allocate(config, plan, torch.device("cpu"))
    assert len({id(t) for t in pool.k}) == 1 and pool.group_of == [1, 2, 3, 4, 5, 0]


def test_device_bytes_are_what_allocate_puts_on_each_device():
    """A pool split between devices (meta standing in for the GPU): device_bytes equals the bytes of
    allocate's tensors on each; a layer group's slot on both sides has a tensor on each."""
    from localllm.runtime.kv_pool import device_bytes

    config = ModelConfig(vocab_size=32, dim=64, n_layers=6, n_heads=4, n_kv_heads=1, intermediate_size=128,
                         head_dim=16, sliding_window=32, layer_types=["sliding", "full"] * 3)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    for kv_dtype in ("16bit", "int8"):
        plan = plan_pool(config, 10**5, torch.float32, block_size=16, kv_dtype=kv_dtype)
        for devices in ([cpu] * 6, [cpu] * 3 + [meta] * 3, [cpu] + [meta] * 5):
            pool = KVPool.allocate(config, plan, devices)
            parts = {id(p): p for kv in pool.k + pool.v  # distinct tensors (an int8 pool's codes and scales)
                     for p in ((kv,) if isinstance(kv, torch.Tensor) else (kv.codes, kv.scales))}
            on = {d: sum(t.numel() * t.element_size() for t in parts.values() if t.device == d) for d in (cpu, meta)}
            assert device_bytes(config, plan, devices) == {d: b for d, b in on.items() if b}, (kv_dtype, devices)
        # groups full (1, 3, 5) and sliding (0, 2, 4): three slots; split after layer 2, slot 1 (layers
        # 2 and 3) crosses it and has a full tensor on each side
        two_slots = 2 * plan.bytes // 3
        assert device_bytes(config, plan, [cpu] * 3 + [meta] * 3) == {cpu: two_slots, meta: two_slots}
