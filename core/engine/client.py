"""EngineClient: the async front door used by the server (and any asyncio application).

    async with EngineClient.in_process(EngineConfig()) as client:
        async for out in client.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.outputs[0].text, end="")

`generate` yields incremental RequestOutputs (deltas). When the consumer falls behind, the deltas
that arrived meanwhile are merged into one, so a slow reader costs one merge, not a backlog. When
the consumer stops iterating (client disconnect, cancellation), the request is aborted in the engine.
"""
from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import anyio

from ..config import EngineConfig
from ..errors import EngineDeadError, InvalidRequestError, QueueFullError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer
from .intake import check_token_ids, text_prompt_error
from .messages import SchedulerStats
from .output_processor import OutputProcessor
from .transport import EngineTransport


class _OutputCollector:
    """A one-slot mailbox per request that merges deltas the consumer has not picked up yet."""

    def __init__(self):
        self._pending: RequestOutput | BaseException | None = None
        self._ready = anyio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._pending, RequestOutput) and isinstance(item, RequestOutput):
            _merge_into(self._pending, item)
        elif not isinstance(self._pending, BaseException):
            self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready = anyio.Event()
        if isinstance(item, BaseException):
            raise item
        return item


def _merge_into(pending: RequestOutput, new: RequestOutput) -> None:
    for old, fresh in zip(pending.outputs, new.outputs):
        old.text += fresh.text
        old.token_ids = old.token_ids + fresh.token_ids
        if fresh.logprobs is not None:
            old.logprobs = (old.logprobs or []) + fresh.logprobs
        old.cumulative_logprob = fresh.cumulative_logprob
        old.finish_reason, old.stop_reason = fresh.finish_reason, fresh.stop_reason
    pending.finished = new.finished
    pending.prompt_logprobs = new.prompt_logprobs
    pending.num_cached_tokens = new.num_cached_tokens
    pending.metrics = new.metrics


class EngineClient:
    """`tokenizer` is None when the engine runs without one: prompts must then be token ids."""

    def __init__(self, transport: EngineTransport, tokenizer: Tokenizer | None, config: EngineConfig):
        self.transport = transport
        self.tokenizer = tokenizer
        self.config = config
        self.info = transport.info
        self.stats = SchedulerStats()
        # Core requests sent, and how many of them the engine had taken in when `stats` was made:
        # the difference is what the stats cannot count yet, so a burst meets the queue bound exactly.
        self._num_sent = 0
        self._num_received = 0
        self._processor = OutputProcessor(tokenizer, stream_deltas=True)
        self._collectors: dict[str, _OutputCollector] = {}
        self._dead: BaseException | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def in_process(cls, config: EngineConfig) -> AsyncIterator["EngineClient"]:
        """An engine actor in this process (tests, embedding); the server uses its own process."""
        from .actor import InProcessEngine

        async with anyio.create_task_group() as tg:
            transport = await InProcessEngine.start(config, tg)
            async with cls.serving(transport, config, tg) as client:
                yield client

    @classmethod
    @contextlib.asynccontextmanager
    async def serving(cls, transport: EngineTransport, config: EngineConfig, tg) -> AsyncIterator["EngineClient"]:
        """Run the output handler for `transport` while the block is active; closes it on exit."""
        # The engine resolved the tokenizer (a hub id or GGUF becomes a folder), so both sides use the same one.
        folder = transport.info.tokenizer_dir
        tokenizer = None if folder is None else Tokenizer.from_dir(folder, chat_template=config.chat_template)
        client = cls(transport, tokenizer, config)
        tg.start_soon(client._handle_outputs)
        try:
            yield client
        finally:
            await transport.close()

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self.transport.is_alive()

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        request_id = request_id or uuid.uuid4().hex
        text, token_ids = self._encode(prompt)
        self._validate(token_ids, params)
        collector = _OutputCollector()
        core_requests = self._processor.add_request(request_id, text, token_ids, params, priority)
        self._num_sent += len(core_requests)
        self._collectors[request_id] = collector
        finished = False
        try:
            await self.transport.add_requests(core_requests)
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                await self._abort_quietly(request_id)

    async def abort(self, request_id: str) -> None:
        await self._abort_quietly(request_id)

    async def _abort_quietly(self, request_id: str) -> None:
        ids = self._processor.abort_request(request_id)
        if ids and self.is_alive:
            with anyio.CancelScope(shield=True):
                await self.transport.abort_requests(ids)

    def _encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if not isinstance(prompt, str):
            return None, list(prompt)
        if self.tokenizer is None:
            raise text_prompt_error()
        return prompt, self.tokenizer.encode(prompt)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead!r}")
        check_token_ids(token_ids, params, self.info.vocab_size)
        limit = self.info.max_model_len
        requested = len(token_ids) + (params.max_tokens or 1)
        if len(token_ids) >= limit or requested > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; the request asks for "
                f"{len(token_ids)} prompt tokens plus {params.max_tokens or 1} completion tokens",
                param="max_tokens" if len(token_ids) < limit else "prompt", code="context_length_exceeded",
            )
        limit_q = self.config.max_queued_requests
        waiting = self.stats.num_waiting + self._num_sent - self._num_received
        if limit_q is not None and waiting >= limit_q:
            raise QueueFullError(f"{waiting} requests are already waiting (limit {limit_q})")

    async def _handle_outputs(self) -> None:
        try:
            async for batch in self.transport.outputs():
                self.stats, self._num_received = batch.stats, batch.num_requests_received
                outputs, to_abort = self._processor.process_outputs(batch.outputs)
                for out in outputs:
                    collector = self._collectors.get(out.request_id)
                    if collector is not None:
                        collector.put(out)
                if to_abort:
                    await self.transport.abort_requests(to_abort)
        except Exception as exc:
            self._dead = exc
        else:
            self._dead = EngineDeadError("engine stopped")
        for collector in self._collectors.values():
            collector.put(self._dead if isinstance(self._dead, EngineDeadError) else EngineDeadError(str(self._dead)))
