"""The pool of KV-cache blocks: reference counts, the LRU free list and the hash -> block map.

Block 0 is reserved as the null block: the worker pads block tables with 0 (and padded slots of
captured graphs may write there), so it never holds a request's K/V and is never handed out.
`num_usable_blocks` is therefore `num_blocks - 1`.

A freed block keeps its hash and stays findable by prefix lookups until it reaches the head of
the free list and is reused; only then is its hash evicted.

`states` holds one byte per block (FREE, USED, or CACHED: free but still findable), kept up to date
at each change so a live view can summarize the pool without walking 100k block objects.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

NULL_BLOCK_ID = 0
FREE, USED, CACHED = 0, 1, 2


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class BlockPool:
    """Owns every block; callers check `num_free` before `allocate`."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int, int], None] | None = None):
        """`on_evict(block_id, block_hash)` is told of each cached block `allocate` reuses."""
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache needs at least 2 blocks (one is the reserved null block), got {num_blocks}; "
                "give the KV cache more memory"
            )
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1
        self.states = bytearray(num_blocks)
        self.states[NULL_BLOCK_ID] = USED
        # Insertion order is eviction order: head = least recently freed. OrderedDict gives O(1)
        # removal from the middle, needed when a prefix hit revives a free cached block.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[int, KVBlock] = {}
        self._on_evict = on_evict

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free list, evicting their cached hashes."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks with only {len(self._free)} free")
        taken = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self._on_evict is not None:
                    self._on_evict(block.block_id, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            self.states[block.block_id] = USED
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix lookup."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                self.states[block.block_id] = USED
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching zero join the tail of the free list in the given order."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                self.states[block.block_id] = FREE if block.block_hash is None else CACHED

    def forget_cached(self) -> None:
        """Drop every hash (the KV tensors were freed, so no block holds what its hash says); the
        blocks stay where they are. Only while no request holds a block."""
        if len(self._free) != self.num_usable_blocks:
            raise RuntimeError("the prefix cache can only be dropped while no request holds KV blocks")
        for block in self._cached.values():
            block.block_hash = None
            self.states[block.block_id] = FREE
        self._cached.clear()

    def cache(self, block: KVBlock, block_hash: int) -> None:
        """Make a full, computed block findable by its hash.

        When another block already holds the same content (two requests prefilled it at the
        same time), the first one stays the cached copy and this one is left unhashed.
        """
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block
