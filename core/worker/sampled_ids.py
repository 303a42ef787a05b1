"""The ids recent steps sampled, still on the device, for later steps that continue their requests
before the host has read them (async scheduling, pipeline stages).

Without pipeline stages a request continues in the step launched right after its own, so only the
newest sampling step is ever asked for. With P stages the micro-batches take turns: a request goes
on in a step launched P or more steps after its own, while the steps between hold other requests.
The last stage records what it sampled; the first, which samples nothing, records the ids the last
sends it back (`corectl.distributed.receive_from_last_stage`), readable once their transfer is
waited for. Each request's newest ids are the ones its next input takes.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class _SampledStep:
    ids: torch.Tensor
    row_of: dict[str, int]
    # Waits for `ids` to have arrived (the first stage's copy from the last); None once they have.
    arrival: Callable[[], None] | None = None

    def ready(self) -> torch.Tensor:
        if self.arrival is not None:
            self.arrival()
            self.arrival = None
        return self.ids


class RecentSampledIds:
    """The last `depth` sampling steps' ids ([rows] int64 on the device) and each one's rows."""

    def __init__(self, depth: int = 1):
        self._depth = depth
        self._steps: deque[_SampledStep] = deque()

    def record(self, ids: torch.Tensor, req_ids: list[str], arrival: Callable[[], None] | None = None) -> None:
        """A step sampled `ids[i]` for `req_ids[i]`; `arrival` (if any) waits until they are there.
        The oldest step past the depth is dropped once its ids have arrived: every receive posted
        completes, in order, even for ids no step took."""
        if len(self._steps) == self._depth:
            self._steps.popleft().ready()
        self._steps.append(_SampledStep(ids, {r: i for i, r in enumerate(req_ids)}, arrival))

    def gather(self, req_ids: list[str], to_device: Callable[[list[np.ndarray]], list[torch.Tensor]]) -> torch.Tensor:
        """Each request's newest sampled id, in `req_ids` order, on the device."""
        newest = self._steps[-1]
        rows = [newest.row_of.get(r) for r in req_ids]
        if None not in rows:
            return _select(newest.ready(), rows, to_device)
        steps = [self._newest_holding(r) for r in req_ids]
        involved = sorted(set(steps))
        if len(involved) == 1:
            step = self._steps[involved[0]]
            return _select(step.ready(), [step.row_of[r] for r in req_ids], to_device)
        offsets, total = {}, 0
        for index in involved:
            offsets[index] = total
            total += self._steps[index].ids.shape[0]
        joined = torch.cat([self._steps[index].ready() for index in involved])
        return _select(joined, [offsets[s] + self._steps[s].row_of[r] for s, r in zip(steps, req_ids)], to_device)

    def _newest_holding(self, req_id: str) -> int:
        for index in range(len(self._steps) - 1, -1, -1):
            if req_id in self._steps[index].row_of:
                return index
        raise KeyError(f"request {req_id!r} has no sampled id on the device")


def _select(ids: torch.Tensor, rows: list[int], to_device) -> torch.Tensor:
    if rows == list(range(len(rows))):
        return ids[:len(rows)]  # steady decode: the same requests in the same order
    (index,) = to_device([np.array(rows, dtype=np.int64)])
    return ids.index_select(0, index)
