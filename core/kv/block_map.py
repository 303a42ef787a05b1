"""A bounded summary of the KV-cache block states, for live views (the ops dashboard).

The pool keeps one state byte per block (`BlockPool.states`). The summary groups the usable blocks
(the null block is left out) into at most `max_cells` runs of equal length and counts the used and
the cached blocks of each run, so its size stays bounded however large the pool is (a GPU pool may
hold 100k blocks) and building it costs a few vectorised passes over one byte per block.
"""
from __future__ import annotations

import msgspec
import numpy as np

from .block_pool import CACHED, NULL_BLOCK_ID, USED

MAX_CELLS = 1024
_PADDING = 255  # fills the end of the last, shorter cell; counted as nothing


class KVBlockMap(msgspec.Struct, array_like=True, gc=False):
    """Cell i covers usable blocks [i * blocks_per_cell, (i + 1) * blocks_per_cell) (the last cell
    may be shorter); `cell_used[i]` of them are held by requests and `cell_cached[i]` are free but
    still hold a prefix-cache entry (evictable: a lookup revives them until they are reused).
    The rest are free."""

    num_blocks: int
    num_used: int
    num_cached: int
    blocks_per_cell: int
    cell_used: list[int]
    cell_cached: list[int]

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_used - self.num_cached


def summarize_block_states(states: bytes | bytearray, max_cells: int = MAX_CELLS) -> KVBlockMap:
    usable = np.frombuffer(states, dtype=np.uint8)[NULL_BLOCK_ID + 1:]
    num_blocks = usable.size
    per_cell = max(1, -(-num_blocks // max_cells))
    num_cells = -(-num_blocks // per_cell)
    grid = np.full(num_cells * per_cell, _PADDING, dtype=np.uint8)
    grid[:num_blocks] = usable
    grid = grid.reshape(num_cells, per_cell)
    used = np.count_nonzero(grid == USED, axis=1)
    cached = np.count_nonzero(grid == CACHED, axis=1)
    return KVBlockMap(num_blocks, int(used.sum()), int(cached.sum()), per_cell, used.tolist(), cached.tolist())
