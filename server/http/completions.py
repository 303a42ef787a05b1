"""POST /v1/completions: prompts in, text out, whole or streamed as server-sent events."""
from __future__ import annotations

from collections.abc import AsyncIterator

from corectl.outputs import CompletionOutput, RequestOutput
from corectl.tokenizer import Tokenizer
from litestar import Controller, Request, Response, post
from litestar.openapi import ResponseSpec

from . import sse
from .auth import require_api_key
from .beam_search import BeamGroup, check_beam_request
from .errors import ERROR_RESPONSES
from .generation import GenerationGroup
from .logprobs import completion_logprobs, extend_completion_logprobs, prompt_logprobs
from .protocol import CompletionRequest
from .request_id import request_id_for
from .responses import CompletionChoice, CompletionLogprobs, CompletionResponse
from .state import ServerState
from .vllm_fields import check_max_logprobs, check_ranking


class _Choice:
    """One choice (prompt i, sample j) of a completion: turns its output deltas into pieces."""

    def __init__(self, index: int, with_logprobs: bool, echo: str, echo_logprobs: CompletionLogprobs | None,
                 prompt_token_ids: list[int] | None, tokens_as_ids: bool = False):
        """`prompt_token_ids` is None unless the request asked for token ids (return_token_ids);
        `tokens_as_ids`: logprobs name tokens by id (return_tokens_as_token_ids)."""
        self.index = index
        self.with_logprobs = with_logprobs
        self.tokens_as_ids = tokens_as_ids
        self.with_token_ids = prompt_token_ids is not None
        self.offset = len(echo)
        self._echo = echo
        self._echo_logprobs = echo_logprobs
        self._prompt_token_ids = prompt_token_ids

    def piece(self, sample: CompletionOutput) -> CompletionChoice:
        text, logprobs = sample.text, None
        if self.with_logprobs:
            logprobs, self.offset = completion_logprobs(sample.logprobs or [], self.offset, as_ids=self.tokens_as_ids)
        if self._echo or self._echo_logprobs is not None:
            text = self._echo + text
            if self._echo_logprobs is not None and logprobs is not None:
                extend_completion_logprobs(self._echo_logprobs, logprobs)
                logprobs = self._echo_logprobs
            self._echo, self._echo_logprobs = "", None
        piece = CompletionChoice(index=self.index, text=text, logprobs=logprobs, finish_reason=sample.finish_reason,
                                 stop_reason=sample.stop_reason)
        if self.with_token_ids:
            piece.token_ids = list(sample.token_ids)
        if self._prompt_token_ids is not None:
            # Streamed, the prompt's ids come with the choice's first chunk only.
            piece.prompt_token_ids, self._prompt_token_ids = self._prompt_token_ids, None
        return piece


