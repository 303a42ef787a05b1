"""KV connectors move a latent (one-part) cache's blocks as they move K/V: `KVCacheAccess` gathers
`[layers, parts, blocks, block_size, heads, dim]` with one part, and scatters it back in place."""
from __future__ import annotations

import torch
from corectl.attention import AttentionBackend
from corectl.kv_transfer.base import KVCacheAccess


def test_a_one_part_cache_gathers_and_scatters_its_blocks():
    caches = [torch.randn(AttentionBackend.kv_cache_shape(6, 4, 1, 40, parts=1)) for _ in range(3)]
    access = KVCacheAccess(lambda: caches, 4, lambda tensors: None, False, "gloo")
    assert access.block_shape() == (3, 1, 4, 1, 40)
    blocks = access.gather([5, 2])
    assert blocks.shape == (3, 1, 2, 4, 1, 40) and torch.equal(blocks[1, 0, 1], caches[1][0, 2])
    access.scatter([0, 3], blocks)
    assert all(torch.equal(cache[:, [0, 3]], cache[:, [5, 2]]) for cache in caches)
