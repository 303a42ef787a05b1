"""Where a KV transfer's time goes: each save and load stamps its phases, a DEBUG line per transfer
says them, and an INFO line every `SUMMARY_EVERY` transfers gives each phase's median and p90 over
those transfers, with the bytes moved per second of the phase that moves them, so a serving run's
log shows which step of the path holds requests up (`benchmarks/device_bench.sh` `w12` reads it).
"""
from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("corectl.kv_transfer")
SUMMARY_EVERY = 64


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class TransferStamps:
    """One transfer's phase times (monotonic seconds), the first taken when it is made."""

    def __init__(self, transfer_id: str):
        self.transfer_id = transfer_id
        self.times = [time.monotonic()]
        self.num_bytes = 0

    def stamp(self) -> None:
        self.times.append(time.monotonic())

    def spans(self) -> list[float]:
        """Seconds between consecutive stamps: one per phase."""
        return [b - a for a, b in zip(self.times, self.times[1:])]


class PhaseTimes:
    """The finished transfers of one direction: `phases` names the intervals between their stamps;
    `moving` is the one whose bytes per second the summary gives. Called from several threads."""

    def __init__(self, direction: str, phases: tuple[str, ...], moving: str):
        self.direction = direction
        self.phases = phases
        self.moving = phases.index(moving)
        self._lock = threading.Lock()
        self._window: list[TransferStamps] = []

    def finish(self, stamps: TransferStamps) -> None:
        stamps.stamp()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("KV %s %s: %s, %d bytes", self.direction, stamps.transfer_id,
                         ", ".join(f"{name} {span * 1e3:.1f} ms" for name, span in zip(self.phases, stamps.spans())),
                         stamps.num_bytes)
        with self._lock:
            self._window.append(stamps)
            if len(self._window) < SUMMARY_EVERY:
                return
            window, self._window = self._window, []
        self._summarize(window)

    def _summarize(self, window: list[TransferStamps]) -> None:
        spans = [s.spans() for s in window]
        parts = []
        for i, name in enumerate(self.phases):
            column = [row[i] for row in spans if len(row) > i]
            parts.append(f"{name} {_quantile(column, 0.5) * 1e3:.1f}/{_quantile(column, 0.9) * 1e3:.1f}")
        moving = sum(row[self.moving] for row in spans if len(row) > self.moving)
        rate = sum(s.num_bytes for s in window) / moving / 1e9 if moving else 0.0
        wall = max(s.times[-1] for s in window) - min(s.times[0] for s in window)
        logger.info("KV %s timing over %d transfers (ms median/p90): %s; %s at %.2f GB/s; %.2f transfers/s",
                    self.direction, len(window), ", ".join(parts), self.phases[self.moving], rate,
                    len(window) / wall if wall else 0.0)
