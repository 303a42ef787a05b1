"""What the steps in flight still owe the scheduler (async scheduling), in one place.

The engine may schedule step N+1 before step N's results arrive. Until they do, a request has
tokens in flight (a scheduled step samples them, their ids have not arrived) and is held by steps
in flight (scheduled, results not applied). The first count lets the next step give the request
its following position before the id is known; the second keeps a request preempted meanwhile
waiting until its token has arrived. A request released while steps still hold it leaves their
number under its id, so their results are dropped even when a new request has taken the id.

It also keeps which requests each step in flight holds, in order: pipeline stages keep the
requests of the latest steps out of the next one (`held_by_latest`), so that the steps in the
stages at once are micro-batches of different requests.

`StepsInFlight` is the only writer of these counts; the scheduler tells it when a step is
scheduled, when a token arrives, when a step's results are applied and when a request is
released, and asks it the rest. Under the synchronous loop every count is back to 0 after each
`Scheduler.update`.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from ..request import Request


class StepsInFlight:
    def __init__(self):
        self._tokens: dict[Request, int] = {}
        self._steps: dict[Request, int] = {}
        # Ids of released requests -> steps still holding them (several releases of one id add up).
        self._released: dict[str, int] = {}
        # The requests of each step in flight that holds any, oldest first.
        self._order: deque[set[Request]] = deque()

    def num_tokens(self, req: Request) -> int:
        """Tokens that scheduled steps sample for the request and whose ids have not arrived."""
        return self._tokens.get(req, 0)

    def holds(self, req: Request) -> bool:
        """Whether a step whose results are not applied yet holds the request."""
        return req in self._steps

    def held_by_latest(self, steps: int) -> set[Request]:
        """The requests that the last `steps` steps scheduled hold, those still in flight."""
        latest = list(itertools.islice(reversed(self._order), steps))
        if len(latest) == 1:
            return latest[0]
        return set().union(*latest)

    def begin_step(self) -> None:
        """A step that holds requests is being scheduled (`schedule` names them)."""
        self._order.append(set())

    def schedule(self, req: Request) -> None:
        """The step begun last now holds the request, whose computed count already includes the
        step's tokens; when they reach its last known or in-flight token, the step samples its next one."""
        self._order[-1].add(req)
        self._steps[req] = self._steps.get(req, 0) + 1
        tokens = self._tokens.get(req, 0)
        if req.num_computed_tokens == req.num_tokens + tokens:
            self._tokens[req] = tokens + 1

    def arrive(self, req: Request) -> None:
        """One of the request's tokens in flight has arrived."""
        _decrement(self._tokens, req)

    def settle(self, req_ids: Iterable[str], requests: dict[str, Request]) -> set[str]:
        """Count a step's results as applied for every request it held (`req_ids`, looked up in
        the live `requests`), the oldest step in flight; returns the ids whose holder was released
        while the step ran, whose results belong to no live request."""
        stale = set()
        if req_ids:
            self._order.popleft()
        for req_id in req_ids:
            if req_id in self._released:
                stale.add(req_id)
                _decrement(self._released, req_id)
            elif (req := requests.get(req_id)) is not None:
                _decrement(self._steps, req)
        return stale

    def release(self, req: Request) -> None:
        """The request is finished or aborted: the steps still holding it now hold only its id."""
        self._tokens.pop(req, None)
        steps = self._steps.pop(req, 0)
        if steps:
            self._released[req.request_id] = self._released.get(req.request_id, 0) + steps


def _decrement(counts: dict, key) -> None:
    if counts[key] > 1:
        counts[key] -= 1
    else:
        del counts[key]
