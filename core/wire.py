"""Messages between the engine actor and a worker.

They carry diffs, as vLLM V1 does: a request travels in full once (`NewRequestData`, also after a
preemption), afterwards only its new block ids and computed-token count, so a worker may live in
another process and keep its own per-request state.
"""
from __future__ import annotations

import msgspec

from .sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    sample_index: int = 0


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False):
    """One step's work. `num_computed_tokens` values are counts *before* this step's tokens.

    `finished_req_ids` lists requests the worker must forget (finished, aborted or preempted
    since the previous step); a preempted request comes back later as a new request.
    """

    new_requests: list[NewRequestData]
    cached_requests: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs for a run of positions: row i holds the chosen token first, then the top-k.

    `ranks[i]` is the chosen token's rank in the distribution (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False):
    """What a step produced: one sampled token for every request that reached the end of its tokens.

    Requests still in a partial (chunked) prefill produce no token and are absent from `req_ids`.
    `logprobs` rows align with `req_ids`; `prompt_logprobs` holds, per request, the logprobs of
    the prompt positions computed this step (position 0 has none and is skipped).
    """

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: LogprobsLists | None = None
    prompt_logprobs: dict[str, LogprobsLists] = {}


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
