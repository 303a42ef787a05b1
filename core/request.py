"""One request's state as the engine actor sees it (the scheduler and KV cache manager read and write it)."""
from __future__ import annotations

import enum
import time

from .lora.request import LoRARequest
from .multimodal.inputs import MultiModalInput
from .sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A sequence being generated.

    `num_computed_tokens` counts tokens whose K/V are in the cache (or scheduled into it this
    step); the scheduler advances it when it schedules, so a request is "prefilling" while it is
    below `num_prompt_tokens`. What scheduled steps still owe it under async scheduling (tokens
    sampled but not arrived, steps not applied) is the scheduler's `StepsInFlight`'s to count.
    `group_id` ties together the `n` samples of one user request so the scheduler can let one of
    them fill the shared prompt blocks first. `mm_inputs` are the prompt's images, in prompt order.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        max_tokens: int,
        priority: int = 0,
        arrival_time: float | None = None,
        group_id: str | None = None,
        sample_index: int = 0,
        lora_request: LoRARequest | None = None,
        mm_inputs: list[MultiModalInput] | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.group_id = group_id or request_id
        self.sample_index = sample_index
        self.lora_request = lora_request
        self.mm_inputs: list[MultiModalInput] = list(mm_inputs or ())
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        self.block_hashes: list[int] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Finish the request if its newest token ends it; returns whether it finished."""
        params = self.sampling_params
        num_output = len(self.all_token_ids) - len(self.prompt_token_ids)
        if num_output >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if num_output < params.min_tokens:
            return False
        last = self.all_token_ids[-1]
        if not params.ignore_eos and last == self.eos_token_id:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
