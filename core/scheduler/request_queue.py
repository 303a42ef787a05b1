"""Waiting queues: first-come-first-served, or by priority (lower value first, then arrival)."""
from __future__ import annotations

import abc
import heapq
import itertools
from collections import deque
from collections.abc import Iterable

from ..request import Request


class RequestQueue(abc.ABC):
    """The order in which waiting requests are offered to the scheduler."""

    @abc.abstractmethod
    def add(self, req: Request) -> None:
        """Queue a new request."""

    @abc.abstractmethod
    def peek(self) -> Request:
        """The request that would be popped next."""

    @abc.abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request."""

    @abc.abstractmethod
    def prepend(self, reqs: Iterable[Request]) -> None:
        """Put requests back ahead of the others (preempted or skipped ones), keeping their order."""

    @abc.abstractmethod
    def remove(self, reqs: set[Request]) -> None:
        """Drop the given requests wherever they are (aborts)."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._queue.append(req)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def prepend(self, reqs: Iterable[Request]) -> None:
        self._queue.extendleft(reversed(list(reqs)))

    def remove(self, reqs: set[Request]) -> None:
        self._queue = deque(r for r in self._queue if r not in reqs)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue(RequestQueue):
    """A heap keyed by (priority, arrival_time); a preempted request keeps its key, so it comes
    back ahead of later arrivals of the same priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        # Breaks exact ties in insertion order and keeps Request out of tuple comparisons.
        self._counter = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._counter), req))

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def prepend(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.add(req)

    def remove(self, reqs: set[Request]) -> None:
        self._heap = [entry for entry in self._heap if entry[3] not in reqs]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    queues = {"fcfs": FCFSQueue, "priority": PriorityQueue}
    if policy not in queues:
        raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(queues)}")
    return queues[policy]()
