"""The scheduler's half that applies a step's results: sampled tokens appended (grammars advanced,
stops checked), pooled vectors, accepted drafts, prompt logprobs, and the requests that ended
released. `Scheduler` mixes it in; its state is the scheduler's (see `scheduler.py`).
"""
from __future__ import annotations

from ..engine.messages import EngineCoreOutput
from ..request import Request, RequestStatus
from ..step_messages import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from .prompt_logprobs import logprobs_rows


class StepResults:
    def update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step's sampled tokens; one output per request that produced a token."""
        stale = self.in_flight.settle(sched_out.num_scheduled_tokens, self._requests)
        if runner_out.kv_transfer is not None:
            # Settled loads go back to the front of the queue, keeping their blocks.
            self.waiting.prepend(self.kv_loads.apply(runner_out.kv_transfer))
        requests = self._requests
        for req_id, chunk in runner_out.prompt_logprobs.items():
            req = requests.get(req_id)
            # A request preempted mid-prefill since recomputes these rows; one whose first token is
            # still in flight keeps them (see _preempt).
            if req_id not in stale and req is not None and (
                    req.status == RequestStatus.RUNNING or self.in_flight.num_tokens(req)):
                self._prompt_logprobs.add(req_id, chunk)
        outputs, stopped = self._apply_pooled(runner_out.pooled, stale)
        scheduled, logprobs = sched_out.num_scheduled_tokens, runner_out.logprobs
        for req_id, rows in zip(runner_out.req_ids, runner_out.token_rows()):
            if req_id not in scheduled:
                raise RuntimeError(
                    f"the worker sampled a token for request {req_id!r}, which this step did not schedule"
                )
            req = requests.get(req_id)
            if req_id in stale or req is None:
                continue  # finished or aborted while the step ran
            self.in_flight.arrive(req)
            drafts = sched_out.spec_token_ids.get(req_id)
            if drafts:
                # Every emitted token but the last is an accepted draft, whose K/V the step wrote;
                # a request preempted while the step ran (async scheduling) recomputes them instead.
                self.drafts.counters.record(len(drafts), len(rows) - 1)
                if req.status == RequestStatus.RUNNING:
                    req.num_computed_tokens += len(rows) - 1
            output = self._append_tokens(req, runner_out.sampled_token_ids, logprobs, rows)
            outputs.append(output)
            if output.finish_reason is not None:
                stopped.append(req)
        if stopped:
            self._finish(stopped)
        return outputs

    def _apply_pooled(self, pooled: dict[str, bytes], stale: set[str]) -> tuple[list[EngineCoreOutput], list[Request]]:
        """Finish the prefill-only requests whose vectors arrived. A request preempted after its last
        chunk was scheduled still finishes: the step computed its whole prompt before it was."""
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        for req_id, vector in pooled.items():
            req = self._requests.get(req_id)
            if req_id in stale or req is None:
                continue  # aborted while the step ran
            self.in_flight.arrive(req)
            req.status = RequestStatus.FINISHED_STOPPED
            stopped.append(req)
            outputs.append(EngineCoreOutput(req_id, [], finish_reason="stop", pooled=vector,
                                            num_cached_tokens=max(req.num_cached_tokens, 0),
                                            first_scheduled_time=req.first_scheduled_time))
        return outputs, stopped

    def _finish(self, stopped: list[Request]) -> None:
        """Release requests that stopped, in the order they stopped (the worker forgets them in
        that order); with async scheduling some may be preempted (waiting)."""
        stopped_set = set(stopped)
        preempted = stopped_set.difference(self.running)
        self.running = [req for req in self.running if req not in stopped_set]
        if preempted:
            self.waiting.remove(preempted)
        for req in stopped:
            self._forget[req.request_id] = None
            self._release(req)

    def _append_tokens(self, req: Request, token_ids: list[int], logprobs: LogprobsLists | None,
                       rows: range) -> EngineCoreOutput:
        """Append the request's tokens of this step (`token_ids[rows]`: one, or a verify step's
        accepted drafts and the token after them) up to the first that ends it."""
        end, error = self.grammar.append(req, token_ids, rows, self.max_model_len)
        return EngineCoreOutput(
            req_id=req.request_id,
            new_token_ids=token_ids[rows.start:end],
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=logprobs_rows(logprobs, rows.start, end),
            prompt_logprobs=self._prompt_logprobs.pop(req.request_id),
            num_cached_tokens=max(req.num_cached_tokens, 0),
            first_scheduled_time=req.first_scheduled_time,
            error=error,
        )
