"""A launched step whose sampled ids are still on their way to the host.

`ModelRunner.launch` queues a step's forward pass and sampling and returns an `InflightStep`; the
host reads the ids with `result()`. With async scheduling the engine launches step N+1 before it
calls `result()` on step N, so the host's scheduling, input building and output handling overlap
the device's work. Every device-to-host copy of a step starts at launch, in one `HostFetch`, so
`result()` waits for that step alone and never for the step queued behind it.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..sample.logprobs import LogprobsTensors
from ..step_messages import KVTransferReport, LogprobsLists, ModelRunnerOutput
from .request_states import CachedRequestState, RequestStates


@dataclass
class HostFetch:
    """Host copies of device tensors, usable once `wait()` has returned."""

    tensors: list[torch.Tensor]
    wait: Callable[[], None]


def fetch_now(tensors: Sequence[torch.Tensor]) -> HostFetch:
    """Copy to the host synchronously (any device; free for tensors already on the CPU)."""
    return HostFetch([t.cpu() for t in tensors], lambda: None)


@dataclass
class SampledRows:
    """What a launched step sampled: the requests' states in row order and the `RequestStates`
    holding them, the copy of their ids (and logprobs) under way, and how many top logprobs each
    row keeps (None: no logprobs). A verify step (speculative decoding) fetches `[B, K + 1]` ids
    and each request's number of emitted tokens; `verified_rows` then holds each request's
    number of verified rows (its logprobs rows), else None."""

    request_states: RequestStates
    states: list[CachedRequestState]
    fetch: HostFetch
    num_logprobs: list[int] | None
    verified_rows: list[int] | None = None


@dataclass
class PooledRows:
    """What a pooling engine's step pooled: one fp32 vector per request, rows in `req_ids` order,
    on their way to the host."""

    req_ids: list[str]
    fetch: HostFetch

    def read(self) -> dict[str, bytes]:
        self.fetch.wait()
        vectors = self.fetch.tensors[0].numpy().astype("<f4", copy=False)
        return {req_id: row.tobytes() for req_id, row in zip(self.req_ids, vectors)}


class InflightStep:
    """The sampled ids (and logprobs) of one launched step, or a pooling engine's vectors;
    `result()` reads them once and hands sampled ids to the `RequestStates` of the runner that
    launched it, the only writer of the requests' tokens."""

    def __init__(self, sampled: SampledRows | None, prompt_logprobs: dict[str, LogprobsLists],
                 pooled: PooledRows | None = None):
        self._sampled = sampled
        self._prompt_logprobs = prompt_logprobs
        self._pooled = pooled
        self._output: ModelRunnerOutput | None = None
        # What the worker's KV connector reported at this step's launch.
        self.kv_transfer: KVTransferReport | None = None

    def set_sampled(self, sampled: SampledRows) -> None:
        """The rows of a step launched with its grammar masks pending, sampled once they came."""
        self._sampled = sampled

    @classmethod
    def done(cls, prompt_logprobs: dict[str, LogprobsLists] | None = None) -> "InflightStep":
        """A step that sampled nothing."""
        return cls(None, prompt_logprobs or {})

    def result(self) -> ModelRunnerOutput:
        """Wait for the ids, record them in the worker's request states and return the output."""
        if self._output is None:
            self._output = self._read()
            self._output.kv_transfer = self.kv_transfer
        return self._output

    def _read(self) -> ModelRunnerOutput:
        sampled = self._sampled
        if sampled is None:
            pooled = {} if self._pooled is None else self._pooled.read()
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs=self._prompt_logprobs,
                                     pooled=pooled)
        sampled.fetch.wait()
        if sampled.verified_rows is not None:
            return self._read_verified(sampled)
        ids_host, *logprob_host = sampled.fetch.tensors
        token_ids = ids_host.tolist()
        sampled.request_states.receive_sampled(sampled.states, token_ids)
        logprobs = None
        if sampled.num_logprobs is not None:
            logprobs = LogprobsTensors(*logprob_host).to_lists(sampled.num_logprobs)
        return ModelRunnerOutput(req_ids=[s.req_id for s in sampled.states], sampled_token_ids=token_ids,
                                 logprobs=logprobs, prompt_logprobs=self._prompt_logprobs)

    def _read_verified(self, sampled: SampledRows) -> ModelRunnerOutput:
        """A verify step's output: every request's emitted tokens, request after request."""
        ids_host, emitted_host, *logprob_host = sampled.fetch.tensors
        counts = emitted_host.tolist()
        tokens = [row[:count] for row, count in zip(ids_host.tolist(), counts)]
        sampled.request_states.receive_verified(sampled.states, tokens)
        logprobs = None
        if sampled.num_logprobs is not None:
            every_row = LogprobsTensors(*logprob_host).to_lists(sampled.num_logprobs)
            starts = itertools.accumulate(sampled.verified_rows, initial=0)
            keep = [row for start, count in zip(starts, counts) for row in range(start, start + count)]
            logprobs = LogprobsLists(token_ids=[every_row.token_ids[r] for r in keep],
                                     logprobs=[every_row.logprobs[r] for r in keep],
                                     ranks=[every_row.ranks[r] for r in keep])
        return ModelRunnerOutput(req_ids=[s.req_id for s in sampled.states],
                                 sampled_token_ids=[t for row in tokens for t in row], logprobs=logprobs,
                                 prompt_logprobs=self._prompt_logprobs, num_sampled=counts)
