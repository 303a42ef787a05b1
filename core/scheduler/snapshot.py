"""The engine's live snapshot for operators (the server's dashboard), kept cheap for the step loop.

Each step costs two appends (its batch size and scheduled tokens). A snapshot, which reads the
running list and summarizes the KV block states (bounded, vectorised: `corectl.kv.block_map`), is
built at most once per `interval_s`, and once more when the scheduler runs out of work, so the last
view before the engine goes idle shows the cache as the finished requests left it.
"""
from __future__ import annotations

from collections import deque

from ..engine.messages import EngineSnapshot
from ..step_messages import SchedulerOutput
from .scheduler import Scheduler

SNAPSHOT_INTERVAL_S = 0.25
STEP_HISTORY = 64


class SnapshotPublisher:
    def __init__(self, scheduler: Scheduler, interval_s: float = SNAPSHOT_INTERVAL_S):
        self.scheduler = scheduler
        self.interval_s = interval_s
        self.num_steps = 0
        self._num_seqs: deque[int] = deque(maxlen=STEP_HISTORY)
        self._num_tokens: deque[int] = deque(maxlen=STEP_HISTORY)
        self._next_time = float("-inf")

    def record(self, sched: SchedulerOutput) -> None:
        """Count a step that scheduled tokens."""
        self.num_steps += 1
        self._num_seqs.append(len(sched.num_scheduled_tokens))
        self._num_tokens.append(sched.total_num_scheduled_tokens)

    def poll(self, now: float) -> EngineSnapshot | None:
        """A snapshot when one is due at `now` (monotonic seconds), else None."""
        scheduler = self.scheduler
        if now < self._next_time and scheduler.has_unfinished_requests():
            return None
        self._next_time = now + self.interval_s
        config = scheduler.config
        return EngineSnapshot(
            timestamp=now, num_steps=self.num_steps, step_num_seqs=list(self._num_seqs),
            step_num_tokens=list(self._num_tokens), token_budget=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, running_ids=[req.request_id for req in scheduler.running],
            blocks=scheduler.kv.block_map(),
        )
