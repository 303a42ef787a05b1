"""The worker's encoder outputs by image content hash, so an image seen again is not encoded again.

The scheduler decides what it holds (`cache_manager.py`, within its rows): every image the worker
encodes is stored, and an entry leaves only when a step's `SchedulerOutput.encoder_evicted` names
it. The cache never evicts on its own, so it holds exactly what the scheduler counts on.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


class EncoderCache:
    def __init__(self):
        self._entries: dict[str, torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        out = self._entries.get(key)
        if out is None:
            self.misses += 1
        else:
            self.hits += 1
        return out

    def put(self, key: str, rows: torch.Tensor) -> None:
        self._entries[key] = rows

    def drop(self, keys: Iterable[str]) -> None:
        """The entries the scheduler evicted."""
        for key in keys:
            self._entries.pop(key, None)
