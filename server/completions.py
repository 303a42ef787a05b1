"""POST /v1/completions: prompts in, text out, whole or streamed as server-sent events."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from litestar import Controller, Request, Response, post
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from corectl.outputs import CompletionOutput, RequestOutput
from corectl.tokenizer import Tokenizer

from . import sse
from .auth import require_api_key
from .errors import ERROR_RESPONSES
from .generation import GenerationGroup, UsageCounter, until_disconnected
from .logprobs import completion_logprobs, extend_completion_logprobs, prompt_logprobs
from .protocol import CompletionRequest
from .responses import CompletionChoice, CompletionLogprobs, CompletionResponse
from .state import ServerState


class _Choice:
    """One choice (prompt i, sample j) of a completion: turns its output deltas into pieces."""

    def __init__(self, index: int, with_logprobs: bool, echo: str, echo_logprobs: CompletionLogprobs | None):
        self.index = index
        self.with_logprobs = with_logprobs
        self.offset = len(echo)
        self._echo = echo
        self._echo_logprobs = echo_logprobs

    def piece(self, sample: CompletionOutput) -> CompletionChoice:
        text, logprobs = sample.text, None
        if self.with_logprobs:
            logprobs, self.offset = completion_logprobs(sample.logprobs or [], self.offset)
        if self._echo or self._echo_logprobs is not None:
            text = self._echo + text
            if self._echo_logprobs is not None and logprobs is not None:
                extend_completion_logprobs(self._echo_logprobs, logprobs)
                logprobs = self._echo_logprobs
            self._echo, self._echo_logprobs = "", None
        return CompletionChoice(index=self.index, text=text, logprobs=logprobs, finish_reason=sample.finish_reason,
                                stop_reason=sample.stop_reason)


class _Choices:
    """Every choice of a request, created from each prompt's first output (echo needs the prompt)."""

    def __init__(self, body: CompletionRequest, tokenizer: Tokenizer, n: int):
        self.body = body
        self.tokenizer = tokenizer
        self.n = n
        self.choices: dict[int, _Choice] = {}

    def pieces(self, prompt_index: int, out: RequestOutput) -> list[CompletionChoice]:
        pieces = []
        for sample in out.outputs:
            index = prompt_index * self.n + sample.index
            choice = self.choices.get(index) or self._create(index, out)
            pieces.append(choice.piece(sample))
        return pieces

    def _create(self, index: int, out: RequestOutput) -> _Choice:
        echo, echo_logprobs = "", None
        if self.body.echo:
            ids = out.prompt_token_ids
            echo = out.prompt if out.prompt is not None else self.tokenizer.decode(ids, skip_special_tokens=False)
            if self.body.logprobs is not None and out.prompt_logprobs is not None:
                unscored = [self.tokenizer.decode([t], skip_special_tokens=False) if p is None else ""
                            for t, p in zip(ids, out.prompt_logprobs)]
                echo_logprobs, _ = completion_logprobs(out.prompt_logprobs, 0, unscored)
        choice = _Choice(index, self.body.logprobs is not None, echo, echo_logprobs)
        self.choices[index] = choice
        return choice


class CompletionsController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/completions", status_code=200, responses={
        200: ResponseSpec(CompletionResponse, description="the completion, or SSE chunks"), **ERROR_RESPONSES})
    async def create_completion(self, data: CompletionRequest, request: Request, server: ServerState) -> Response:
        server.check_accepting()
        server.check_model(data.model)
        server.check_priority(data.priority)
        data.check_supported()
        params = data.sampling_params()
        group = GenerationGroup(server, data.prompts(), params, f"cmpl-{uuid.uuid4().hex}", data.priority)
        await group.start(request.receive)
        head = dict(id=group.request_id, created=int(time.time()), model=server.model_name)
        choices = _Choices(data, server.engine.tokenizer, params.n)
        if data.stream:
            return Stream(sse.with_done(_chunks(group, choices, head, data.include_usage), group.aclose),
                          media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        try:
            return Response(await until_disconnected(request.receive, lambda: _collect(group, choices, head)))
        finally:
            await group.aclose()


async def _collect(group: GenerationGroup, choices: _Choices, head: dict) -> CompletionResponse:
    usage = UsageCounter()
    merged: dict[int, CompletionChoice] = {}
    async for prompt_index, out in group.merged():
        usage.add(prompt_index, out)
        for piece in choices.pieces(prompt_index, out):
            total = merged.setdefault(piece.index, piece)
            if total is not piece:
                total.text += piece.text
                if piece.logprobs is not None:
                    extend_completion_logprobs(total.logprobs, piece.logprobs)
                total.finish_reason, total.stop_reason = piece.finish_reason, piece.stop_reason
        if choices.body.prompt_logprobs is not None and out.prompt_logprobs is not None and out.finished:
            for j in range(group.n):
                merged[prompt_index * group.n + j].prompt_logprobs = prompt_logprobs(out.prompt_logprobs)
    ordered = [merged[i] for i in sorted(merged)]
    return CompletionResponse(**head, choices=ordered, usage=usage.usage())


async def _chunks(group: GenerationGroup, choices: _Choices, head: dict, include_usage: bool) -> AsyncIterator[bytes]:
    usage = UsageCounter()
    async for prompt_index, out in group.merged():
        usage.add(prompt_index, out)
        pieces = [p for p in choices.pieces(prompt_index, out)
                  if p.text or p.finish_reason is not None or (p.logprobs is not None and p.logprobs.tokens)]
        if pieces:
            yield sse.frame(CompletionResponse(**head, choices=pieces))
    if include_usage:
        yield sse.frame(CompletionResponse(**head, choices=[], usage=usage.usage()))
