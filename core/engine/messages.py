"""Messages between an engine client and the engine core (in-process or over a socket)."""
from __future__ import annotations

import msgspec

from ..sampling_params import SamplingParams
from ..worker.output import LogprobsLists


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


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """Per-request result of one engine step: the token ids produced since the last output.

    `finish_reason` is "stop", "length" or "abort" once the request is done; `stop_reason` is the
    stop token id that ended it, if any. `num_cached_tokens` is the prefix-cache hit length.
    `first_scheduled_time` (`time.monotonic()` in the engine's process, a clock shared by the
    processes of one host) is when the request first got a step: it ends its queue time.
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: LogprobsLists | None = None
    prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None


class SchedulerStats(msgspec.Struct, array_like=True, gc=False):
    """Gauges and counters the scheduler exposes after each step (counters are cumulative)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """One step's outputs plus the scheduler's stats after it.

    `num_requests_received` counts the core requests the engine had taken in (admitted or refused)
    before this step, so a client can tell which of the requests it sent the stats already count.
    """

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float
    num_requests_received: int = 0
