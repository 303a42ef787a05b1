"""`use_beam_search` on /v1/completions and /v1/chat/completions, as vLLM serves it: `n` beams per
prompt, `length_penalty`.

The search (`corectl.beam_search.BeamSearch`) runs over the engine client: each step sends every
live beam as a one-token request for its top logprobs, all at once, and the beams of a prompt
share its KV blocks through the prefix cache. `BeamGroup` reads like a `GenerationGroup` whose
samples are each prompt's `n` best beams, best first, so the routes build their responses (chat's
reasoning and tool parsing included) as they do for sampled outputs; it does not stream.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from corectl.beam_search import BeamSearch, BeamSearchParams
from corectl.errors import InvalidRequestError
from corectl.lora.request import LoRARequest
from corectl.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from corectl.sampling_params import SamplingParams
from litestar import Response

from .errors import APIError
from .generation import ResponseGroup, until_disconnected
from .protocol import SamplingFields
from .state import ServerState

T = TypeVar("T")


def check_beam_request(data: SamplingFields, max_tokens: int) -> BeamSearchParams:
    """The search a `use_beam_search` request asks for; 400 naming what beam search cannot do."""
    for field, unsupported in (("stream", data.stream), ("echo", getattr(data, "echo", False)),
                               ("logprobs", getattr(data, "logprobs", None) not in (None, False)),
                               ("prompt_logprobs", data.prompt_logprobs is not None),
                               ("stop", bool(data.stop)), ("seed", data.seed is not None),
                               ("best_of", data.best_of not in (None, data.n))):
        if unsupported:
            raise APIError(400, f"{field} is not available with use_beam_search", field)
    if data.constraint_field is not None:
        raise APIError(400, f"{data.constraint_field} is not available with use_beam_search", data.constraint_field)
    try:
        return BeamSearchParams(beam_width=data.n, max_tokens=max_tokens, ignore_eos=data.ignore_eos,
                                temperature=data.temperature or 0.0, length_penalty=data.length_penalty)
    except InvalidRequestError as exc:
        raise APIError(400, f"use_beam_search: {exc}", "n" if exc.param == "beam_width" else exc.param) from None


class BeamGroup(ResponseGroup):
    """The beams of a request's token-id prompts. `decode` turns a beam's generated ids into its
    text (None without a tokenizer: empty text)."""

    def __init__(self, server: ServerState, prompts: list[list[int]], params: BeamSearchParams, request_id: str,
                 priority: int, lora_request: LoRARequest | None, decode: Callable[[list[int]], str] | None):
        super().__init__(server, request_id, lora_request)
        self.n = params.beam_width
        self._prompts = prompts
        self._search = BeamSearch(prompts, params, None if server.engine.tokenizer is None
                                  else server.engine.tokenizer.eos_token_id)
        self._priority = priority
        self._lora = lora_request
        self._decode = decode

    async def respond(self, receive: Callable, stream: bool, chunks: Callable[[], AsyncIterator[bytes]],
                      collect: Callable[[], Awaitable[T]]) -> Response:
        """`collect()`'s body once the search ended (`check_beam_request` refused `stream`)."""
        self.server.begin_request()
        try:
            return Response(await until_disconnected(receive, collect))
        finally:
            self.server.end_request()

    async def merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, its finished output holding its beams as samples), once the search ended."""
        step = 0
        while batch := self._search.requests():
            names = [f"{self.request_id}-s{step}-{i}" for i in range(len(batch))]
            self._search.advance(await self._step(batch, self._search.step_params, names))
            step += 1
        for index, (output, prompt) in enumerate(zip(self._search.results(None), self._prompts)):
            samples = []
            for rank, beam in enumerate(output.sequences):
                generated = beam.tokens[len(prompt):]
                text = "" if self._decode is None else self._decode(generated)
                samples.append(CompletionOutput(rank, text, generated, beam.cum_logprob,
                                                finish_reason=beam.finish_reason))
            yield index, RequestOutput(self.request_id, None, prompt, samples, finished=True)

    async def _step(self, batch: list[list[int]], params: SamplingParams, ids: list[str]) -> list[PositionLogprobs]:
        """One token for every beam at once; each beam's logprobs at that token."""
        positions: list[PositionLogprobs | None] = [None] * len(batch)

        async def one(index: int) -> None:
            async for out in self.server.engine.generate(batch[index], params, ids[index], self._priority, self._lora):
                for sample in out.outputs:
                    if sample.logprobs:
                        positions[index] = sample.logprobs[0]

        try:
            async with anyio.create_task_group() as tg:
                for index in range(len(batch)):
                    tg.start_soon(one, index)
        except BaseExceptionGroup as group:  # a refused beam (e.g. past the context) is the request's error
            raise group.exceptions[0] from None
        if any(p is None for p in positions):
            raise APIError(503, "the engine could not take this request (it is overloaded); retry later")
        return positions  # type: ignore[return-value]
