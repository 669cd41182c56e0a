"""Which KV pool block holds what: the free list, per-sequence block tables and the prefix cache.

A block is in exactly one of three states:

* **free**: holds nothing worth keeping (the free list);
* **in use**: referenced by one or more sequences' block tables (``refs > 0``);
* **cached**: referenced by none, but full and keyed (below), kept in an LRU list so that a later
  sequence with the same prefix reuses it; evicted (oldest first) only when a block is needed and the
  free list is empty.

A *full* block (``block_size`` tokens whose keys/values are computed) gets a key: a hash of its
parent block's key and its own token ids (blake2b, stable across processes), so the key names the whole
prefix up to the block's end: the same tokens after a different prefix get a different key. A new
sequence takes, read-only and reference-counted, the longest run of keyed blocks matching its
tokens from the start, and computes only the rest. At least one token is always left to compute
(its logits pick the next token), so at most ``(len - 1) // block_size`` blocks are reused; the
block being written (the last, partial one) is never shared.

A pool of several layer groups (:func:`runtime.kv_pool.layer_groups`) gives each sequence a block
table per group, all drawn from the one free list; a group's blocks are keyed by the same prefix
keys, within that group. A sliding-window group's table gives back its blocks that the window has
left (:meth:`BlockManager.release`; they stay cached when keyed, their places in the table marked
``-1``), takes a prompt's blocks one chunk at a time, and a prefix is reusable in it when the
blocks of the window behind its end are cached (the earlier ones are never read).

This module knows token ids and block ids only: no tensors, no model.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

#: The parent key of a sequence's first block.
ROOT_KEY = b"localllm-kv-prefix-v1"


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: blake2b over its parent's key and its token ids (as int64 bytes)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


#: A table's entry for a block a sliding window has left (given back).
RELEASED = -1


@dataclass
class BlockTable:
    """One sequence's blocks, in token order, per layer group: token ``p`` is in
    ``groups[g][p // block_size]`` (:data:`RELEASED` for a block a window has left)."""

    groups: list[list[int]] = field(default_factory=list)
    #: Keys of the leading full blocks whose tokens are computed (``len(keys)`` of them): the chain
    #: the next full block's key continues (the same in every group).
    keys: list[bytes] = field(default_factory=list)
    #: Per group, the leading entries given back (:meth:`BlockManager.release`).
    released: list[int] = field(default_factory=list)

    @property
    def blocks(self) -> list[int]:
        """The first group's table (a model without windows has no other)."""
        return self.groups[0] if self.groups else []


class BlockManager:
    """Block bookkeeping for a pool of ``n_blocks`` blocks of ``block_size`` tokens.

    ``prefix_cache=False`` keys no block and reuses none: every prompt is computed whole (the
    baseline the prefix cache is measured against). ``windows``: each layer group's attention window
    (None: the whole context), a block table per group."""

    def __init__(self, n_blocks: int, block_size: int, prefix_cache: bool = True,
                 windows: Sequence[int | None] = (None,)) -> None:
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.windows = tuple(windows) or (None,)
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced blocks, oldest first
        self._key_of: dict[int, tuple[int, bytes]] = {}  # block -> (group, key), for keyed blocks
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # block -> its token ids, to check a hit
        self._by_key: dict[tuple[int, bytes], int] = {}  # (group, key) -> block
        #: Prompt tokens served from the cache, and looked up, since creation (for metrics).
        self.hit_tokens = 0
        self.query_tokens = 0

    # Counts --------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free ones plus cached ones (evicted on demand)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their prefix."""
        return len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks referenced by some sequence."""
        return self.n_blocks - self.num_free

    def blocks_for(self, tokens: int) -> int:
        """Blocks holding ``tokens`` positions (in one group)."""
        return -(-tokens // self.block_size)

    def _window_start(self, g: int, tokens: int) -> int:
        """Group ``g``'s first block a query at position ``tokens`` (or later) still reads."""
        window = self.windows[g]
        return 0 if window is None else max(0, (tokens - window + 1) // self.block_size)

    # Prefix cache --------------------------------------------------------------------------------
    def _keys(self, token_ids: Sequence[int], n_blocks: int) -> list[bytes]:
        keys, parent, bs = [], ROOT_KEY, self.block_size
        for i in range(n_blocks):
            parent = block_key(parent, token_ids[i * bs : (i + 1) * bs])
            keys.append(parent)
        return keys

    def _cached(self, g: int, key: bytes, chunk: tuple[int, ...]) -> int | None:
        block = self._by_key.get((g, key))
        if block is None or self._tokens_of[block] != chunk:  # the check makes a collision harmless
            return None
        return block

    def _match(self, token_ids: Sequence[int]) -> tuple[list[list[int]], list[bytes]]:
        """Per group, the table of the longest prefix of ``token_ids`` all groups can reuse (a window
        group's blocks before its window :data:`RELEASED`), and the prefix blocks' keys."""
        bs = self.block_size
        limit = (len(token_ids) - 1) // bs if self.prefix_cache else 0  # leave at least one token to compute
        full = [g for g, w in enumerate(self.windows) if w is None]
        found: list[list[int | None]] = [[] for _ in self.windows]
        keys: list[bytes] = []
        parent = ROOT_KEY
        for i in range(limit):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            key = block_key(parent, chunk)
            hits = [self._cached(g, key, chunk) for g in range(len(self.windows))]
            if any(hits[g] is None for g in full):  # a full-context group needs every block
                break
            for g, b in enumerate(hits):
                found[g].append(b)
            keys.append(key)
            parent = key
        n = len(keys)
        while n > 0 and any(  # a window group needs the blocks its window holds at the prefix's end
                b is None for g in range(len(self.windows)) for b in found[g][self._window_start(g, n * bs) : n]):
            n -= 1
        tables: list[list[int]] = []
        for g, blocks in enumerate(found):
            start = self._window_start(g, n * bs)
            tables.append([RELEASED] * start + [b for b in blocks[start:n] if b is not None])
        return tables, keys[:n]

    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` that :meth:`allocate` would take from the cache now."""
        return len(self._match(token_ids)[1]) * self.block_size

    # Allocation ----------------------------------------------------------------------------------
    def _take(self) -> int:
        """A block for new tokens: a free one, else the least recently used cached one (its key dropped)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._lru.popitem(last=False)
            key = self._key_of.pop(block)
            del self._tokens_of[block]
            if self._by_key.get(key) == block:
                del self._by_key[key]
        self.refs[block] = 1
        return block

    def allocate(self, table: BlockTable, token_ids: Sequence[int], chunk: int | None = None) -> int | None:
        """Give an empty ``table`` blocks for ``token_ids``, reusing the longest cached prefix: every
        block of the prompt in full-context groups, in sliding-window groups those up to ``chunk``
        tokens past the reused prefix (the first chunk to compute; :meth:`grow` takes the rest).

        Returns the number of tokens whose keys/values the cached blocks already hold (a multiple of
        the block size, less than ``len(token_ids)``), or None, changing nothing, when the pool has
        too few blocks now.
        """
        if table.groups:
            raise RuntimeError("allocate() is for a sequence that holds no blocks")
        hits, keys = self._match(token_ids)
        cached = len(keys) * self.block_size
        ends = [len(token_ids) if w is None or chunk is None else min(len(token_ids), cached + chunk)
                for w in self.windows]
        new = sum(self.blocks_for(end) - len(keys) for end in ends)
        used = [b for group in hits for b in group if b != RELEASED]
        revived = sum(1 for b in used if self.refs[b] == 0)  # cached hits leave the evictable set
        if new + revived > self.num_free:
            return None
        for b in used:
            if self.refs[b] == 0:
                del self._lru[b]
            self.refs[b] += 1
        table.groups = [group + [self._take() for _ in range(self.blocks_for(end) - len(keys))]
                        for group, end in zip(hits, ends)]
        table.released = [self._window_start(g, cached) for g in range(len(self.windows))]
        table.keys = keys
        self.hit_tokens += cached
        self.query_tokens += len(token_ids)
        return cached

    def grow(self, table: BlockTable, tokens: int) -> bool:
        """Make ``table`` hold ``tokens`` positions in every group, taking blocks as needed; False
        (nothing taken) when the pool has too few."""
        needs = [self.blocks_for(tokens) - len(group) for group in table.groups]
        if sum(max(0, n) for n in needs) > self.num_free:
            return False
        for group, n in zip(table.groups, needs):
            group.extend(self._take() for _ in range(n))
        return True

    def commit(self, table: BlockTable, token_ids: Sequence[int], computed: int) -> None:
        """Key the blocks that ``computed`` tokens (of ``token_ids``) have filled, so that later
        sequences can reuse them. A block whose key another block already has stays unkeyed (two
        sequences computed the same prefix at once): the first stays the cached one."""
        bs = self.block_size
        if not self.prefix_cache:
            return
        for i in range(len(table.keys), computed // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            key = block_key(table.keys[-1] if table.keys else ROOT_KEY, chunk)
            table.keys.append(key)
            for g, group in enumerate(table.groups):
                block = group[i]
                if block != RELEASED and (g, key) not in self._by_key and block not in self._key_of:
                    self._by_key[(g, key)] = block
                    self._key_of[block] = (g, key)
                    self._tokens_of[block] = chunk

    def _drop(self, block: int) -> None:
        """One reference fewer; a block no one references goes to the cache if keyed, else is free."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._key_of:
                self._lru[block] = None
            else:
                self._free.append(block)

    def release(self, table: BlockTable, computed: int) -> None:
        """Give back the blocks of ``table``'s sliding-window groups that no query from position
        ``computed`` on reads (keyed ones stay cached for a later prefix)."""
        for g, group in enumerate(table.groups):
            end = min(self._window_start(g, computed), len(group))
            for i in range(table.released[g], end):
                if group[i] != RELEASED:
                    self._drop(group[i])
                    group[i] = RELEASED
            table.released[g] = max(table.released[g], end)

    def free(self, table: BlockTable) -> None:
        """Drop ``table``'s references. A block no one references goes to the cache if keyed, else to
        the free list. Last block first, so that a prefix's deeper blocks are evicted before the
        blocks they extend (a block is reusable only with all of its parents)."""
        for group in table.groups:
            for block in reversed(group):
                if block != RELEASED:
                    self._drop(block)
        table.groups = []
        table.keys = []
        table.released = []

    def check(self) -> None:
        """Raise AssertionError unless every block is in exactly one state (for tests)."""
        free, cached = set(self._free), set(self._lru)
        used = {b for b in range(self.n_blocks) if self.refs[b] > 0}
        if len(free) != len(self._free) or free & cached or free & used or cached & used:
            raise AssertionError("a block is in two states")
        if len(free) + len(cached) + len(used) != self.n_blocks:
            raise AssertionError("a block is in no state")
        if any(r < 0 for r in self.refs) or not cached <= set(self._key_of):
            raise AssertionError("bad reference count or unkeyed cached block")
        if any(self._key_of.get(b) != k for k, b in self._by_key.items()):
            raise AssertionError("key map out of sync")