class _Choices:
    """Every choice of a request, created from each prompt's first output (echo needs the prompt)."""

    def __init__(self, body: CompletionRequest, tokenizer: Tokenizer | None, n: int, head: dict,
                 tokens_as_ids: bool = False, continuous_usage: bool = False):
        """`head`: the id, created and model fields of the request's chunks; `tokens_as_ids`: logprobs
        name tokens by id; `continuous_usage`: every chunk carries the usage."""
        self.body = body
        self.tokens_as_ids = tokens_as_ids
        self.tokenizer = tokenizer
        self.n = n
        self.head = head
        self.choices: dict[int, _Choice] = {}
        self._text_frames: dict[int, sse.TextFrames] = {}
        self._echo_only = body.echo_only
        # Chunks that carry more than text (logprobs, token ids, usage) are never spliced.
        self._splice = body.logprobs is None and not body.return_token_ids and not continuous_usage

    def visible(self, out: RequestOutput) -> RequestOutput:
        """`out` as the client sees it: for echo_only, without the token generated only to score the
        prompt, and ending for `length` as OpenAI's max_tokens 0 does."""
        if self._echo_only:
            for sample in out.outputs:
                sample.text, sample.token_ids, sample.logprobs = "", [], []
                if sample.finish_reason is not None:
                    sample.finish_reason, sample.stop_reason = "length", None
        return out

    def pieces(self, prompt_index: int, out: RequestOutput) -> list[CompletionChoice]:
        pieces = []
        for sample in out.outputs:
            index = prompt_index * self.n + sample.index
            choice = self.choices.get(index) or self._create(index, out)
            pieces.append(choice.piece(sample))
        return pieces

    def stream_pieces(self, prompt_index: int, out: RequestOutput) -> list[CompletionChoice]:
        """The pieces worth a chunk. New tokens count even without text when the client asked for their
        ids or when there is no tokenizer (else a tokenizer-free stream would be silent until its end)."""
        show_tokens = self.body.return_token_ids or self.tokenizer is None
        return [piece for sample, piece in zip(out.outputs, self.pieces(prompt_index, out))
                if piece.text or piece.finish_reason is not None or (show_tokens and sample.token_ids)
                or (piece.logprobs is not None and piece.logprobs.tokens)]

    def text_frame(self, prompt_index: int, out: RequestOutput) -> bytes | None:
        """The chunk of a delta that brings one choice new text and nothing else (most of a stream),
        spliced into that choice's pre-encoded frame; None when the delta needs `stream_pieces`: a
        choice's first piece (echo, prompt ids), its end, several samples, logprobs, token ids or usage."""
        if not self._splice or len(out.outputs) != 1:
            return None
        sample = out.outputs[0]
        index = prompt_index * self.n + sample.index
        if not sample.text or sample.finish_reason is not None or index not in self.choices:
            return None
        frames = self._text_frames.get(index)
        if frames is None:
            frames = self._text_frames[index] = sse.TextFrames(
                lambda text: CompletionResponse(**self.head, choices=[CompletionChoice(index=index, text=text)]))
        return frames.frame(sample.text)

    def _create(self, index: int, out: RequestOutput) -> _Choice:
        echo, echo_logprobs = "", None
        if self.body.echo:
            ids = out.prompt_token_ids
            echo = out.prompt if out.prompt is not None else self.tokenizer.decode(ids, skip_special_tokens=False)
            if self.body.logprobs is not None and out.prompt_logprobs is not None:
                unscored = [self.tokenizer.decode([t], skip_special_tokens=False) if p is None else ""
                            for t, p in zip(ids, out.prompt_logprobs)]
                echo_logprobs, _ = completion_logprobs(out.prompt_logprobs, 0, unscored, as_ids=self.tokens_as_ids)
        prompt_ids = list(out.prompt_token_ids) if self.body.return_token_ids else None
        choice = _Choice(index, self.body.logprobs is not None, echo, echo_logprobs, prompt_ids, self.tokens_as_ids)
        self.choices[index] = choice
        return choice


def _check_text_fields(data: CompletionRequest, server: ServerState) -> None:
    """The fields that need the tokenizer here (the engine itself refuses text prompts and stop strings
    when it has none)."""
    if data.echo:
        server.require_tokenizer("echo", "the prompt cannot be echoed as text; "
                                 "return_token_ids returns its token ids instead")
    if data.logprobs is not None:
        server.require_tokenizer("logprobs", "logprobs cannot name their tokens as text; "
                                 "prompt_logprobs (keyed by token id) still works")


def _prompts(data: CompletionRequest, server: ServerState) -> list[str | list[int]]:
    """The request's prompts; text ones tokenized here without the tokenizer's special tokens when
    the request turns them off (vLLM's add_special_tokens)."""
    prompts = data.prompts()
    if data.add_special_tokens:
        return prompts
    tokenizer = server.require_tokenizer("add_special_tokens", "text prompts cannot be tokenized")
    return [tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p for p in prompts]


