"""Messages between an engine client and the engine core (in-process or over a socket)."""
from __future__ import annotations

import msgspec

from ..sampling_params import SamplingParams
from ..wire import EngineCoreOutput, SchedulerStats


class EngineCoreRequest(msgspec.Struct, array_like=True, gc=False):
    """One sequence to generate. The `n` samples of a user request are separate core requests
    sharing `group_id` (their prompt blocks are shared through the prefix cache)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    group_id: str | None = None
    sample_index: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """One step's outputs plus the scheduler's stats after it.

    `num_requests_received` counts the core requests the engine had taken in (admitted or refused)
    before this step, so a client can tell which of the requests it sent the stats already count.
    """

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float
    num_requests_received: int = 0
