"""What the worker's encoder cache holds, decided by the scheduler (vLLM's `EncoderCacheManager`).

The scheduler keeps, per image hash, the image's encoder rows and the requests that still need
them (their prefill entered the image and has not left it). Capacity is counted in rows. An entry
no request references stays cached (an image seen again is not encoded again) until room is
needed for a new image: then unreferenced entries leave, least recently used first, and their
hashes travel to the worker in the next `SchedulerOutput` (`encoder_evicted`). The worker stores
every image it encodes and drops exactly those hashes, never evicting on its own, so the two
never disagree about which images are cached.
"""
from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    """Owned by the scheduler; `corectl.multimodal.budget.EncoderBudget` changes it once a step."""

    def __init__(self, capacity_rows: int):
        self.capacity_rows = capacity_rows
        self._rows: dict[str, int] = {}
        self._users: dict[str, set[str]] = {}
        # Cached entries no request references, least recently used first: the ones room comes from.
        self._idle: OrderedDict[str, None] = OrderedDict()
        self.rows = 0
        self.referenced_rows = 0
        self._evicted: list[str] = []

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def is_idle(self, key: str) -> bool:
        return key in self._idle

    def add(self, key: str, rows: int) -> None:
        """Record an image the worker encodes this step, evicting idle entries until it fits (an
        image larger than the room they give is kept anyway: the budget lets it run alone)."""
        while self._idle and self.rows + rows > self.capacity_rows:
            evicted, _ = self._idle.popitem(last=False)
            self.rows -= self._rows.pop(evicted)
            self._evicted.append(evicted)
        self._rows[key] = rows
        self.rows += rows
        self._idle[key] = None

    def reference(self, key: str, req_id: str) -> None:
        if self._idle.pop(key, False) is not False:
            self.referenced_rows += self._rows[key]
        self._users.setdefault(key, set()).add(req_id)

    def release(self, key: str, req_id: str) -> None:
        """The request no longer needs the image; unreferenced, it is the most recently used idle entry."""
        users = self._users[key]
        users.discard(req_id)
        if not users:
            del self._users[key]
            self._idle[key] = None
            self.referenced_rows -= self._rows[key]

    def free(self, req_id: str) -> None:
        """A request finished, was aborted or preempted: it references nothing any more."""
        for key in [k for k, users in self._users.items() if req_id in users]:
            self.release(key, req_id)

    def take_evicted(self) -> list[str]:
        """The hashes evicted since the last call, for the worker to drop."""
        evicted, self._evicted = self._evicted, []
        return evicted
