"""Sliding windows in the KV manager and the scheduler: blocks wholly before a request's window go back
to the pool as it runs, prefix hits skip them, and the prefix cache and preemption stay correct.

The scheduler tests drive a windowed oracle: the "K/V" of a position is a hash of its token and of
the entries of the window before it, read through the request's block table, so a block handed to
another request while a window still covers it changes the tokens that follow.
"""
from __future__ import annotations

import random
from collections import defaultdict

import pytest
from corectl.config import EngineConfig
from corectl.errors import ConfigError
from corectl.kv import NULL_BLOCK_ID, KVCacheManager
from corectl.kv.sizing import blocks_per_sequence
from corectl.request import Request
from corectl.sampling_params import SamplingParams
from corectl.scheduler import Scheduler
from corectl.step_messages import ModelRunnerOutput
from support.scheduling import PagedOracle

BS = 4
VOCAB = 1000


def make_req(rid, tokens, max_tokens=64, **params):
    return Request(rid, list(tokens), SamplingParams(**params), max_tokens=max_tokens)


def decode(kv, req, steps):
    """Grow a computed request one token at a time, as decode steps do."""
    for _ in range(steps):
        req.append_output_token(5)
        assert kv.allocate(req, 1) is not None
        req.num_computed_tokens += 1
        kv.commit(req)


def held(kv, req):
    return [b for b in kv.block_ids(req) if b != NULL_BLOCK_ID]


def test_decode_returns_the_blocks_before_the_window():
    window = 6
    kv = KVCacheManager(num_blocks=30, block_size=BS, sliding_window=window)
    req = make_req("a", range(10))
    assert len(kv.allocate(req, 10)) == 3
    req.num_computed_tokens = 10
    for _ in range(30):
        decode(kv, req, 1)
        last = req.num_computed_tokens - 1
        # Blocks ending before the window of the token just computed (keys from last - window + 1)
        # are gone; the one holding that key stays.
        num_out = (last - window + 1) // BS
        assert kv.block_ids(req)[:num_out] == [NULL_BLOCK_ID] * num_out
        assert NULL_BLOCK_ID not in kv.block_ids(req)[num_out:]
        assert len(held(kv, req)) <= blocks_per_sequence(10**6, BS, window)
        assert kv.num_free_blocks == kv.num_usable_blocks - len(held(kv, req))
    assert kv.num_windowed_out_blocks == (39 - window + 1) // BS
    kv.free(req)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_without_a_window_nothing_leaves_early():
    kv = KVCacheManager(num_blocks=30, block_size=BS)
    req = make_req("a", range(10))
    kv.allocate(req, 10)
    req.num_computed_tokens = 10
    decode(kv, req, 30)
    assert NULL_BLOCK_ID not in kv.block_ids(req) and kv.num_windowed_out_blocks == 0


def test_prefix_hit_skips_cached_blocks_before_the_window():
    kv = KVCacheManager(num_blocks=30, block_size=BS, sliding_window=6)
    first = make_req("a", range(20))
    kv.allocate(first, 20)
    first.num_computed_tokens = 20
    kv.commit(first)
    kv.free(first)
    second = make_req("b", list(range(20)) + [90, 91, 92])
    hit = kv.lookup_prefix(second)
    assert hit.num_tokens == 20
    new = kv.allocate(second, 3, hit)
    # Its first token to compute is at 20: keys from 15 on, so blocks 0-2 (keys 0-11) are not taken.
    assert kv.block_ids(second) == [NULL_BLOCK_ID] * 3 + list(hit.block_ids[3:]) + new
    assert kv.num_free_blocks == kv.num_usable_blocks - 3
    kv.free(second)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_block_evicted_after_leaving_the_window_ends_every_later_hit():
    """Later blocks still in the cache are no hit once an earlier one is gone: the chain breaks."""
    kv = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=5)
    long = make_req("a", range(8))
    kv.allocate(long, 8)
    long.num_computed_tokens = 8
    kv.commit(long)
    decode(kv, long, 16)  # 24 tokens: blocks 0-3 are back in the pool, still findable
    assert kv.lookup_prefix(make_req("x", long.all_token_ids[:13])).num_tokens == 12
    # Another request takes every free block, evicting the oldest ones' hashes (block 0 first).
    filler = make_req("f", range(500, 500 + BS * kv.num_free_blocks))
    assert kv.allocate(filler, filler.num_tokens) is not None
    probe = make_req("p", long.all_token_ids + [1])
    assert kv.lookup_prefix(probe).num_tokens == 0  # blocks 4-5, held by `long`, are unreachable


