"""KVCacheManager: the one interface the scheduler has to the paged KV cache.

The scheduler speaks in requests and token counts and gets block ids back; blocks, reference
counts and hashes stay inside (vLLM's `KVCacheBlocks` idea).

Prefix caching: each FULL block of a request is keyed by a chained hash of its tokens
(`block_hash.py`). `lookup_prefix` returns the longest run of cached full blocks, never covering
every token of the request (the last token must be computed so the model yields logits).
`commit` makes a request's newly full blocks findable. The scheduler commits right after it
schedules the tokens that fill them, before the step runs: the next lookup happens only after
that step has written the K/V.

`n` samples of one request share their prompt blocks through this cache: the scheduler lets one
sample prefill and commit first, the others then hit its blocks. With prefix caching disabled
nothing is shared and each sample prefills on its own.

Sliding windows (`sliding_window`, set only when every layer of the model attends within one):
a token at position p reads keys from p - W + 1 on, so once a request's next token to compute is
at c, its blocks that end before c - W + 1 are never read again. `allocate` returns them to the
pool (tail of the free list, keeping their hashes) and leaves the null block in their place in
the request's list, so block indices still map to positions; a prefix hit does not even take
them. The prefix cache stays correct: a hit is a run of cached blocks from the first one on,
every block of it holding its hashed tokens' K/V (a freed block keeps its K/V until it is reused,
which evicts its hash first), so a block that has left the cache breaks the chain and no later
block is found past it. A request's hashes come from its token ids, not its blocks, so the blocks
it still holds are committed as usual.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..request import Request
from .block_hash import extend_block_hashes, request_root
from .block_map import MAX_CELLS, KVBlockMap, summarize_block_states
from .block_pool import NULL_BLOCK_ID, BlockPool, KVBlock


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached blocks a request can start from; pass it to `allocate` at once (it is not pinned).

    `num_queried_tokens` is the number of tokens looked up (0 when the lookup was skipped).
    """

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    num_queried_tokens: int = 0


_NO_HIT = PrefixHit()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, on_evict: Callable[[int, int], None] | None = None,
                 whole_images: bool = False):
        """`sliding_window`: the window every layer of the model attends within (None: some layer,
        or every one, attends to the whole context, so no block is returned early); `on_evict(block_id,
        block_hash)` hears of each cached block the pool hands to a new owner (a host tier keeps it);
        `whole_images`: image tokens attend to each other both ways (Gemma 3), so a prefix hit ends
        at the last block boundary before an image it would end inside, and the image is
        prefilled whole in one chunk."""
        self.pool = BlockPool(num_blocks, on_evict)
        self.whole_images = whole_images
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_committed: dict[str, int] = {}
        # Leading blocks of each request already returned for lying before its window.
        self._num_windowed_out: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Blocks returned to the pool before their request finished (sliding windows).
        self.num_windowed_out_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_usable_blocks

    def block_map(self, max_cells: int = MAX_CELLS) -> KVBlockMap:
        """Used, cached and free blocks, summarized in at most `max_cells` cells (live views)."""
        return summarize_block_states(self.pool.states, max_cells)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the KV tensors behind them were freed); no request may hold blocks."""
        self.pool.forget_cached()

    def holds_blocks(self, req: Request) -> bool:
        return req.request_id in self._req_blocks

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(req.request_id, ())]

    def lookup_prefix(self, req: Request) -> PrefixHit:
        """Longest run of cached full blocks at the start of the request's tokens.

        Requests asking for prompt logprobs skip the lookup: they need logits at every position.
        """
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return _NO_HIT
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in self._block_hashes(req, max_blocks)[:max_blocks]:
            block = self.pool.cached_block(block_hash)
            if block is None:
                break
            hit.append(block.block_id)
        hit = hit[:self._image_bound(len(hit), req)]
        return PrefixHit(tuple(hit), len(hit) * self.block_size, req.num_tokens)

    def _image_bound(self, num_blocks: int, req: Request) -> int:
        """How many of a hit's `num_blocks` blocks to keep so that it ends outside every image,
        when images must be prefilled whole (a hit may stop short anywhere: an evicted block)."""
        if not self.whole_images:
            return num_blocks
        for item in req.mm_inputs:
            if item.offset < num_blocks * self.block_size < item.end:
                return item.offset // self.block_size
        return num_blocks

    def allocate(self, req: Request, num_new_tokens: int, prefix_hit: PrefixHit | None = None) -> list[int] | None:
        """Give the request room for `num_new_tokens` more tokens; returns the new block ids.

        With `prefix_hit` (a request's first allocation) the hit blocks become its first blocks
        and the new tokens follow them. Returns None, changing nothing, when the free blocks do
        not suffice. Under a sliding window it first returns the request's blocks that lie wholly
        before the window of its next token (see the module doc).
        """
        blocks = self._req_blocks.get(req.request_id)
        if prefix_hit is None and blocks is not None:
            self._release_out_of_window(req, blocks, req.num_computed_tokens)
            # The common case, a running request whose blocks still hold the new tokens (a decode
            # needs a new block once every block_size steps).
            num_needed = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(blocks)
            if num_needed <= 0:
                return []
        if prefix_hit is not None and blocks:
            raise RuntimeError(f"request {req.request_id} already holds KV blocks; a prefix hit only applies first")
        hit_blocks = [self.pool.blocks[i] for i in prefix_hit.block_ids] if prefix_hit else []
        num_computed = prefix_hit.num_tokens if prefix_hit else req.num_computed_tokens
        # Hit blocks before the window of the first token to compute are not needed at all.
        num_skipped = min(self._num_before_window(num_computed), len(hit_blocks))
        num_held = len(hit_blocks) + (len(blocks) if blocks else 0)
        num_needed = max(0, -(-(num_computed + num_new_tokens) // self.block_size) - num_held)
        # Hit blocks sitting in the free list leave it when touched, so they count against it.
        num_revived = sum(1 for b in hit_blocks[num_skipped:] if b.ref_cnt == 0)
        if num_needed + num_revived > self.pool.num_free:
            return None
        if blocks is None:
            blocks = self._req_blocks[req.request_id] = []
            self._num_committed[req.request_id] = len(hit_blocks)
            self._num_windowed_out[req.request_id] = num_skipped
        if prefix_hit is not None:
            self.pool.touch(hit_blocks[num_skipped:])
            blocks.extend([self.pool.blocks[NULL_BLOCK_ID]] * num_skipped + hit_blocks[num_skipped:])
            self.prefix_queries += prefix_hit.num_queried_tokens
            self.prefix_hits += prefix_hit.num_tokens
        new_blocks = self.pool.allocate(num_needed)
        blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def _num_before_window(self, next_position: int) -> int:
        """How many leading blocks end before the window of the token at `next_position` (and of
        every later one): the keys that token reads start at next_position - W + 1."""
        if self.sliding_window is None:
            return 0
        return max(0, next_position - self.sliding_window + 1) // self.block_size

    def _release_out_of_window(self, req: Request, blocks: list[KVBlock], next_position: int) -> None:
        done = self._num_windowed_out[req.request_id]
        end = min(self._num_before_window(next_position), len(blocks))
        if end <= done:
            return
        null = self.pool.blocks[NULL_BLOCK_ID]
        released = [b for b in blocks[done:end] if b is not null]
        blocks[done:end] = [null] * (end - done)
        self._num_windowed_out[req.request_id] = end
        self.num_windowed_out_blocks += len(released)
        # Oldest first: they join the tail of the free list, still findable by their hashes.
        self.pool.free(released)

    def commit(self, req: Request) -> None:
        """Register the hashes of the request's blocks that are full up to `num_computed_tokens`
        and whose token ids are all known (a pending sampled token has no id yet)."""
        if not self.enable_prefix_caching:
            return
        start = self._num_committed.get(req.request_id)
        if start is None or min(req.num_computed_tokens, req.num_tokens) < (start + 1) * self.block_size:
            return
        blocks = self._req_blocks[req.request_id]
        num_full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(blocks))
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_full)
        for index in range(start, num_full):
            if blocks[index].block_id != NULL_BLOCK_ID:  # not one already returned (sliding window)
                self.pool.cache(blocks[index], hashes[index])
        self._num_committed[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Return the request's blocks to the pool (a no-op for a request holding none)."""
        blocks = self._req_blocks.pop(req.request_id, None)
        self._num_committed.pop(req.request_id, None)
        num_out = self._num_windowed_out.pop(req.request_id, 0)
        if blocks:
            # Tail blocks first: they are the least shared, so they should be evicted first.
            self.pool.free(reversed(blocks[num_out:]))

    def _block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        lora = req.lora_request
        root = None if req.block_hashes else request_root(None if lora is None else lora.lora_int_id,
                                                           req.sampling_params.cache_salt)
        images = [(item.offset, item.end, item.hash_bytes) for item in req.mm_inputs]
        return extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, num_blocks, root, images)
