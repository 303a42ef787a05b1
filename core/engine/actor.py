"""The in-process engine actor: an anyio task that owns an EngineCore and serves an inbox.

The step itself runs in a worker thread (torch releases the GIL) so the event loop keeps serving
HTTP and detokenization meanwhile; inbox messages are applied only between steps, so the core is
never touched by two threads at once.
"""
from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator

import anyio
from anyio.abc import TaskGroup

from ..config import EngineConfig
from ..errors import CorectlError, EngineDeadError
from .core import EngineCore
from .messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from .transport import EngineTransport

logger = logging.getLogger("corectl.engine")


class InProcessEngine(EngineTransport):
    def __init__(self, core: EngineCore):
        self.core = core
        self.info = core.info
        self._inbox_send, self._inbox = anyio.create_memory_object_stream(math.inf)
        self._out_send, self._out_recv = anyio.create_memory_object_stream(math.inf)
        self._error: BaseException | None = None
        self._rejected: list[EngineCoreOutput] = []
        self._closed = False

    @classmethod
    async def start(cls, config: EngineConfig, task_group: TaskGroup) -> "InProcessEngine":
        core = await anyio.to_thread.run_sync(EngineCore, config)
        engine = cls(core)
        task_group.start_soon(engine._run)
        return engine

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        await self._inbox_send.send(("add", requests))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if self._error is None and not self._closed:
            await self._inbox_send.send(("abort", request_ids))

    async def outputs(self) -> AsyncIterator[EngineCoreOutputs]:
        async for batch in self._out_recv:
            yield batch
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}") from self._error

    async def close(self) -> None:
        self._closed = True
        await self._inbox_send.send(("stop", None))

    def is_alive(self) -> bool:
        return self._error is None and not self._closed

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}")
        if self._closed:
            raise EngineDeadError("engine is shut down")

    def _handle(self, kind: str, payload) -> bool:
        if kind == "add":
            for request in payload:
                try:
                    self.core.add_request(request)
                except CorectlError as exc:
                    # Clients validate first (and bound the queue); a request that still fails here
                    # (invalid, or the queue is full) ends alone, the loop lives on.
                    logger.warning("engine rejected request %s: %s", request.request_id, exc)
                    self._rejected.append(EngineCoreOutput(request.request_id, [], finish_reason="abort"))
        elif kind == "abort":
            self.core.abort_requests(payload)
        return kind != "stop"

    async def _run(self) -> None:
        try:
            async with self._out_send:
                await self._loop()
        except Exception as exc:  # the engine is dead: record why; ending the stream tells clients
            self._error = exc

    async def _loop(self) -> None:
        while True:
            if not self.core.has_unfinished_requests():
                kind, payload = await self._inbox.receive()
                if not self._handle(kind, payload):
                    return
            while True:
                try:
                    kind, payload = self._inbox.receive_nowait()
                except anyio.WouldBlock:
                    break
                if not self._handle(kind, payload):
                    return
            batch = await anyio.to_thread.run_sync(self.core.step)
            if self._rejected:
                batch.outputs[:0], self._rejected = self._rejected, []
            await self._out_send.send(batch)
