"""How an EngineClient reaches the engine core: in this process (an anyio actor) or another one."""
from __future__ import annotations

import abc
from collections.abc import AsyncIterator

from .messages import EngineControl, EngineCoreOutputs, EngineCoreRequest, EngineInfo, SchedulerStats


class EngineTransport(abc.ABC):
    """A channel to one engine core. Methods are called from a single event loop."""

    info: EngineInfo

    @abc.abstractmethod
    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Deliver the requests whole or, by raising, not at all: the client then takes them off its
        queue count. Messages of all kinds reach the engine in the order they were sent."""

    @abc.abstractmethod
    async def abort_requests(self, request_ids: list[str]) -> None:
        ...

    @abc.abstractmethod
    async def control(self, message: EngineControl) -> None:
        """Send a sleep-mode message to every engine core; its outcome comes in the outputs
        (`EngineCoreOutputs.controls_done`)."""

    @abc.abstractmethod
    def outputs(self) -> AsyncIterator[EngineCoreOutputs]:
        """Every step's outputs, in order; ends when the engine stops, raises if it died."""

    @abc.abstractmethod
    async def close(self) -> None:
        ...

    def is_alive(self) -> bool:
        return True

    def engine_stats(self, latest: SchedulerStats) -> list[SchedulerStats]:
        """The latest stats of each engine core behind this transport, given `latest`, those of
        its last step report (a data-parallel transport reports the sum and keeps each engine's)."""
        return [latest]
