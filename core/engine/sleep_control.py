"""The client's side of the engine's controls (sleep mode, and resetting the prefix cache): send
`SleepEngine` / `WakeEngine` / `ResetPrefixCache` and wait until the engine core reports them done
(`EngineCoreOutputs.controls_done`), raising the error of one that failed.

`requested` turns true as soon as a sleep is asked for, so the server refuses new generation
requests from then on (503) while the running ones finish; the engine sleeps once they have.
"""
from __future__ import annotations

import anyio

from ..errors import EngineDeadError, InvalidRequestError
from .messages import EngineControl, EngineCoreOutputs, ResetPrefixCache, SleepEngine, WakeEngine
from .transport import EngineTransport


class SleepControl:
    def __init__(self, transport: EngineTransport):
        self._transport = transport
        self.level = 0  # the engine's, as last reported
        self.requested = False
        self._sent = 0
        self._done = 0
        self._errors: dict[int, str] = {}
        self._changed = anyio.Event()

    @property
    def is_sleeping(self) -> bool:
        return self.level > 0

    def observe(self, batch: EngineCoreOutputs) -> None:
        """Called with every batch of outputs the engine sends (one a step): waiters are woken only
        when the sleep state moved, so a step of a server that is not going to sleep makes no event."""
        if (batch.sleep_level, batch.controls_done) == (self.level, self._done) and not batch.control_errors:
            return
        self.level, self._done = batch.sleep_level, batch.controls_done
        self._errors.update(batch.control_errors)
        self._wake()

    def engine_stopped(self) -> None:
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        # The event's own class: `anyio.Event()` looks the async backend up each time.
        self._changed = type(self._changed)()

    async def sleep(self, level: int) -> None:
        self.requested = True
        try:
            await self._run(SleepEngine(level))
        except BaseException:
            self.requested = self.is_sleeping
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._run(WakeEngine(tags))
        self.requested = self.is_sleeping

    async def reset_prefix_cache(self) -> None:
        """Once the running requests have finished, forget every cached prefix."""
        await self._run(ResetPrefixCache())

    async def _run(self, message: EngineControl) -> None:
        self._sent += 1
        number = self._sent
        await self._transport.control(message)
        while self._done < number:
            if not self._transport.is_alive():
                raise EngineDeadError("the engine stopped before it carried out the sleep-mode request")
            await self._changed.wait()
        error = self._errors.pop(number, None)
        if error is not None:
            param = {SleepEngine: "level", WakeEngine: "tags"}.get(type(message))
            raise InvalidRequestError(error, param=param)
