"""Which data-parallel engine core serves a request: prefix affinity, else the least loaded.

An engine's load is its requests, running + waiting as its latest stats say, plus the requests sent
to it that those stats do not count yet (so a burst spreads before any engine reports), plus its
KV-cache usage (0..1, so among engines with as many requests the emptier cache wins). Among equally
loaded engines the one chosen least recently wins, so sequential traffic alternates.

Prefix affinity: the router remembers, for recent prompts, the chained hashes of their first
`max_prefix_blocks` full KV blocks (the prefix cache's own keys, `corectl.kv.block_hash`) and the
engine each went to, in a bounded LRU map. A prompt whose longest remembered prefix covers
`matched` tokens goes back to that engine while its load exceeds the least loaded one's by at most
`matched / tokens_per_request_slack` requests: a long shared document is worth waiting behind a few
requests for, a chat template's first block only breaks ties. The map records the latest engine
for each prefix, so when load pushes a hot prefix to another engine, later requests follow it
there too and both caches end up holding it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..kv.block_hash import extend_block_hashes
from .messages import SchedulerStats


@dataclass
class EngineLoad:
    """What the router knows of one engine: its latest stats, the core requests sent to it, and
    how many of those it had taken in when it made `stats`."""

    stats: SchedulerStats = field(default_factory=SchedulerStats)
    num_sent: int = 0
    num_received: int = 0
    last_chosen: int = -1

    @property
    def load(self) -> float:
        stats = self.stats
        return stats.num_running + stats.num_waiting + self.num_sent - self.num_received + stats.kv_cache_usage


@dataclass(frozen=True)
class Route:
    """The engine chosen for a prompt, and the prompt's prefix hashes to remember once it is sent."""

    engine: int
    prefix_hashes: list[int]
    matched_blocks: int


class Router:
    def __init__(self, num_engines: int, block_size: int, *, max_prefix_blocks: int = 64,
                 tokens_per_request_slack: int = 128, capacity: int = 1 << 15):
        self.loads = [EngineLoad() for _ in range(num_engines)]
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.tokens_per_request_slack = tokens_per_request_slack
        self.capacity = capacity
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # block hash -> engine, oldest first
        self._num_choices = 0

    def choose(self, prompt_token_ids: Sequence[int]) -> Route:
        num_blocks = min(len(prompt_token_ids) // self.block_size, self.max_prefix_blocks)
        hashes = extend_block_hashes([], prompt_token_ids, self.block_size, num_blocks)
        least = min(range(len(self.loads)), key=lambda i: (self.loads[i].load, self.loads[i].last_chosen))
        engine, matched = least, 0
        for depth in range(len(hashes), 0, -1):
            holder = self._prefixes.get(hashes[depth - 1])
            if holder is not None:
                slack = depth * self.block_size / self.tokens_per_request_slack
                if self.loads[holder].load - self.loads[least].load <= slack:
                    engine, matched = holder, depth
                break
        self._num_choices += 1
        self.loads[engine].last_chosen = self._num_choices
        return Route(engine, hashes, matched)

    def sent(self, route: Route, num_requests: int) -> None:
        """`num_requests` core requests are on their way to `route.engine` (before the send, so
        concurrent choices see them); `unsent` takes them back when the send fails."""
        self.loads[route.engine].num_sent += num_requests

    def unsent(self, route: Route, num_requests: int) -> None:
        self.loads[route.engine].num_sent -= num_requests

    def remember(self, route: Route) -> None:
        """The engine now holds (or is computing) the KV blocks of the prompt's prefix."""
        prefixes = self._prefixes
        for block_hash in route.prefix_hashes:
            prefixes[block_hash] = route.engine
            prefixes.move_to_end(block_hash)
        while len(prefixes) > self.capacity:
            prefixes.popitem(last=False)

    def observe(self, engine: int, stats: SchedulerStats, num_received: int) -> None:
        """An engine's step report: its stats, and the core requests it had taken in by then."""
        load = self.loads[engine]
        load.stats, load.num_received = stats, num_received
