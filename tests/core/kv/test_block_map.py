"""The pool's per-block state bytes and their bounded summary (the dashboard's KV block map)."""
import random

import pytest
from corectl.kv.block_map import summarize_block_states
from corectl.kv.block_pool import CACHED, FREE, USED
from support.scheduling import PagedOracle, make_req, make_scheduler


def recomputed_states(pool) -> bytearray:
    """Each block's state from its reference count and hash, the slow way."""
    return bytearray(USED if b.ref_cnt else CACHED if b.block_hash is not None else FREE for b in pool.blocks)


def test_states_follow_every_block_change_under_a_random_workload():
    """Prefix hits revive cached blocks, allocation evicts them, preemption and aborts free blocks:
    after every step the state bytes equal the states recomputed from the blocks."""
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=14, max_model_len=48)
    oracle = PagedOracle()
    shared = [rng.randrange(1000) for _ in range(16)]
    seen = set()
    for i in range(40):
        prompt = shared[: rng.choice([0, 8, 16])] + [rng.randrange(1000) for _ in range(rng.randint(1, 12))]
        sched.add_request(make_req(f"r{i}", prompt, max_tokens=rng.randint(2, 24)))
        if i % 7 == 3:
            sched.abort_requests([f"r{i - 1}"])
        out = sched.schedule()
        sched.update(out, oracle.execute(out))
        pool = sched.kv.pool
        assert pool.states == recomputed_states(pool)
        seen.update(pool.states[1:])
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update(out, oracle.execute(out))
    assert sched.kv.pool.states == recomputed_states(sched.kv.pool)
    assert seen == {FREE, USED, CACHED} and sched.num_preemptions > 0 and sched.kv.prefix_hits > 0
    summary = sched.kv.block_map()
    assert (summary.num_used, summary.num_blocks) == (0, 13)
    assert summary.num_cached == sum(b.block_hash is not None for b in sched.kv.pool.blocks[1:]) > 0


@pytest.mark.parametrize("num_blocks, max_cells, per_cell, num_cells", [
    (9, 1024, 1, 8),         # small pools: one cell per block, exact
    (5001, 1024, 5, 1000),   # large pools: equal runs of blocks, the last one shorter
    (4097, 1024, 4, 1024),
])
def test_summary_counts_each_cell_and_leaves_out_the_null_block(num_blocks, max_cells, per_cell, num_cells):
    rng = random.Random(num_blocks)
    states = bytearray(rng.choice((FREE, USED, CACHED)) for _ in range(num_blocks))
    states[0] = USED
    summary = summarize_block_states(states, max_cells)
    usable = states[1:]
    assert (summary.blocks_per_cell, len(summary.cell_used), len(summary.cell_cached)) == (per_cell, num_cells,
                                                                                          num_cells)
    for i in range(num_cells):
        cell = usable[i * per_cell:(i + 1) * per_cell]
        assert (summary.cell_used[i], summary.cell_cached[i]) == (cell.count(USED), cell.count(CACHED))
    assert summary.num_blocks == num_blocks - 1
    assert (summary.num_used, summary.num_cached, summary.num_free) == (
        usable.count(USED), usable.count(CACHED), usable.count(FREE))