class WindowedOracle(PagedOracle):
    """Each position's entry hashes its token with the entries of the window before it. It also
    checks that every block it reads is still the request's in the scheduler's books."""

    def __init__(self, window, sched):
        super().__init__()
        self.window = window
        self.sched = sched

    def compute(self, state, token_ids, n) -> int | None:
        owned = set(self.sched.kv.block_ids(self.sched.get_request(state.req_id))) - {NULL_BLOCK_ID}
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        for pos in range(start, end):
            seen = tuple(self.cache[self._owned_slot(state, p, owned)]
                         for p in range(max(0, pos - self.window + 1), pos))
            self.cache[self._owned_slot(state, pos, owned)] = hash((seen, token_ids[pos]))
        return self.cache[self._owned_slot(state, end - 1, owned)] % VOCAB if end == len(token_ids) else None

    @staticmethod
    def _owned_slot(state, pos, owned):
        block = state.block_ids[pos // 8]
        assert block in owned, f"position {pos} is in a window but its block {block} was returned"
        return block * 8 + pos % 8


def run(sched, requests, window):
    oracle, tokens = WindowedOracle(window, sched), defaultdict(list)
    for req in requests:
        sched.add_request(req)
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for result in sched.update(out, oracle.execute(out)):
            tokens[result.req_id] += result.new_token_ids
    assert not sched.has_unfinished_requests()
    return dict(tokens)


def requests(seed, count):
    """Prompts sharing prefixes (prefix hits) and outputs long enough to leave the window many times."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(24)]
    return [make_req(f"r{i}", shared[: rng.choice([0, 9, 24])] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))],
                     max_tokens=rng.randint(10, 40))
            for i in range(count)]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_windowed_runs_under_pressure_match_roomy_full_runs(prefix_caching):
    window = 11
    config = EngineConfig(block_size=8, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    expected = run(Scheduler(config, 64, 400, sliding_window=None), requests(3, 12), window)
    tight = Scheduler(config, 64, 10, sliding_window=window)
    assert run(tight, requests(3, 12), window) == expected
    assert tight.kv.num_windowed_out_blocks > 0 and tight.num_preemptions > 0
    assert tight.kv.num_free_blocks == tight.kv.num_usable_blocks


def test_windowed_pool_holds_more_requests_than_full_attention():
    """The same cache runs more windowed requests at once: their old blocks come back."""
    config = EngineConfig(block_size=8, max_num_batched_tokens=64)
    peak = {}
    for window in (None, 8):
        sched = Scheduler(config, 64, 17, sliding_window=window)
        for i in range(8):
            sched.add_request(make_req(f"r{i}", range(100 * i, 100 * i + 10), max_tokens=40))
        most = 0
        while sched.has_unfinished_requests():
            out = sched.schedule()
            most = max(most, len(out.num_scheduled_tokens))
            sched.update(out, _sample_all(sched, out))
        peak[window] = (most, sched.num_preemptions)
    assert peak[8][0] == 8 and peak[8][1] == 0
    assert peak[None][0] < 8 or peak[None][1] > 0


def _sample_all(sched, out):
    ids = [rid for rid in out.num_scheduled_tokens
           if sched.get_request(rid).num_computed_tokens == sched.get_request(rid).num_tokens]
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[7] * len(ids))


def test_startup_check_counts_only_the_window():
    config = EngineConfig(block_size=8, max_num_batched_tokens=16)
    Scheduler(config, 4096, 6, sliding_window=16)
    with pytest.raises(ConfigError, match="do not fit the KV cache"):
        Scheduler(config, 4096, 6, sliding_window=None)
