"""The engine side of one HTTP request: start its prompts, follow their outputs, record what happened.

A request is "started" once every prompt produced its first output, so validation errors (context
length, queue full, bad token ids) become HTTP errors before any response byte is sent. While a
request waits for the engine, a client that disconnects aborts it; once streaming, the response
(`sse.EventStream`) cancels its sending on disconnect and closes the group, which aborts the request
(its KV blocks are freed within one engine step).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import structlog
from corectl.errors import InvalidRequestError
from corectl.lora.request import LoRARequest
from corectl.outputs import RequestMetrics, RequestOutput
from corectl.sampling_params import SamplingParams
from litestar import Response

from . import sse
from .constraints import errors_name, named_for
from .errors import APIError, ClientDisconnected
from .responses import PromptTokensDetails, Usage
from .state import ServerState

T = TypeVar("T")
request_log = structlog.get_logger("corectl.requests")


class Generation:
    """One prompt's request in the engine, with its metrics and its log line; `index` is the prompt's
    place in its HTTP request."""

    def __init__(self, server: ServerState, index: int, prompt: str | list[int], params: SamplingParams,
                 request_id: str, priority: int, lora_request: LoRARequest | None = None,
                 grammar_field: str | None = None):
        self.server = server
        self.index = index
        self._grammar_field = grammar_field
        self.request_id = request_id
        self.prompt = prompt
        self.first: RequestOutput | None = None
        self._params = params
        self._trace_parent = None if server.tracer is None else server.tracer.parent()
        self._outputs = server.engine.generate(prompt, params, request_id, priority, lora_request)
        self._finish_reasons: list[str | None] = [None] * params.n
        self._last: RequestOutput | None = None
        # Each sample's text so far, for --enable-log-outputs (the outputs arrive as deltas).
        logged = server.settings.log_outputs and server.settings.log_requests
        self._texts: list[list[str]] | None = [[] for _ in range(params.n)] if logged else None
        self._ended = False
        self._started = False

    async def start(self) -> None:
        self._started = True
        try:
            first = await self._outputs.__anext__()
        except Exception:
            self._ended = True  # rejected before it ran (invalid, queue full): the 4xx says it all
            raise
        self.first = self._observe(first)

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, delta) for every output delta, the first included."""
        if self.first is None:
            raise RuntimeError("start() the generation first")
        index = self.index
        yield index, self.first
        if self.first.finished:
            return
        async for out in self._outputs:
            yield index, self._observe(out)

    async def aclose(self) -> None:
        await self._outputs.aclose()
        if self._started and not self._ended:
            self._record("aborted")

    def _observe(self, out: RequestOutput) -> RequestOutput:
        if self._last is None and self.server.metrics is not None:
            self.server.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        self._last = out
        for sample in out.outputs:
            if self._texts is not None:
                self._texts[sample.index].append(sample.text)
            if sample.finish_reason is not None:
                self._finish_reasons[sample.index] = sample.finish_reason
        if out.finished:
            self._record("finished")
            if "abort" in self._finish_reasons:
                raise self._abort_error(out)
        return out

    def _abort_error(self, out: RequestOutput) -> Exception:
        """An abort with a reason is the request's fault, and every such reason is about its grammar
        (it did not compile, or admits no string): a 400 naming the field; one without is an overload."""
        error = next((sample.error for sample in out.outputs if sample.error is not None), None)
        if error is None:
            return APIError(503, "the engine could not take this request (it is overloaded); retry later")
        spec = self._params.structured_outputs
        return named_for(InvalidRequestError(error, param=None if spec is None else f"structured_outputs.{spec.kind}"),
                         self._grammar_field)

    def _record(self, status: str) -> None:
        self._ended = True
        out, now = self._last, time.monotonic()
        if self.server.metrics is not None:  # per engine request that ran, as vLLM counts them
            self.server.metrics.observe_params(self._params.n, self._params.max_tokens)
        reasons = [r or "abort" for r in self._finish_reasons]
        timing = out.metrics if out is not None else None
        if self.server.tracer is not None and timing is not None:
            self.server.tracer.emit(self._trace_parent, self.request_id, self.server.model_name, self._params,
                                    timing, reasons, now)
        texts = None if self._texts is None else ["".join(parts) for parts in self._texts]
        record_request(self.server, self.request_id, status, reasons, timing, self.prompt, now, texts)