def _beam_group(data: CompletionRequest, server: ServerState, request_id: str, lora, max_tokens: int) -> BeamGroup:
    """The request's beam search, over its prompts as token ids."""
    params = check_beam_request(data, max_tokens)
    tokenizer = server.engine.tokenizer
    prompts = [server.require_tokenizer("prompt", "prompts must be token ids").encode(
        p, add_special_tokens=data.add_special_tokens) if isinstance(p, str) else p for p in data.prompts()]
    decode = None if tokenizer is None else (
        lambda ids: tokenizer.decode(ids, skip_special_tokens=data.skip_special_tokens))
    return BeamGroup(server, prompts, params, request_id, data.priority, lora, decode)


class CompletionsController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/completions", status_code=200, responses={
        200: ResponseSpec(CompletionResponse, description="the completion, or SSE chunks"), **ERROR_RESPONSES})
    async def create_completion(self, data: CompletionRequest, request: Request, server: ServerState) -> Response:
        return await completion(data, request, server)


async def completion(data: CompletionRequest, request: Request, server: ServerState) -> Response:
    """POST /v1/completions (and /invocations with a prompt): the completion or its SSE stream."""
    server.check_accepting()
    lora = await server.adapter_for(data.model)
    server.check_priority(data.priority)
    data.check_supported()
    _check_text_fields(data, server)
    params = data.sampling_params(server.sampling_defaults)
    check_max_logprobs(params, server.settings.max_logprobs, "logprobs")
    request_id = f"cmpl-{request_id_for(request, data.request_id)}"
    if data.use_beam_search or data.keep_best is not None:
        check_ranking("use_beam_search" if data.use_beam_search else "best_of", server.settings.engine.logprobs_mode)
    if data.use_beam_search:
        group = _beam_group(data, server, request_id, lora, params.max_tokens or 16)
    else:
        group = GenerationGroup(server, _prompts(data, server), params, request_id, data.priority, lora,
                                data.constraint_field, data.keep_best)
        await group.start(request.receive)
    head = group.response_head()
    include_usage, continuous_usage = data.stream_usage(server.settings.force_include_usage)
    choices = _Choices(data, server.engine.tokenizer, group.n, head,
                       data.tokens_as_ids(server.settings.return_tokens_as_token_ids), continuous_usage)
    return await group.respond(request.receive, data.stream,
                               lambda: _chunks(group, choices, head, include_usage, continuous_usage),
                               lambda: _collect(group, choices, head))


async def _collect(group: GenerationGroup, choices: _Choices, head: dict) -> CompletionResponse:
    usage = group.usage_counter()
    merged: dict[int, CompletionChoice] = {}
    async for prompt_index, out in group.merged():
        out = choices.visible(out)
        usage.add(prompt_index, out)
        for piece in choices.pieces(prompt_index, out):
            total = merged.setdefault(piece.index, piece)
            if total is not piece:
                total.text += piece.text
                if piece.token_ids:
                    total.token_ids += piece.token_ids
                if piece.logprobs is not None:
                    extend_completion_logprobs(total.logprobs, piece.logprobs)
                total.finish_reason, total.stop_reason = piece.finish_reason, piece.stop_reason
        if choices.body.prompt_logprobs is not None and out.prompt_logprobs is not None and out.finished:
            for j in range(group.n):
                merged[prompt_index * group.n + j].prompt_logprobs = prompt_logprobs(out.prompt_logprobs)
    ordered = [merged[i] for i in sorted(merged)]
    return CompletionResponse(**head, choices=ordered, usage=usage.usage())


async def _chunks(group: GenerationGroup, choices: _Choices, head: dict, include_usage: bool,
                  continuous_usage: bool) -> AsyncIterator[bytes]:
    counts = include_usage or continuous_usage
    usage = group.usage_counter() if counts else None
    async for prompt_index, out in group.merged():
        out = choices.visible(out)
        if usage is not None:
            usage.add(prompt_index, out)
        text_frame = choices.text_frame(prompt_index, out)
        if text_frame is not None:
            yield text_frame
            continue
        pieces = choices.stream_pieces(prompt_index, out)
        if pieces:
            yield sse.frame(CompletionResponse(**head, choices=pieces, usage=usage.usage() if continuous_usage else None))
    if include_usage:
        yield sse.frame(CompletionResponse(**head, choices=[], usage=usage.usage()))
