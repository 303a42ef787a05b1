"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from corectl.outputs import CompletionOutput
from litestar import Controller, Request, Response, post
from litestar.openapi import ResponseSpec

from . import sse
from .auth import require_api_key
from .errors import ERROR_RESPONSES
from .generation import GenerationGroup, UsageCounter
from .logprobs import chat_logprobs, prompt_logprobs
from .protocol import ChatCompletionRequest, message_dicts
from .responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
)
from .state import ServerState

ROLE = "assistant"


class ChatController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/chat/completions", status_code=200,
          responses={200: ResponseSpec(ChatCompletionResponse, description="the completion, or SSE chunks"),
                     **ERROR_RESPONSES})
    async def create_chat_completion(self, data: ChatCompletionRequest, request: Request,
                                     server: ServerState) -> Response:
        server.check_accepting()
        server.check_model(data.model)
        server.check_priority(data.priority)
        data.check_supported()
        params = data.sampling_params()
        tokenizer = server.require_tokenizer(
            "messages", "chat messages cannot be rendered; use /v1/completions with token-id prompts")
        prompt = tokenizer.encode_chat(message_dicts(data.messages), add_generation_prompt=data.add_generation_prompt)
        group = GenerationGroup(server, [prompt], params, f"chatcmpl-{uuid.uuid4().hex}", data.priority)
        await group.start(request.receive)
        head = group.response_head()
        top_n = (data.top_logprobs or 0) if data.logprobs else None
        return await group.respond(request.receive, data.stream,
                                   lambda: _chunks(group, head, top_n, data.include_usage),
                                   lambda: _collect(group, head, top_n))


def _logprobs(sample: CompletionOutput, top_n: int | None) -> ChatLogprobs | None:
    if top_n is None:
        return None
    return ChatLogprobs(chat_logprobs(sample.logprobs or [], top_n))


async def _collect(group: GenerationGroup, head: dict, top_n: int | None) -> ChatCompletionResponse:
    usage = UsageCounter()
    choices: dict[int, ChatChoice] = {}
    last = None
    async for _, out in group.merged():
        usage.add(0, out)
        last = out
        for sample in out.outputs:
            choice = choices.get(sample.index)
            if choice is None:
                choice = choices[sample.index] = ChatChoice(
                    index=sample.index, message=ChatMessageOut(ROLE, ""),
                    logprobs=None if top_n is None else ChatLogprobs([]))
            choice.message.content += sample.text
            if choice.logprobs is not None:
                choice.logprobs.content += chat_logprobs(sample.logprobs or [], top_n)
            choice.finish_reason, choice.stop_reason = sample.finish_reason, sample.stop_reason
    return ChatCompletionResponse(**head, choices=[choices[i] for i in sorted(choices)], usage=usage.usage(),
                                  prompt_logprobs=prompt_logprobs(last.prompt_logprobs if last else None))


async def _chunks(group: GenerationGroup, head: dict, top_n: int | None, include_usage: bool) -> AsyncIterator[bytes]:
    usage = UsageCounter()
    # OpenAI's first chunk of each choice carries the role and no content.
    yield sse.frame(ChatCompletionChunk(**head, choices=[
        ChatChunkChoice(index=i, delta=ChatDelta(role=ROLE, content="")) for i in range(group.n)]))
    async for _, out in group.merged():
        usage.add(0, out)
        choices = [
            ChatChunkChoice(index=s.index, delta=ChatDelta(content=s.text) if s.text else ChatDelta(),
                            logprobs=_logprobs(s, top_n), finish_reason=s.finish_reason, stop_reason=s.stop_reason)
            for s in out.outputs
            if s.text or s.finish_reason is not None or (top_n is not None and s.logprobs)
        ]
        if choices:
            yield sse.frame(ChatCompletionChunk(**head, choices=choices))
    if include_usage:
        yield sse.frame(ChatCompletionChunk(**head, choices=[], usage=usage.usage()))
