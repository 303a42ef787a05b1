"""The worker's own copy of each running request, kept in sync from SchedulerOutput diffs."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling_params import SamplingParams
from ..wire import NewRequestData, SchedulerOutput


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    prompt_logprobs_done: bool = field(default=False)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def seeded_generator(self) -> torch.Generator | None:
        """The request's generator, reseeded from (seed, output position).

        Deriving each draw from the position rather than from generator history makes a seeded
        request's tokens independent of batching and identical after a preemption resume.
        """
        if self.generator is not None:
            step = len(self.token_ids) - self.num_prompt_tokens
            self.generator.manual_seed((self.sampling_params.seed * 1_000_003 + step) % (1 << 63))
        return self.generator


class RequestStates:
    """Per-request state owned by the worker; applies each step's diff before the forward pass."""

    def __init__(self, device: torch.device):
        self.device = device
        self.states: dict[str, CachedRequestState] = {}

    def apply(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.states.pop(req_id, None)
        for new in sched.new_requests:
            self.states[new.req_id] = self._make_state(new)
        cached = sched.cached_requests
        for req_id, new_blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.states[req_id]
            state.block_ids.extend(new_blocks)
            state.num_computed_tokens = computed

    def _make_state(self, new: NewRequestData) -> CachedRequestState:
        params = new.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
        return CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            generator=generator,
            # A resumed request already reported its prompt logprobs before it was preempted.
            prompt_logprobs_done=len(new.token_ids) > new.num_prompt_tokens
            or new.num_computed_tokens >= new.num_prompt_tokens,
        )

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self.states[req_id]
