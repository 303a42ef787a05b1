"""How an EngineClient reaches the engine core: in this process (an anyio actor) or another one."""
from __future__ import annotations

import abc
from collections.abc import AsyncIterator

from .core import EngineInfo
from .messages import EngineCoreOutputs, EngineCoreRequest


class EngineTransport(abc.ABC):
    """A channel to one engine core. Methods are called from a single event loop."""

    info: EngineInfo

    @abc.abstractmethod
    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        ...

    @abc.abstractmethod
    async def abort_requests(self, request_ids: list[str]) -> None:
        ...

    @abc.abstractmethod
    def outputs(self) -> AsyncIterator[EngineCoreOutputs]:
        """Every step's outputs, in order; ends when the engine stops, raises if it died."""

    @abc.abstractmethod
    async def close(self) -> None:
        ...

    def is_alive(self) -> bool:
        return True