def record_request(server: ServerState, request_id: str, status: str, reasons: list[str],
                   timing: RequestMetrics | None, prompt: str | list[int], now: float,
                   outputs: list[str] | None = None) -> None:
    """The metrics and the log line of one engine request that ended (a generation or an embedding);
    `outputs`: a generation's texts, logged with --enable-log-outputs."""
    if server.metrics is not None:
        server.metrics.observe_finished(timing, reasons, now)
    fields = dict(request_id=request_id, status=status, finish_reasons=reasons)
    if server.api_server_index is not None:
        fields["api_server"] = server.api_server_index
    if timing is not None:
        fields.update(
            prompt_tokens=timing.num_prompt_tokens, generation_tokens=timing.num_generation_tokens,
            cached_tokens=timing.num_cached_tokens,
            queue_time_s=_seconds(timing.first_scheduled_time, timing.arrival_time),
            ttft_s=_seconds(timing.first_token_time, timing.arrival_time),
            total_s=_seconds(timing.finished_time or now, timing.arrival_time),
        )
    settings = server.settings
    if settings.log_prompts:
        fields["prompt"] = _clipped(prompt, settings.max_log_len)
    if settings.log_outputs and outputs is not None:
        fields["outputs"] = [_clipped(text, settings.max_log_len) for text in outputs]
    if settings.log_requests:
        request_log.info("request " + status, **fields)


def _clipped(value: str | list[int], limit: int | None) -> str | list[int]:
    """vLLM's --max-log-len: the first `limit` characters or token ids."""
    return value if limit is None else value[:limit]


def _seconds(later: float | None, earlier: float) -> float | None:
    return None if later is None else round(later - earlier, 4)


class ResponseGroup:
    """What every answer to one HTTP request carries: its id, model name and usage counting
    (a group of generations, or of beams)."""

    def __init__(self, server: ServerState, request_id: str, lora_request: LoRARequest | None):
        self.server = server
        self.request_id = request_id
        self.model_name = server.model_name if lora_request is None else lora_request.lora_name

    def response_head(self) -> dict:
        """The id, created and model fields every response and chunk of this group carries."""
        return dict(id=self.request_id, created=int(time.time()), model=self.model_name)

    def usage_counter(self) -> UsageCounter:
        """A counter of this group's token usage, with the server's `--enable-prompt-tokens-details`."""
        return UsageCounter(self.server.settings.prompt_tokens_details)


