"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes up to and including that block. We use BLAKE2b (128-bit digest) rather than Python's
`hash()`: it is stable across processes (a hash can travel to another engine process or a KV
event consumer) and collision resistant, so a crafted prompt cannot alias another user's cached
blocks and read their K/V -- the attack that made vLLM move to SHA-256 by default. It costs about
a microsecond per block, paid once per full block of a request.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_DIGEST_SIZE = 16
_ROOT = bytes(_DIGEST_SIZE)


def hash_block(parent: int | None, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Hash of one full block given its parent block's hash (None for the first block); `extra`:
    the content hashes of the images whose placeholder tokens the block holds."""
    digest = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    digest.update(_ROOT if parent is None else parent.to_bytes(_DIGEST_SIZE, "little"))
    # Fixed-width encoding, so token runs like (1, 23) and (12, 3) never share a byte string.
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra)
    return int.from_bytes(digest.digest(), "little")


def adapter_root(lora_int_id: int | None) -> int | None:
    """The parent of a request's first block: None for the base model, else a hash of its LoRA
    adapter's id, so the K/V an adapter computed is never found by another adapter or the base."""
    if lora_int_id is None:
        return None
    return hash_block(None, [-1, lora_int_id])


def request_root(lora_int_id: int | None, cache_salt: str | None) -> int | None:
    """The parent of a request's first block: its adapter's root, salted with the request's
    `cache_salt` when it has one, so only requests with the same adapter and the same salt share
    blocks (one tenant cannot probe another's prompts by timing its cache hits)."""
    root = adapter_root(lora_int_id)
    if cache_salt is None:
        return root
    digest = hashlib.blake2b(digest_size=_DIGEST_SIZE, person=b"corectl-salt")
    digest.update(_ROOT if root is None else root.to_bytes(_DIGEST_SIZE, "little"))
    digest.update(cache_salt.encode())
    return int.from_bytes(digest.digest(), "little")


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int,
                        root: int | None = None, images: Sequence[tuple[int, int, bytes]] = ()) -> list[int]:
    """Grow `hashes` in place to cover the first `num_blocks` full blocks of `token_ids`; `root` is
    the first block's parent (`request_root`). `images` are (first, end, content hash) of each
    image's placeholder run: a block holding placeholders hashes the image's content with them,
    since every image's placeholders are the same token id."""
    parent = hashes[-1] if hashes else root
    for index in range(len(hashes), num_blocks):
        start = index * block_size
        extra = b"".join(digest for first, end, digest in images if first < start + block_size and start < end)
        parent = hash_block(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes
