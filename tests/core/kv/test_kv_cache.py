"""KV cache manager: block pool, LRU free list, chained hashes, prefix hits, reference counts."""
import hashlib

import pytest
from corectl.kv import NULL_BLOCK_ID, KVCacheManager, PrefixHit
from corectl.kv.block_hash import extend_block_hashes, hash_block
from corectl.request import Request
from corectl.sampling_params import SamplingParams

BS = 4


def make_req(rid, tokens, **params):
    return Request(rid, tokens, SamplingParams(**params), max_tokens=8)


def admit(kv, req):
    """Look up, allocate the whole request and mark it computed and committed, as a scheduler would."""
    hit = kv.lookup_prefix(req)
    new_ids = kv.allocate(req, req.num_tokens - hit.num_tokens, hit)
    assert new_ids is not None
    req.num_computed_tokens = req.num_tokens
    kv.commit(req)
    return hit, new_ids


def test_block_hash_chains_parent_and_is_stable():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 23]) != hash_block(None, [12, 3])
    # Known value: hashes must agree between processes (blake2b, not the seeded builtin hash()).
    expected = hashlib.blake2b(bytes(16) + bytes(8), digest_size=16).digest()
    assert hash_block(None, [0]) == int.from_bytes(expected, "little")


def test_extend_block_hashes_covers_only_full_blocks():
    hashes = extend_block_hashes([], list(range(10)), BS, 2)
    assert len(hashes) == 2
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    assert extend_block_hashes(hashes, list(range(10)), BS, 2) == hashes


def test_allocate_never_hands_out_the_null_block_and_tracks_usage():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    assert kv.num_usable_blocks == 4 and kv.num_free_blocks == 4 and kv.usage == 0.0
    req = make_req("a", list(range(9)))
    ids = kv.allocate(req, 9)
    assert len(ids) == 3 and NULL_BLOCK_ID not in ids
    assert kv.block_ids(req) == ids
    assert kv.num_free_blocks == 1 and kv.usage == pytest.approx(0.75)
    req.num_computed_tokens = 9
    assert kv.allocate(req, 3) == []  # the third block still has room for 3 tokens
    assert len(kv.allocate(req, 4)) == 1


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a, b = make_req("a", list(range(8))), make_req("b", list(range(100, 108)))
    assert kv.allocate(a, 8) is not None
    assert kv.allocate(b, 8) is None
    assert kv.block_ids(b) == [] and kv.num_free_blocks == 1
    kv.free(b)
    kv.free(a)
    assert kv.num_free_blocks == 3


def test_too_small_pool_is_refused():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager(num_blocks=1, block_size=BS)


def test_freed_blocks_join_the_tail_newest_request_block_evicted_first():
    kv = KVCacheManager(num_blocks=7, block_size=BS, enable_prefix_caching=False)
    a, b = make_req("a", list(range(8))), make_req("b", list(range(8)))
    a_ids, b_ids = kv.allocate(a, 8), kv.allocate(b, 8)
    kv.free(a)
    kv.free(b)
    # Two untouched blocks first, then a's blocks tail first, then b's.
    c = make_req("c", list(range(24)))
    order = kv.allocate(c, 24)
    assert order[2:] == a_ids[::-1] + b_ids[::-1]
    kv.free(c)
    assert kv.num_free_blocks == 6


def test_prefix_hit_counts_full_blocks_in_tokens_after_commit():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    first = make_req("a", list(range(10)))
    hit, _ = admit(kv, first)
    assert hit.num_tokens == 0 and hit.num_queried_tokens == 10
    second = make_req("b", list(range(9)) + [99, 98])
    hit = kv.lookup_prefix(second)
    assert hit.num_tokens == 8 and hit.block_ids == tuple(kv.block_ids(first)[:2])
    new_ids = kv.allocate(second, second.num_tokens - hit.num_tokens, hit)
    assert kv.block_ids(second) == kv.block_ids(first)[:2] + new_ids
    assert (kv.prefix_queries, kv.prefix_hits) == (10 + 11, 8)


def test_uncommitted_blocks_are_not_hit():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    first = make_req("a", list(range(12)))
    kv.allocate(first, 12, kv.lookup_prefix(first))
    first.num_computed_tokens = 5
    kv.commit(first)
    assert kv.lookup_prefix(make_req("b", list(range(12)))).num_tokens == BS


def test_whole_prompt_is_never_a_hit():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_req("a", list(range(8))))
    # Two full blocks cached, but the last token must be computed: only the first block hits.
    assert kv.lookup_prefix(make_req("b", list(range(8)))).num_tokens == 4
    assert kv.lookup_prefix(make_req("c", list(range(9)))).num_tokens == 8


def test_prompt_logprobs_and_disabled_cache_skip_lookup():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_req("a", list(range(12))))
    assert kv.lookup_prefix(make_req("b", list(range(12)), prompt_logprobs=1)) == PrefixHit()
    off = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    admit(off, make_req("a", list(range(12))))
    assert off.lookup_prefix(make_req("b", list(range(12)))) == PrefixHit()
    assert (off.prefix_queries, off.prefix_hits) == (0, 0)


def test_freed_cached_blocks_stay_findable_until_reused_in_lru_order():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a, b = make_req("a", [1, 2, 3, 4, 5]), make_req("b", [7, 7, 7, 7, 8])
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 4
    assert kv.lookup_prefix(make_req("a2", [1, 2, 3, 4, 0])).num_tokens == 4
    # Free list now: [a's tail, a's full block, b's tail, b's full block]:
    # two new blocks evict a's cached block but leave b's findable.
    filler = make_req("f", list(range(100, 108)))
    kv.allocate(filler, 8)
    assert kv.lookup_prefix(make_req("a3", [1, 2, 3, 4, 0])).num_tokens == 0
    assert kv.lookup_prefix(make_req("b2", [7, 7, 7, 7, 0])).num_tokens == 4


def test_hit_on_free_cached_block_revives_it_and_counts_against_capacity():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_req("a", list(range(5)))
    admit(kv, a)
    kv.free(a)
    b = make_req("b", list(range(4)) + [50] * 8)
    hit = kv.lookup_prefix(b)
    assert hit.num_tokens == 4
    # 12 tokens need 3 blocks: 1 revived from the free list + 2 new = all 3 free blocks.
    assert kv.allocate(b, 8, hit) is not None
    assert kv.num_free_blocks == 0
    c = make_req("c", list(range(4)) + [60] * 9)
    assert kv.allocate(c, 9, kv.lookup_prefix(c)) is None
    kv.free(b)
    assert kv.num_free_blocks == 3


def test_shared_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req("a", list(range(9)))
    admit(kv, a)
    b = make_req("b", list(range(9)))
    hit, _ = admit(kv, b)
    assert hit.num_tokens == 8
    assert kv.num_free_blocks == 7 - 4
    kv.free(a)
    assert kv.num_free_blocks == 7 - 3  # a's own tail block only
    kv.free(b)
    assert kv.num_free_blocks == 7


def test_same_content_computed_twice_keeps_one_cached_copy():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a, b = make_req("a", list(range(9))), make_req("b", list(range(9)))
    # Both miss (neither committed yet), as when two requests prefill in the same step.
    for req in (a, b):
        kv.allocate(req, 9, kv.lookup_prefix(req))
    for req in (a, b):
        req.num_computed_tokens = 9
        kv.commit(req)
    assert kv.lookup_prefix(make_req("c", list(range(9)))).block_ids == tuple(kv.block_ids(a)[:2])
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 7


def test_resumed_request_hits_its_own_output_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_req("a", list(range(6)))
    admit(kv, req)
    for token in (40, 41, 42):
        req.append_output_token(token)
        kv.allocate(req, 1)
        req.num_computed_tokens += 1
        kv.commit(req)
    kv.free(req)  # preempted
    req.num_computed_tokens = 0
    hit = kv.lookup_prefix(req)
    assert hit.num_tokens == 8 and hit.num_queried_tokens == 9
