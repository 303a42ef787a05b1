"""Client-side request registry and output processing: intake, fan-out of `n`, incremental
detokenization, stop strings, logprobs, and finishing a pooling engine's vectors into embeddings.

`add_request` is where every path (the async client, the offline `LLM`) registers a request, so it is
where intake runs (`intake.check_request`). Runs where the caller lives (the API server's process, or the offline LLM), never in the engine loop.
A stop-string hit finishes the sample here and asks the engine to abort it. Without a tokenizer
(`tokenizer=None`) outputs carry token ids and empty text.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..detokenizer import IncrementalDetokenizer, StopStringMatcher
from ..lora.intake import check_lora_request
from ..lora.request import LoRARequest
from ..outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    num_token_ids,
)
from ..pooling import PoolingParams, finish_embedding, vector_from_bytes
from ..sampling_params import SamplingParams
from ..step_messages import LogprobsLists
from ..tokenizer import Tokenizer
from ..multimodal.inputs import MultiModalInput
from .intake import check_mm_inputs, check_pooling_request, check_request, prepare_request
from .messages import EngineCoreOutput, EngineCoreRequest, EngineInfo


# What an embedding request carries to the engine in place of sampling: a pooling engine never samples,
# and its requests end when their prompt has run.
_PREFILL_ONLY = SamplingParams(temperature=0.0, max_tokens=1)


class _NoText:
    """The detokenizer of a tokenizer-free engine: token ids never become text."""

    def push(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


class _Sample:
    """One of the `n` sequences of a request. With `stream_deltas`, `text`, `token_ids` and `logprobs`
    hold what arrived since its last output, which takes them; otherwise everything so far."""

    def __init__(self, index: int, tokenizer: Tokenizer | None, prompt_ids: list[int], params: SamplingParams):
        self.index = index
        self.detok = (_NoText() if tokenizer is None
                      else IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens,
                                                   params.spaces_between_special_tokens))
        self.stop = StopStringMatcher(params.stop or [], params.include_stop_str_in_output)
        # Stop strings count from the token after the first min_tokens (vLLM's rule).
        self.min_tokens = params.min_tokens
        self.num_fed = 0
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None


@dataclass
class RequestTracker:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    changed: bool = field(default=False)
    # An embedding request's options, and its finished vector once it has arrived.
    pooling: PoolingParams | None = None
    embedding: list[float] | None = None
    unfinished: int = field(init=False)  # samples without a finish reason yet
    delivered: bool = False
    times_delivered: int = 0  # of metrics.token_times, those earlier deltas brought

    def __post_init__(self):
        self.unfinished = len(self.samples)

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    @property
    def held(self) -> int:
        """Delta mode: the new tokens not delivered yet (a stream interval above 1 holds them)."""
        return num_token_ids(self.samples)


def _child_ids(request_id: str, n: int) -> list[str]:
    """The core request ids of a user request's `n` samples."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def _update_metrics(metrics: RequestMetrics, out: EngineCoreOutput, now: float) -> None:
    if out.num_cached_tokens:
        metrics.num_cached_tokens = out.num_cached_tokens
    scheduled = out.first_scheduled_time
    # The n samples of a request queue separately: the request waited until the first of them ran.
    if scheduled is not None and (metrics.first_scheduled_time is None or scheduled < metrics.first_scheduled_time):
        metrics.first_scheduled_time = scheduled
    if out.new_token_ids:
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        metrics.token_times.append(now)
        metrics.num_generation_tokens += len(out.new_token_ids)


