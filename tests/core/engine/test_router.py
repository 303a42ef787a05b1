"""The data-parallel router's choice, from hand-built engine stats (`corectl.engine.router`)."""
from __future__ import annotations

from corectl.engine.messages import SchedulerStats
from corectl.engine.router import Router

BLOCK = 16


def prompt(first: int, num_tokens: int) -> list[int]:
    return list(range(first, first + num_tokens))


def send(router: Router, tokens: list[int], num_requests: int = 1) -> int:
    route = router.choose(tokens)
    router.sent(route, num_requests)
    router.remember(route)
    return route.engine


def test_least_loaded_counts_running_waiting_and_unreported_requests():
    router = Router(3, BLOCK)
    router.observe(0, SchedulerStats(num_running=4, num_waiting=2), num_received=0)
    router.observe(1, SchedulerStats(num_running=3), num_received=0)
    router.observe(2, SchedulerStats(num_running=1, num_waiting=1), num_received=0)
    assert send(router, prompt(1000, 5)) == 2
    # Engine 2 has not reported that request yet: it counts, so 2 and 1 tie at three...
    assert send(router, prompt(2000, 5)) == 1
    # ...and now engine 2 (2 running/waiting + 1 sent) is the lightest again.
    assert send(router, prompt(3000, 5)) == 2
    # Its report takes the requests in: counted once, as running, not also as sent.
    router.observe(2, SchedulerStats(num_running=4), num_received=2)
    router.observe(1, SchedulerStats(num_running=4), num_received=1)
    assert [load.load for load in router.loads] == [6, 4, 4]


def test_kv_usage_breaks_a_tie_in_requests_and_recency_breaks_a_full_tie():
    router = Router(2, BLOCK)
    router.observe(0, SchedulerStats(num_running=2, kv_cache_usage=0.9), num_received=0)
    router.observe(1, SchedulerStats(num_running=2, kv_cache_usage=0.1), num_received=0)
    assert router.choose(prompt(0, 3)).engine == 1
    idle = Router(2, BLOCK)
    assert [idle.choose(prompt(100 * i, 3)).engine for i in range(4)] == [0, 1, 0, 1]


def test_a_shared_prefix_goes_back_to_the_engine_that_holds_it():
    router = Router(2, BLOCK)
    document = prompt(0, 20 * BLOCK)
    first = send(router, document + [7, 8, 9])
    router.observe(first, SchedulerStats(num_running=1), num_received=1)
    # The other engine is idle, but 320 shared tokens are worth 2.5 requests of imbalance.
    assert router.choose(document + [4, 5]).engine == first
    assert router.choose(document + [4, 5]).matched_blocks == 20
    # A prompt sharing nothing goes to the idle engine.
    assert router.choose(prompt(50_000, 40)).engine == 1 - first


def test_affinity_yields_when_the_holder_is_much_more_loaded():
    router = Router(2, BLOCK)
    document = prompt(0, 20 * BLOCK)  # 320 tokens: at most 2.5 requests of imbalance
    holder = send(router, document)
    router.observe(holder, SchedulerStats(num_running=2), num_received=1)
    assert router.choose(document).engine == holder
    router.observe(holder, SchedulerStats(num_running=4), num_received=1)
    spilled = send(router, document)
    assert spilled == 1 - holder
    # The map follows the latest engine: the hot prefix now lives on both, requests follow it.
    assert router.choose(document).engine == spilled


def test_a_short_common_prefix_only_breaks_ties():
    router = Router(2, BLOCK)
    template = prompt(0, 2 * BLOCK)  # a chat template's first 32 tokens: 0.25 requests of slack
    holder = send(router, template + prompt(500, 5))
    router.observe(holder, SchedulerStats(num_running=1), num_received=1)
    assert router.choose(template + prompt(900, 5)).engine == 1 - holder


def test_the_longest_remembered_prefix_wins():
    router = Router(2, BLOCK)
    shared = prompt(0, 4 * BLOCK)
    a = send(router, shared + prompt(10_000, 8 * BLOCK))
    b = send(router, shared + prompt(20_000, 8 * BLOCK))
    assert a != b
    for engine in (0, 1):
        router.observe(engine, SchedulerStats(num_running=1), num_received=1)
    # Both remember the 4 shared blocks (b last); the 12-block match picks a.
    assert router.choose(shared + prompt(10_000, 8 * BLOCK) + [1]).engine == a
    assert router.choose(shared + prompt(30_000, 8 * BLOCK)).engine == b


def test_the_prefix_map_is_bounded_and_forgets_the_oldest():
    router = Router(2, BLOCK, capacity=8)
    old = prompt(0, 4 * BLOCK)
    holder = send(router, old)
    for i in range(2):
        send(router, prompt(100_000 * (i + 1), 4 * BLOCK))
    assert len(router._prefixes) == 8
    router.observe(holder, SchedulerStats(num_running=1), num_received=1)
    router.observe(1 - holder, SchedulerStats(), num_received=0)
    route = router.choose(old)
    assert route.matched_blocks == 0 and route.engine == 1 - holder


def test_a_failed_send_is_not_counted():
    router = Router(2, BLOCK)
    route = router.choose(prompt(0, 3))
    router.sent(route, 4)
    router.unsent(route, 4)
    assert [load.load for load in router.loads] == [0, 0]
