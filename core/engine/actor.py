"""The in-process engine actor: an anyio task that owns an EngineCore and serves an inbox.

The step itself runs in a worker thread (torch releases the GIL) so the event loop keeps serving
HTTP and detokenization meanwhile; inbox messages are applied only between steps, so the core is
never touched by two threads at once. The inbox holds the messages a socket would carry
(`messages.ClientMessage`); what to do with them is `EngineCore`'s business.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator

import anyio
from anyio.abc import TaskGroup

from ..config import EngineConfig
from ..errors import EngineDeadError
from .core import EngineCore
from .messages import (
    AbortRequests,
    AddRequests,
    ClientMessage,
    EngineControl,
    EngineCoreOutputs,
    EngineCoreRequest,
    ShutdownEngine,
)
from .transport import EngineTransport

# How often an idle engine looks at its ranks, as the engine process does (`remote._serve`).
_IDLE_RANK_CHECK_S = 0.5


class InProcessEngine(EngineTransport):
    def __init__(self, core: EngineCore):
        self.core = core
        self.info = core.info
        # Unbounded, and written with send_nowait: nothing yields between a caller's decision and
        # the enqueue, so an abort the client queues precedes any later add that reuses the id.
        self._inbox_send, self._inbox = anyio.create_memory_object_stream[ClientMessage](math.inf)
        self._out_send, self._out_recv = anyio.create_memory_object_stream[EngineCoreOutputs](math.inf)
        self._error: BaseException | None = None
        self._closed = False

    @classmethod
    async def start(cls, config: EngineConfig, task_group: TaskGroup) -> "InProcessEngine":
        core = await anyio.to_thread.run_sync(EngineCore, config)
        engine = cls(core)
        task_group.start_soon(engine._run)
        return engine

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        self._inbox_send.send_nowait(AddRequests(requests))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if self._error is None and not self._closed:
            self._inbox_send.send_nowait(AbortRequests(request_ids))

    async def control(self, message: EngineControl) -> None:
        self._check_alive()
        self._inbox_send.send_nowait(message)

    async def outputs(self) -> AsyncIterator[EngineCoreOutputs]:
        async for batch in self._out_recv:
            yield batch
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}") from self._error

    async def close(self) -> None:
        self._closed = True
        self._inbox_send.send_nowait(ShutdownEngine())

    def is_alive(self) -> bool:
        return self._error is None and not self._closed

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}")
        if self._closed:
            raise EngineDeadError("engine is shut down")

    async def _run(self) -> None:
        try:
            async with self._out_send:
                await self._loop()
        except Exception as exc:  # the engine is dead: record why; ending the stream tells clients
            self._error = exc

    async def _next_message(self) -> ClientMessage:
        """The next message; while none comes, the ranks are checked (no step would notice a death)."""
        while True:
            with anyio.move_on_after(_IDLE_RANK_CHECK_S):
                return await self._inbox.receive()
            self.core.executor.check_alive()

    async def _loop(self) -> None:
        while True:
            messages = [] if self.core.has_unfinished_requests() else [await self._next_message()]
            with contextlib.suppress(anyio.WouldBlock):
                while True:
                    messages.append(self._inbox.receive_nowait())
            for message in messages:
                if isinstance(message, ShutdownEngine):
                    return
                self.core.apply(message)
            self._out_send.send_nowait(await anyio.to_thread.run_sync(self.core.step))
