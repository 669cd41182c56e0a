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


@dataclass
class BlockTable:
    """One sequence's blocks, in token order: token ``p`` is in ``blocks[p // block_size]``."""

    blocks: list[int] = field(default_factory=list)
    #: Keys of the leading full blocks whose tokens are computed (``len(keys)`` of them): the chain
    #: the next full block's key continues.
    keys: list[bytes] = field(default_factory=list)


class BlockManager:
    """Block bookkeeping for a pool of ``n_blocks`` blocks of ``block_size`` tokens.

    ``prefix_cache=False`` keys no block and reuses none: every prompt is computed whole (the
    baseline the prefix cache is measured against)."""

    def __init__(self, n_blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced blocks, oldest first
        self._key_of: dict[int, bytes] = {}  # block -> key, for keyed blocks (in use or cached)
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # block -> its token ids, to check a hit
        self._by_key: dict[bytes, int] = {}  # key -> block
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
        """Blocks holding ``tokens`` positions."""
        return -(-tokens // self.block_size)

    # Prefix cache --------------------------------------------------------------------------------
    def _keys(self, token_ids: Sequence[int], n_blocks: int) -> list[bytes]:
        keys, parent, bs = [], ROOT_KEY, self.block_size
        for i in range(n_blocks):
            parent = block_key(parent, token_ids[i * bs : (i + 1) * bs])
            keys.append(parent)
        return keys

    def _match(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The cached blocks (and their keys) of the longest reusable prefix of ``token_ids``."""
        bs = self.block_size
        limit = (len(token_ids) - 1) // bs if self.prefix_cache else 0  # leave at least one token to compute
        hits: list[int] = []
        keys: list[bytes] = []
        parent = ROOT_KEY
        for i in range(limit):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            key = block_key(parent, chunk)
            block = self._by_key.get(key)
            if block is None or self._tokens_of[block] != chunk:  # the check makes a collision harmless
                break
            hits.append(block)
            keys.append(key)
            parent = key
        return hits, keys

    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` that :meth:`allocate` would take from the cache now."""
        return len(self._match(token_ids)[0]) * self.block_size

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

    def allocate(self, table: BlockTable, token_ids: Sequence[int]) -> int | None:
        """Give an empty ``table`` blocks for all of ``token_ids``, reusing the longest cached prefix.

        Returns the number of tokens whose keys/values the cached blocks already hold (a multiple of
        the block size, less than ``len(token_ids)``), or None, changing nothing, when the pool has
        too few blocks now.
        """
        if table.blocks:
            raise RuntimeError("allocate() is for a sequence that holds no blocks")
        hits, keys = self._match(token_ids)
        new = self.blocks_for(len(token_ids)) - len(hits)
        revived = sum(1 for b in hits if self.refs[b] == 0)  # cached hits leave the evictable set
        if new + revived > self.num_free:
            return None
        for b in hits:
            if self.refs[b] == 0:
                del self._lru[b]
            self.refs[b] += 1
        table.blocks = hits + [self._take() for _ in range(new)]
        table.keys = keys
        cached = len(hits) * self.block_size
        self.hit_tokens += cached
        self.query_tokens += len(token_ids)
        return cached

    def grow(self, table: BlockTable, tokens: int) -> bool:
        """Make ``table`` hold ``tokens`` positions, taking blocks as needed; False (nothing taken)
        when the pool has too few."""
        need = self.blocks_for(tokens) - len(table.blocks)
        if need > self.num_free:
            return False
        table.blocks.extend(self._take() for _ in range(need))
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
            block = table.blocks[i]
            if key not in self._by_key and block not in self._key_of:
                self._by_key[key] = block
                self._key_of[block] = key
                self._tokens_of[block] = chunk

    def free(self, table: BlockTable) -> None:
        """Drop ``table``'s references. A block no one references goes to the cache if keyed, else to
        the free list. Last block first, so that a prefix's deeper blocks are evicted before the
        blocks they extend (a block is reusable only with all of its parents)."""
        for block in reversed(table.blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._key_of:
                    self._lru[block] = None
                else:
                    self._free.append(block)
        table.blocks = []
        table.keys = []

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