class GenerationGroup(ResponseGroup):
    """All prompts of one HTTP request (completions accept several); choice i*n+j is prompt i, sample j.
    `lora_request`: the LoRA adapter they run with (None: the base model), which the responses name.
    `grammar_field`: the request field their grammar came from, which errors about it name.
    `keep_best`: of each prompt's `params.n` samples, only this many are returned, those of highest
    cumulative logprob, best first (`best_of` > `n`); the others are seen only once all finished."""

    def __init__(self, server: ServerState, prompts: list[str | list[int]], params: SamplingParams,
                 request_id: str, priority: int, lora_request: LoRARequest | None = None,
                 grammar_field: str | None = None, keep_best: int | None = None):
        super().__init__(server, request_id, lora_request)
        self.grammar_field = grammar_field
        if lora_request is not None and server.metrics is not None:
            server.metrics.count_lora_request(lora_request.lora_name)
        self.n = params.n if keep_best is None else keep_best
        self._keep_best = keep_best
        self.generations: list[Generation] = []
        self._closed = False
        server.begin_request()
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                self.generations.append(Generation(server, i, prompt, params, rid, priority, lora_request,
                                                   grammar_field))
        except BaseException:
            server.end_request()
            raise

    async def respond(self, receive: Callable, stream: bool, chunks: Callable[[], AsyncIterator[bytes]],
                      collect: Callable[[], Awaitable[T]]) -> Response:
        """The route's answer: an SSE stream of `chunks()` ending in [DONE], or `collect()`'s body once
        every sample finished; either way the group is closed (its requests aborted) when it ends."""
        if stream:
            return sse.EventStream(chunks(), self.aclose)
        try:
            return Response(await until_disconnected(receive, collect))
        finally:
            await self.aclose()

    async def start(self, receive: Callable) -> None:
        """Submit every prompt and wait for each first output; on failure everything is aborted."""
        try:
            with errors_name(self.grammar_field):
                await until_disconnected(receive, self._start_all)
        except BaseException:
            await self.aclose()
            raise

    async def _start_all(self) -> None:
        if len(self.generations) == 1:  # most requests: no task group and task of its own
            await self.generations[0].start()
            return
        errors: list[Exception] = []

        async def start(generation: Generation) -> None:
            try:
                await generation.start()
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for generation in self.generations:
                tg.start_soon(start, generation)
        if errors:
            raise errors[0]

    def merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) pairs as they arrive, across prompts (with `keep_best`, each prompt's
        deltas once it finished, holding only its best samples)."""
        if self._keep_best is not None:
            return self._best_first()
        return self._arrivals()

    def _arrivals(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.generations) == 1:  # no generator between the engine's deltas and the stream, per token
            return self.generations[0].deltas()
        return self._interleaved()

    async def _best_first(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        held: dict[int, list[RequestOutput]] = {}
        async for index, out in self._arrivals():
            held.setdefault(index, []).append(out)
            if out.finished:
                for kept in _best_samples(held.pop(index), self._keep_best):
                    yield index, kept

    async def _interleaved(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        send, receive = anyio.create_memory_object_stream[tuple[int, RequestOutput] | Exception](math.inf)

        async def pump(generation: Generation) -> None:
            try:
                async for item in generation.deltas():
                    send.send_nowait(item)
            except Exception as exc:
                send.send_nowait(exc)

        async with anyio.create_task_group() as tg:
            for generation in self.generations:
                tg.start_soon(pump, generation)
            remaining = len(self.generations)
            while remaining:
                item = await receive.receive()
                if isinstance(item, Exception):
                    tg.cancel_scope.cancel()
                    raise item
                yield item
                if item[1].finished:
                    remaining -= 1

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.server.end_request()
        with anyio.CancelScope(shield=True):
            for generation in self.generations:
                await generation.aclose()


def _best_samples(deltas: list[RequestOutput], keep: int) -> list[RequestOutput]:
    """A finished prompt's deltas with only its `keep` samples of highest cumulative logprob (the
    last delta carries each sample's total), renumbered best first, as vLLM's `best_of` did."""
    totals = {s.index: s.cumulative_logprob or 0.0 for s in deltas[-1].outputs}
    rank = {index: new for new, index in enumerate(sorted(totals, key=totals.__getitem__, reverse=True)[:keep])}
    return [dataclasses.replace(out, outputs=sorted((dataclasses.replace(s, index=rank[s.index]) for s in out.outputs
                                                     if s.index in rank), key=lambda s: s.index))
            for out in deltas]


async def until_disconnected(receive: Callable, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work` unless the HTTP client disconnects first (then raise ClientDisconnected)."""
    outcome: list[tuple[bool, object]] = []
    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sse.cancel_on_disconnect, receive, scope)
        with scope:
            try:
                outcome.append((True, await work()))
            except Exception as exc:
                outcome.append((False, exc))
        tg.cancel_scope.cancel()
    if not outcome:
        raise ClientDisconnected()
    ok, value = outcome[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


class UsageCounter:
    """Exact token usage of a request, counted from the deltas as they pass. `prompt_tokens_details`:
    always give the cached prompt tokens (vLLM's --enable-prompt-tokens-details), else only when some were."""

    def __init__(self, prompt_tokens_details: bool = False):
        self._latest: dict[int, RequestOutput] = {}  # each prompt's latest delta: its prompt and cached tokens
        self.completion_tokens = 0
        self._details = prompt_tokens_details

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        self._latest[prompt_index] = out
        self.completion_tokens += out.num_tokens

    def usage(self) -> Usage:
        prompt = sum(len(out.prompt_token_ids) for out in self._latest.values())
        cached = sum(out.num_cached_tokens for out in self._latest.values())
        return Usage(prompt, self.completion_tokens, prompt + self.completion_tokens,
                     PromptTokensDetails(cached) if cached or self._details else None)
