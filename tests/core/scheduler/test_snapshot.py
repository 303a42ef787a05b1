"""The engine's live snapshot: per-step batch sizes, running ids and the block map, rate-limited."""
from corectl.scheduler.snapshot import STEP_HISTORY, SnapshotPublisher
from support.scheduling import PagedOracle, make_req, make_scheduler


def step(sched, oracle, publisher):
    out = sched.schedule()
    if not out.is_empty:
        publisher.record(out)
    sched.update(out, oracle.execute(out))
    return out


def test_snapshots_are_rate_limited_and_one_follows_the_last_request():
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=2)
    publisher, oracle = SnapshotPublisher(sched, interval_s=1.0), PagedOracle()
    for i in range(3):
        sched.add_request(make_req(f"r{i}", range(10 * i, 10 * i + 12), max_tokens=3))
    out = step(sched, oracle, publisher)
    first = publisher.poll(100.0)
    assert first is not None
    assert (first.num_steps, first.step_num_seqs, first.step_num_tokens) == (1, [2], [out.total_num_scheduled_tokens])
    assert (first.token_budget, first.max_num_seqs) == (16, 2)
    assert first.running_ids == ["r0", "r1"]
    assert first.blocks.num_used == sum(len(sched.kv.block_ids(r)) for r in sched.running) > 0
    step(sched, oracle, publisher)
    assert publisher.poll(100.5) is None  # work left and the interval not over
    second = publisher.poll(101.0)
    assert second is not None and second.num_steps == 2 and len(second.step_num_seqs) == 2
    while sched.has_unfinished_requests():
        step(sched, oracle, publisher)
    last = publisher.poll(101.1)  # the scheduler ran out of work: published at once
    assert last is not None and last.running_ids == []
    assert last.blocks.num_used == 0 and last.blocks.num_cached > 0


def test_step_history_is_bounded():
    sched = make_scheduler(num_blocks=64, max_model_len=128)
    publisher, oracle = SnapshotPublisher(sched), PagedOracle()
    sched.add_request(make_req("long", [1, 2, 3], max_tokens=STEP_HISTORY + 10))
    steps = 0
    while sched.has_unfinished_requests():
        step(sched, oracle, publisher)
        steps += 1
    snapshot = publisher.poll(0.0)
    assert snapshot.num_steps == steps > STEP_HISTORY
    assert snapshot.step_num_seqs == [1] * STEP_HISTORY and snapshot.step_num_tokens == [1] * STEP_HISTORY
