"""The worker's encoder outputs by image content hash, so an image seen again is not encoded again.

Capacity is counted in rows (placeholder tokens), the unit the scheduler budgets encoder work in.
An entry a running request still needs (its prefill stopped inside the image: chunked prefill) is
pinned to that request and never evicted until the request moves past it or is forgotten; other
entries leave least recently used first.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_rows: int):
        self.capacity_rows = capacity_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._pins: dict[str, set[str]] = {}
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def rows(self) -> int:
        return sum(t.shape[0] for t in self._entries.values())

    def get(self, key: str) -> torch.Tensor | None:
        out = self._entries.get(key)
        if out is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return out

    def put(self, key: str, rows: torch.Tensor) -> None:
        self._entries[key] = rows
        self._entries.move_to_end(key)
        self._evict()

    def pin(self, key: str, req_id: str) -> None:
        self._pins.setdefault(key, set()).add(req_id)

    def unpin(self, key: str, req_id: str) -> None:
        users = self._pins.get(key)
        if users is not None:
            users.discard(req_id)
            if not users:
                del self._pins[key]
        self._evict()

    def forget(self, req_id: str) -> None:
        """A request finished, was aborted or preempted: it pins nothing any more."""
        for key in [k for k, users in self._pins.items() if req_id in users]:
            self.unpin(key, req_id)

    def _evict(self) -> None:
        excess = self.rows - self.capacity_rows
        for key in list(self._entries):
            if excess <= 0:
                return
            if key not in self._pins:
                excess -= self._entries.pop(key).shape[0]
