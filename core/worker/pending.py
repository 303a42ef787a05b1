"""A launched step whose sampled ids are still on their way to the host.

`ModelRunner.launch` queues a step's forward pass and sampling and returns a `PendingStep`; the
host reads the ids with `result()`. With async scheduling the engine launches step N+1 before it
calls `result()` on step N, so the host's scheduling, input building and output handling overlap
the device's work. Every device-to-host copy of a step starts at launch, in one `HostFetch`, so
`result()` waits for that step alone and never for the step queued behind it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..sample.logprobs import LogprobsTensors
from .output import LogprobsLists, ModelRunnerOutput
from .request_states import CachedRequestState


@dataclass
class HostFetch:
    """Host copies of device tensors, usable once `wait()` has returned."""

    tensors: list[torch.Tensor]
    wait: Callable[[], None]


def fetch_now(tensors: Sequence[torch.Tensor]) -> HostFetch:
    """Copy to the host synchronously (any device; free for tensors already on the CPU)."""
    return HostFetch([t.cpu() for t in tensors], lambda: None)


class PendingStep:
    """The sampled ids (and logprobs) of one launched step; `result()` reads them once."""

    def __init__(self, states: list[CachedRequestState], req_ids: list[str], fetch: HostFetch | None,
                 num_logprobs: list[int] | None, prompt_logprobs: dict[str, LogprobsLists]):
        self._states = states
        self._req_ids = req_ids
        self._fetch = fetch
        self._num_logprobs = num_logprobs
        self._prompt_logprobs = prompt_logprobs
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def done(cls, prompt_logprobs: dict[str, LogprobsLists] | None = None) -> "PendingStep":
        """A step that sampled nothing."""
        return cls([], [], None, None, prompt_logprobs or {})

    def result(self) -> ModelRunnerOutput:
        """Wait for the ids, append them to the requests' worker state and return the output."""
        if self._output is None:
            self._output = self._read()
        return self._output

    def _read(self) -> ModelRunnerOutput:
        if self._fetch is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs=self._prompt_logprobs)
        self._fetch.wait()
        sampled_host, *logprob_host = self._fetch.tensors
        sampled = sampled_host.tolist()
        # A request forgotten since launch (finished, aborted, preempted) holds a detached state:
        # appending to it is harmless, and the scheduler drops or keeps the token as it sees fit.
        for state, token in zip(self._states, sampled):
            state.token_ids.append(token)
            state.num_pending -= 1
        logprobs = None
        if self._num_logprobs is not None:
            logprobs = LogprobsTensors(*logprob_host).to_lists(self._num_logprobs)
        return ModelRunnerOutput(req_ids=self._req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs=self._prompt_logprobs)