class OutputProcessor:
    def __init__(self, info: EngineInfo, tokenizer: Tokenizer | None, stream_deltas: bool,
                 final_only: bool = False, known_loras: dict[int, LoRARequest] | None = None,
                 stream_interval: int = 1):
        """`info`: the engine's limits, which intake checks against. `stream_deltas`: outputs carry
        what is new since the last one (servers); otherwise the whole text so far. `final_only`: emit
        a request's output only once it has finished (offline batches), which saves copying every
        request's tokens on every step. `known_loras`: the LoRA adapters checked so far, by id,
        shared by the processors of one engine (an id names one adapter for good).
        `stream_interval` (deltas only): a request's delta is delivered once it holds this many new
        tokens, besides its first and its last (`EngineConfig.stream_interval`)."""
        self.info = info
        self.tokenizer = tokenizer
        self.stream_deltas = stream_deltas
        self.final_only = final_only
        self.stream_interval = stream_interval if stream_deltas else 1
        self.trackers: dict[str, RequestTracker] = {}
        self._children: dict[str, tuple[RequestTracker, int]] = {}
        self._loras = {} if known_loras is None else known_loras

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0, lora_request: LoRARequest | None = None,
                    mm_inputs: list[MultiModalInput] | None = None) -> list[EngineCoreRequest]:
        """Check and register a user request; returns the core requests (one per sample) to send.
        `lora_request`: the adapter it runs with (None: the base model); `mm_inputs`: its images.

        Raises InvalidRequestError, registering nothing, when intake refuses it."""
        prompt, prompt_token_ids, params = prepare_request(prompt, prompt_token_ids, params, self.tokenizer)
        child_ids = _child_ids(request_id, params.n)
        check_request([request_id, *child_ids], prompt_token_ids, params, self.info, self._in_use)
        check_lora_request(lora_request, self.info.lora, self._loras)
        check_mm_inputs(mm_inputs or [], prompt_token_ids, self.info)
        now = time.monotonic()
        samples = [_Sample(i, self.tokenizer, prompt_token_ids, params) for i in range(params.n)]
        tracker = RequestTracker(request_id, prompt, list(prompt_token_ids), params, samples,
                                 RequestMetrics(arrival_time=now, num_prompt_tokens=len(prompt_token_ids)),
                                 prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self.trackers[request_id] = tracker
        core_requests = []
        for i, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            self._children[child_id] = (tracker, i)
            core_requests.append(EngineCoreRequest(child_id, list(prompt_token_ids), child_params, now,
                                                   priority, group_id=request_id, sample_index=i,
                                                   lora_request=lora_request, mm_inputs=list(mm_inputs or ())))
        return core_requests

    def add_pooling_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                            params: PoolingParams, priority: int = 0) -> EngineCoreRequest:
        """Check and register an embedding request (a pooling engine's, prefill only); returns the
        core request to send. Raises InvalidRequestError, registering nothing, when intake refuses it."""
        check_pooling_request(request_id, prompt_token_ids, params, self.info, self._in_use)
        now = time.monotonic()
        self.trackers[request_id] = tracker = RequestTracker(
            request_id, prompt, list(prompt_token_ids), _PREFILL_ONLY, [_Sample(0, None, [], _PREFILL_ONLY)],
            RequestMetrics(arrival_time=now, num_prompt_tokens=len(prompt_token_ids)), pooling=params)
        self._children[request_id] = (tracker, 0)
        return EngineCoreRequest(request_id, list(prompt_token_ids), _PREFILL_ONLY, now, priority)

    def child_ids(self, request_id: str) -> list[str]:
        tracker = self.trackers.get(request_id)
        return [] if tracker is None else _child_ids(request_id, len(tracker.samples))

    def _in_use(self, request_id: str) -> bool:
        return request_id in self.trackers or request_id in self._children

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request (client went away); returns the core request ids to abort."""
        ids = self.child_ids(request_id)
        self.trackers.pop(request_id, None)
        for child_id in ids:
            self._children.pop(child_id, None)
        return ids

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs; returns the request outputs to deliver and core ids to abort."""
        now = time.monotonic()
        to_abort: list[str] = []
        touched: dict[str, RequestTracker] = {}
        for out in outputs:
            entry = self._children.get(out.req_id)
            if entry is None:
                continue
            tracker, index = entry
            if self._apply(tracker, tracker.samples[index], out, now):
                to_abort.append(out.req_id)
            touched[tracker.request_id] = tracker
        results = []
        interval = self.stream_interval
        for tracker in touched.values():
            finished = tracker.finished
            if finished or not self.final_only and (interval == 1 or not tracker.delivered or tracker.held >= interval):
                self._deliver(tracker, results)
            if finished:
                tracker.metrics.finished_time = now
                self.abort_request(tracker.request_id)
        return results, to_abort

    def _deliver(self, tracker: RequestTracker, results: list) -> None:
        metrics = tracker.metrics
        metrics.delta_token_times = len(metrics.token_times) - tracker.times_delivered
        tracker.times_delivered = len(metrics.token_times)
        tracker.delivered = True
        results.append(self._make_output(tracker))

    def _apply(self, tracker: RequestTracker, sample: _Sample, out: EngineCoreOutput, now: float) -> bool:
        """Returns True when a stop string finished the sample (the engine must abort it)."""
        if sample.finish_reason is not None:
            return False
        if out.prompt_logprobs is not None and tracker.prompt_logprobs is not None and sample.index == 0:
            tracker.prompt_logprobs.extend(self._decode_logprobs(out.prompt_logprobs))
        _update_metrics(tracker.metrics, out, now)
        if out.pooled is not None:
            vector = finish_embedding(vector_from_bytes(out.pooled), tracker.pooling, self.info.pooling)
            tracker.embedding = vector.tolist()
        new_ids = out.new_token_ids
        if out.finish_reason == "stop" and new_ids and not tracker.params.include_stop_str_in_output:
            # The engine stops on a stop token (EOS, stop_token_ids, a grammar's end), whose text is
            # not output (it shows with skip_special_tokens off, which tool parsers need), as in vLLM.
            new_ids = new_ids[:-1]
        kept, hit = self._feed_text(sample, new_ids, out.finish_reason is not None)
        kept_ids = out.new_token_ids if hit is None else out.new_token_ids[:kept]
        sample.token_ids.extend(kept_ids)
        if sample.logprobs is not None and out.logprobs is not None:
            decoded = self._decode_logprobs(out.logprobs)[:len(kept_ids)]
            sample.logprobs.extend(decoded)
            sample.cumulative_logprob += sum(next(iter(d.values())).logprob for d in decoded)
        if hit is not None:
            sample.finish_reason, sample.stop_reason = "stop", hit
            tracker.unfinished -= 1
            return out.finish_reason is None
        if out.finish_reason is not None:
            sample.text += sample.stop.flush()
            sample.finish_reason = out.finish_reason
            sample.stop_reason = out.stop_reason
            sample.error = out.error
            tracker.unfinished -= 1
        return False

    @staticmethod
    def _feed_text(sample: _Sample, new_ids: list[int], last: bool) -> tuple[int, str | None]:
        """Detokenize the step's tokens into the sample's text through its stop strings: (how many of
        the tokens it keeps, the stop string hit or None). A verify step brings several tokens; one
        that completes a stop string ends the sample there, as it would have one token a step, so
        they are fed one at a time while stop strings are watched (else all at once)."""
        pieces = [new_ids] if len(new_ids) <= 1 or not sample.stop.watching else [[token] for token in new_ids]
        for i, ids in enumerate(pieces):
            delta = sample.detok.push(ids)
            if last and i == len(pieces) - 1:
                # Text held back for an unfinished character must not be lost with the last token.
                delta += sample.detok.flush()
            sample.num_fed += len(ids)
            text, hit = sample.stop.feed(delta, armed=sample.num_fed > sample.min_tokens)
            sample.text += text
            if hit is not None:
                return i + 1, hit
        return len(new_ids), None

    def _decode_logprobs(self, lists: LogprobsLists) -> list[PositionLogprobs]:
        decoded = []
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            position: PositionLogprobs = {}
            for j, (tid, lp) in enumerate(zip(ids, lps)):
                if tid in position:
                    continue
                position[tid] = Logprob(lp, rank if j == 0 else j, self._token_text(tid))
            decoded.append(position)
        return decoded

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(self, tracker: RequestTracker) -> RequestOutput | EmbeddingRequestOutput:
        if tracker.pooling is not None:
            return EmbeddingRequestOutput(
                request_id=tracker.request_id, outputs=EmbeddingOutput(tracker.embedding or []),
                prompt_token_ids=tracker.prompt_token_ids, finished=tracker.finished, prompt=tracker.prompt,
                finish_reason=tracker.samples[0].finish_reason, num_cached_tokens=tracker.metrics.num_cached_tokens,
                metrics=tracker.metrics)
        outputs = [self._sample_output(s) for s in tracker.samples]
        return RequestOutput(
            request_id=tracker.request_id, prompt=tracker.prompt, prompt_token_ids=tracker.prompt_token_ids,
            outputs=outputs, finished=tracker.finished, prompt_logprobs=tracker.prompt_logprobs,
            num_cached_tokens=tracker.metrics.num_cached_tokens, metrics=tracker.metrics,
        )

    def _sample_output(self, s: _Sample) -> CompletionOutput:
        if not self.stream_deltas:
            return CompletionOutput(s.index, s.text, list(s.token_ids), s.cumulative_logprob,
                                    s.logprobs, s.finish_reason, s.stop_reason, s.error)
        text, tokens, logprobs = s.text, s.token_ids, s.logprobs
        s.text, s.token_ids = "", []
        if logprobs is not None:
            s.logprobs = []
        return CompletionOutput(s.index, text, tokens, s.cumulative_logprob, logprobs, s.finish_reason, s.stop_reason,
                                s.error)
