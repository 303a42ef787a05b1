"""A request's grammar checked off the async client's event loop, within a deadline.

Parsing a grammar takes time that grows with its text (a JSON schema of nested objects, roughly
with the cube of its depth), and the async client's caller is the event loop that serves every
other request, `/health` included. So `EngineClient.generate` checks the grammar here first, on a
thread: a small lane for cheap specs and a large lane for the rest (the estimate the engine's
compile lanes use, `structured.compiles.estimated_cost`), so cheap checks never wait behind
expensive ones. A check that has not finished within `deadline_s` (queueing included) refuses the
request with a 400 that states the limit; the thread finishes alone (the server's size and depth
bounds keep any single check to about a second). The backend's library loads before the first
check, outside the deadline (xgrammar's import takes seconds: on a loaded machine the first
request alone would overrun it). Intake's own check of the request then hits the specs that passed
(`intake.check_structured_outputs`).
"""
from __future__ import annotations

import anyio
import msgspec

from ..discovery import resolve_structured_output_backend
from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams
from ..structured.compiles import LARGE_LANE_WORKERS, SMALL_GRAMMAR_COST, SMALL_LANE_WORKERS, estimated_cost
from .intake import check_structured_outputs
from .messages import EngineInfo

DEFAULT_DEADLINE_S = 5.0


class GrammarIntake:
    def __init__(self, info: EngineInfo, deadline_s: float = DEFAULT_DEADLINE_S):
        self._info = info
        self.deadline_s = deadline_s
        self._lanes: dict[str, anyio.CapacityLimiter] = {}
        self._library: anyio.Lock | None = None
        self._library_loaded = info.structured_outputs_backend is None

    async def check(self, spec: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError as intake does, or when the check overruns the deadline."""
        await self._load_library()
        lane = "small" if estimated_cost(msgspec.json.encode(spec)) < SMALL_GRAMMAR_COST else "large"
        with anyio.move_on_after(self.deadline_s) as scope:
            await anyio.to_thread.run_sync(check_structured_outputs, spec, self._info, limiter=self._lane(lane),
                                           abandon_on_cancel=True)
        if scope.cancelled_caught:
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} took longer than {self.deadline_s:g} s to check (the limit on "
                f"checking a grammar before it is compiled, waiting for the {lane}-grammar lane included); "
                "simplify it", param=f"structured_outputs.{spec.kind}")

    async def _load_library(self) -> None:
        if self._library_loaded:
            return
        self._library = self._library or anyio.Lock()  # made in the caller's loop, as the lanes are
        async with self._library:
            if not self._library_loaded:
                backend = resolve_structured_output_backend(self._info.structured_outputs_backend)
                await anyio.to_thread.run_sync(backend.load_library)
                self._library_loaded = True

    def _lane(self, lane: str) -> anyio.CapacityLimiter:
        # Limiters belong to the event loop that made them: made on first use, in the caller's loop.
        if lane not in self._lanes:
            self._lanes[lane] = anyio.CapacityLimiter(SMALL_LANE_WORKERS if lane == "small" else LARGE_LANE_WORKERS)
        return self._lanes[lane]
