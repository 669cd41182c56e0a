"""The block manager: allocation, reference counts, the prefix cache's hash chain and its LRU eviction.
Pure bookkeeping (no tensors): every test ends with the manager's own consistency check."""

from __future__ import annotations

from localllm.runtime.block_manager import ROOT_KEY, BlockManager, BlockTable, block_key

BS = 4


def run(bm: BlockManager, tokens: list[int]) -> tuple[BlockTable, int]:
    """Admit ``tokens`` and mark them all computed (as a finished prefill would)."""
    table = BlockTable()
    cached = bm.allocate(table, tokens)
    assert cached is not None
    bm.commit(table, tokens, len(tokens))
    return table, cached


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, BS)
    table = BlockTable()
    assert bm.allocate(table, list(range(10))) == 0  # nothing cached yet
    assert len(table.blocks) == 3 and bm.num_used == 3 and bm.num_free == 5
    assert bm.grow(table, 12) and len(table.blocks) == 3  # still fits the third block
    assert bm.grow(table, 13) and len(table.blocks) == 4  # a token more takes a block
    bm.free(table)
    assert table.blocks == [] and bm.num_used == 0 and bm.num_free == 8 and bm.num_cached == 0
    bm.check()


def test_memory_grows_with_tokens_held():
    bm = BlockManager(8, BS)
    table = BlockTable()
    bm.allocate(table, [1])
    held = []
    for n in range(2, 20):
        assert bm.grow(table, n)
        held.append(bm.num_used)
    assert held == [-(-n // BS) for n in range(2, 20)]
    bm.check()


def test_allocation_fails_whole_when_short():
    bm = BlockManager(4, BS)
    a = BlockTable()
    bm.allocate(a, list(range(12)))  # 3 blocks
    b = BlockTable()
    assert bm.allocate(b, list(range(100, 108))) is None  # needs 2, 1 left: nothing taken
    assert b.blocks == [] and bm.num_free == 1
    assert not bm.grow(a, 17) and len(a.blocks) == 3  # needs 2 more
    assert bm.grow(a, 16) and bm.num_free == 0
    bm.check()


def test_prefix_is_shared_and_refcounted():
    bm = BlockManager(16, BS)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    a, cached = run(bm, prompt)
    assert cached == 0 and len(a.keys) == 2
    b, cached = run(bm, prompt[:8] + [99, 98, 97])
    assert cached == 8 and b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert [bm.refs[x] for x in a.blocks] == [2, 2, 1]
    bm.free(a)
    assert [bm.refs[x] for x in b.blocks] == [1, 1, 1] and bm.num_cached == 0  # still in use by b
    bm.free(b)
    assert bm.num_used == 0 and bm.num_cached == 2  # the two keyed blocks stay for later
    bm.check()


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(16, BS)
    prompt = list(range(8))  # exactly two full blocks
    a, _ = run(bm, prompt)
    b = BlockTable()
    assert bm.allocate(b, prompt) == 4  # the second block is recomputed: its last token gives logits
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    assert bm.cached_prefix(prompt + [8]) == 8  # one token more: both blocks reusable
    bm.check()


def test_same_tokens_after_another_prefix_do_not_match():
    bm = BlockManager(16, BS)
    run(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.cached_prefix([9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0  # block 2's tokens, block 1's differ
    assert bm.cached_prefix([1, 2, 3, 4, 9, 9, 9, 9, 0]) == 4
    assert bm.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 1]) == 8


def test_keys_chain_and_are_stable():
    k1 = block_key(ROOT_KEY, [1, 2, 3, 4])
    assert k1 == block_key(ROOT_KEY, (1, 2, 3, 4))  # lists and tuples alike
    assert block_key(k1, [5, 6, 7, 8]) != block_key(ROOT_KEY, [5, 6, 7, 8])
    assert block_key(ROOT_KEY, [1, 2, 3, 4]) != block_key(ROOT_KEY, [4, 3, 2, 1])


def test_key_is_the_same_in_another_process():
    """Keys are blake2b, not Python's per-process salted hash()."""
    import subprocess
    import sys

    code = ("from localllm.runtime.block_manager import ROOT_KEY, block_key;"
            "print(block_key(ROOT_KEY, [1, 2, 3, 4]).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == block_key(ROOT_KEY, [1, 2, 3, 4]).hex()


def test_cached_blocks_are_evicted_lru_and_only_when_needed():
    bm = BlockManager(6, BS)
    a, _ = run(bm, list(range(0, 9)))  # 2 keyed blocks + 1 partial
    b, _ = run(bm, list(range(100, 109)))
    bm.free(a)
    bm.free(b)
    assert bm.num_cached == 4 and bm.num_free == 6
    # a's prefix used again: its blocks leave the LRU (b's are now the oldest)
    c, cached = run(bm, list(range(0, 9)))
    assert cached == 8 and bm.num_cached == 2
    bm.free(c)
    # 4 new blocks: the 2 plain free ones, then the LRU's oldest cached ones (b's, deepest first)
    d = BlockTable()
    assert bm.allocate(d, list(range(200, 216))) == 0
    assert bm.cached_prefix(list(range(100, 109))) == 0  # b's chain is gone
    assert bm.cached_prefix(list(range(0, 9))) == 8  # a's, used more recently, stays
    bm.check()


def test_eviction_drops_deeper_blocks_first():
    bm = BlockManager(4, BS)
    a, _ = run(bm, list(range(13)))  # 3 keyed blocks + 1 partial: the whole pool
    bm.free(a)
    d = BlockTable()
    assert bm.allocate(d, [500]) == 0  # takes the free (partial) block
    e = BlockTable()
    assert bm.allocate(e, [600]) == 0  # evicts one cached block: the deepest
    assert bm.cached_prefix(list(range(13))) == 8  # the first two blocks still match
    bm.check()


def test_a_revived_cached_block_counts_against_room():
    bm = BlockManager(3, BS)
    a, _ = run(bm, list(range(5)))  # 1 keyed + 1 partial
    bm.free(a)
    b = BlockTable()
    bm.allocate(b, [700])  # 1 free block left besides the cached one
    c = BlockTable()
    # the prompt reuses the cached block and needs 2 more: 1 is there, so it must not fit
    assert bm.allocate(c, list(range(4)) + [1, 2, 3, 4, 5]) is None
    assert bm.num_cached == 1
    bm.check()


def test_duplicate_prefix_computed_twice_keeps_one_cached_copy():
    bm = BlockManager(8, BS)
    a, b = BlockTable(), BlockTable()
    bm.allocate(a, list(range(5)))
    bm.allocate(b, list(range(5)))  # before a committed: no hit
    bm.commit(a, list(range(5)), 5)
    bm.commit(b, list(range(5)), 5)
    bm.free(a)
    bm.free(b)
    assert bm.num_cached == 1 and bm.num_free == 8
    bm.check()


def test_a_window_group_gives_back_the_blocks_its_window_has_left():
    """Two layer groups, one full-context and one with a 6-token window, over one free list: the
    window group takes blocks a chunk at a time and gives back those no later query reads (keyed ones
    to the cache); the full group holds every block."""
    from localllm.runtime.block_manager import RELEASED

    bm = BlockManager(16, BS, windows=(None, 6))
    ids = list(range(100, 121))  # 21 tokens: 6 blocks
    table = BlockTable()
    assert bm.allocate(table, ids, chunk=8) == 0
    assert [len(g) for g in table.groups] == [6, 2]  # every prompt block; the first chunk's
    assert bm.num_used == 8
    bm.commit(table, ids, 8)
    bm.release(table, 8)  # the next query (position 8) reads positions 3..8: blocks 0 to 2 of the window group
    assert table.groups[1][0] != RELEASED
    assert bm.grow(table, 16) and len(table.groups[1]) == 4
    bm.commit(table, ids, 16)
    bm.release(table, 16)  # position 16 reads 11..16: blocks 2 to 4; 0 and 1 go back, keyed: cached
    assert table.groups[1][:2] == [RELEASED, RELEASED] and table.released == [0, 2]
    assert bm.num_used == 6 + 2 and bm.num_cached == 2
    bm.check()
    assert bm.grow(table, 21) and bm.num_used == 6 + 4
    bm.commit(table, ids, 21)
    bm.release(table, 21)  # 16..21: blocks 4 and 5
    assert table.groups[1] == [RELEASED] * 4 + table.groups[1][4:] and bm.num_used == 6 + 2
    bm.free(table)
    assert bm.num_used == 0 and bm.num_cached == 10  # 5 full blocks per group were keyed
    bm.check()


def test_a_window_group_reuses_a_prefix_whose_window_is_cached():
    """A prefix is reused as far as the full group has every block and the window group the blocks
    of the window behind the prefix's end; the window group's earlier places stay released."""
    from localllm.runtime.block_manager import RELEASED

    bm = BlockManager(14, BS, windows=(None, 6))
    prompt = list(range(200, 224))  # 24 tokens: 6 full blocks
    first, _ = run(bm, prompt)  # every block of both groups computed and keyed
    bm.free(first)
    again = BlockTable()
    assert bm.allocate(again, prompt + [7, 8], chunk=4) == 24
    assert again.groups[1][:4] == [RELEASED] * 4  # a query at 24 reads 19..24: blocks 4, 5 and the new 6
    assert RELEASED not in again.groups[0] and again.released == [0, 4]
    bm.free(again)
    bm.check()
    # The window group's blocks 4 and 5 evicted first (a new prompt's 4 blocks find only 2 free):
    # the prefix is cut back to where the window's blocks are all cached.
    window_4, window_5 = (bm._by_key[(1, k)] for k in bm._keys(prompt, 6)[4:6])
    for b in (window_5, window_4):
        bm._lru.move_to_end(b, last=False)
    other = BlockTable()
    assert bm.allocate(other, list(range(100, 112)), chunk=4) == 0
    assert window_4 in other.groups[0] + other.groups[1] and window_5 in other.groups[0] + other.groups[1]
    third = BlockTable()
    assert bm.allocate(third, prompt + [9], chunk=4) == 16  # a query at 16 reads 11..16: blocks 2, 3, 4
    assert third.groups[1][:2] == [RELEASED] * 2 and len(third.groups[1]) == 5 and len(third.groups[0]) == 7
    assert bm.num_free == 0
    bm.free(other)
    bm.free(third)
    bm.check()
