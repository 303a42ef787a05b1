"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from corectl.outputs import CompletionOutput
from msgspec import UNSET
from litestar import Controller, Request, Response, post
from litestar.openapi import ResponseSpec

from . import sse
from .auth import require_api_key
from .beam_search import BeamGroup, check_beam_request
from .chat_output import ChoiceText
from .errors import ERROR_RESPONSES, APIError
from .generation import GenerationGroup
from .harmony import harmony_prompt, uses_harmony
from .harmony_output import HarmonyText
from .logprobs import chat_logprobs, prompt_logprobs
from .protocol import ChatCompletionRequest, message_dicts
from .reasoning.gate import ChatReasoning
from .request_id import request_id_for
from .responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
)
from .state import ServerState
from .tool_parsers.base import ToolParser
from .tool_parsers.forced import NamedCallParser, RequiredCallsParser
from .tools import check_tool_choice, template_tools
from .vllm_fields import check_max_logprobs, check_ranking


class ChatController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/chat/completions", status_code=200,
          responses={200: ResponseSpec(ChatCompletionResponse, description="the completion, or SSE chunks"),
                     **ERROR_RESPONSES})
    async def create_chat_completion(self, data: ChatCompletionRequest, request: Request,
                                     server: ServerState) -> Response:
        return await chat_completion(data, request, server)


async def chat_completion(data: ChatCompletionRequest, request: Request, server: ServerState) -> Response:
    """POST /v1/chat/completions (and /invocations with messages): the completion or its SSE stream."""
    group, texts = await start_chat(data, request, server, f"chatcmpl-{request_id_for(request, data.request_id)}")
    head = group.response_head()
    asked = (_LogprobsAsked(data.top_logprobs or 0, data.tokens_as_ids(server.settings.return_tokens_as_token_ids))
             if data.logprobs else None)
    echo = data.echoed_text()
    include_usage, continuous_usage = data.stream_usage(server.settings.force_include_usage)
    return await group.respond(request.receive, data.stream,
                               lambda: _chunks(group, head, asked, include_usage, texts, echo, continuous_usage,
                                               data.return_token_ids),
                               lambda: _collect(group, head, asked, texts, echo, data.return_token_ids))


async def start_chat(data: ChatCompletionRequest, request: Request, server: ServerState,
                     request_id: str) -> tuple[GenerationGroup | BeamGroup, dict[int, ChoiceText | HarmonyText]]:
    """A chat request checked, rendered and started in the engine, with each choice's text reader
    (the Responses API runs its turns through here too)."""
    server.check_accepting()
    lora = await server.adapter_for(data.model)
    server.check_priority(data.priority)
    data.check_supported()
    # A harmony model writes its calls in its own channels: "auto" needs no tool parser.
    harmony = uses_harmony(server.engine.info.architecture, data)
    tool_choice = check_tool_choice(data.tools, data.tool_choice, server.settings.enable_auto_tool_choice or harmony)
    params = data.sampling_params(tool_choice, server.sampling_defaults)
    check_max_logprobs(params, server.settings.max_logprobs, "top_logprobs")
    if tool_choice == "auto" and not harmony and server.tool_parser.needs_special_tokens:
        # The call markers are special tokens, which the parser reads as the model wrote them.
        params = params.clone(skip_special_tokens=False, spaces_between_special_tokens=False)
    tokenizer = server.require_tokenizer(
        "messages", "chat messages cannot be rendered; use /v1/completions with token-id prompts")
    tools = template_tools(data.tools) if data.tools and tool_choice != "none" else None
    images = server.media.check(message_dicts(data.messages), server.engine.info)
    if harmony:
        prompt, params = harmony_prompt(data, tool_choice, params, tokenizer, tools)
    else:
        prompt = chat_prompt(data, tokenizer, tools, server.settings.chat_template_content_format)
    reasoning = ChatReasoning(None if harmony else server.reasoning_parser, tokenizer, prompt, params)
    forced = tool_choice in ("required", "named")
    if data.use_beam_search:
        check_ranking("use_beam_search", server.settings.engine.logprobs_mode)
        if images:
            raise APIError(400, "use_beam_search does not take images", "use_beam_search")
        group = _beam_group(data, server, prompt, params, request_id, lora, forced)
    else:
        engine_prompt = await server.media.prompt(images, prompt, server.engine.info, data.mm_processor_kwargs)
        group = GenerationGroup(server, [engine_prompt], reasoning.params, request_id, data.priority,
                                lora, "tools" if forced else data.constraint_field, data.keep_best)
        await group.start(request.receive)
    role = server.settings.response_role
    texts = {i: HarmonyText(role) if harmony else
             ChoiceText(role, reasoning.parser(), _tool_parser(data, tool_choice, server, tokenizer))
             for i in range(group.n)}
    return group, texts


def _beam_group(data: ChatCompletionRequest, server: ServerState, prompt: list[int], params, request_id: str,
                lora, forced_calls: bool) -> BeamGroup:
    """The request's beam search over its rendered prompt; by default its beams may fill the context."""
    if forced_calls:
        raise APIError(400, "a forced tool_choice constrains the output, which use_beam_search cannot", "tool_choice")
    max_tokens = params.max_tokens or server.engine.info.max_model_len - len(prompt)
    search = check_beam_request(data, max_tokens)
    tokenizer = server.engine.tokenizer
    return BeamGroup(server, [prompt], search, request_id, data.priority, lora, lambda ids: tokenizer.decode(
        ids, skip_special_tokens=params.skip_special_tokens))


def chat_prompt(data: ChatCompletionRequest, tokenizer, tools: list[dict] | None, content_format: str) -> list[int]:
    """The request's messages rendered with the template and every template field it sets."""
    return tokenizer.encode_chat(message_dicts(data.messages), add_generation_prompt=data.add_generation_prompt,
                                 tools=tools, template_kwargs=data.template_kwargs(),
                                 continue_final_message=data.continue_final_message, documents=data.documents,
                                 chat_template=data.chat_template, add_special_tokens=data.add_special_tokens,
                                 content_format=content_format)


def _tool_parser(data: ChatCompletionRequest, tool_choice: str, server: ServerState, tokenizer) -> ToolParser | None:
    if tool_choice == "auto":
        return server.tool_parser(tokenizer)
    if tool_choice == "required":
        return RequiredCallsParser(tokenizer)
    if tool_choice == "named":
        return NamedCallParser(data.tool_choice.function.name)
    return None


@dataclass(frozen=True)
class _LogprobsAsked:
    """A request's logprobs: how many alternatives a token, and whether tokens are named by id."""
    top_n: int
    as_ids: bool

    def of(self, sample: CompletionOutput) -> list:
        return chat_logprobs(sample.logprobs or [], self.top_n, self.as_ids)


def _logprobs(sample: CompletionOutput, asked: _LogprobsAsked | None) -> ChatLogprobs | None:
    return None if asked is None else ChatLogprobs(asked.of(sample))


async def _collect(group: GenerationGroup, head: dict, asked: _LogprobsAsked | None,
                   texts: dict[int, ChoiceText], echo: str, token_ids: bool) -> ChatCompletionResponse:
    usage = group.usage_counter()
    generated: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    logprobs: dict[int, ChatLogprobs | None] = {}
    ends: dict[int, tuple[str | None, int | str | None]] = {}
    last = None
    async for _, out in group.merged():
        usage.add(0, out)
        last = out
        for sample in out.outputs:
            generated.setdefault(sample.index, []).append(sample.text)
            ids.setdefault(sample.index, []).extend(sample.token_ids)
            entry = logprobs.setdefault(sample.index, None if asked is None else ChatLogprobs([]))
            if entry is not None:
                entry.content += asked.of(sample)
            ends[sample.index] = (sample.finish_reason, sample.stop_reason)
    choices = []
    for index in sorted(generated):
        text = texts[index]
        text.feed("".join(generated[index]), final=True)
        message, calls = text.message()
        if echo:
            message.content = echo + (message.content or "")
        finish_reason, stop_reason = ends[index]
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        choices.append(ChatChoice(index=index, message=message, logprobs=logprobs[index],
                                  finish_reason=finish_reason, stop_reason=stop_reason,
                                  token_ids=ids[index] if token_ids else UNSET))
    return ChatCompletionResponse(**head, choices=choices, usage=usage.usage(),
                                  prompt_logprobs=prompt_logprobs(last.prompt_logprobs if last else None),
                                  prompt_token_ids=list(last.prompt_token_ids) if token_ids and last else UNSET)


async def _chunks(group: GenerationGroup, head: dict, asked: _LogprobsAsked | None, include_usage: bool,
                  texts: dict[int, ChoiceText], echo: str, continuous_usage: bool,
                  token_ids: bool) -> AsyncIterator[bytes]:
    counts = include_usage or continuous_usage
    usage = group.usage_counter() if counts else None
    # OpenAI's first chunk of each choice carries the role and no content (the echoed text with echo).
    yield sse.frame(ChatCompletionChunk(**head, choices=[
        ChatChunkChoice(index=i, delta=ChatDelta(role=group.server.settings.response_role, content=echo))
        for i in range(group.n)], prompt_token_ids=list(group.generations[0].first.prompt_token_ids)
        if token_ids else UNSET))
    # A delta of text alone (most of a stream) is spliced into its choice's pre-encoded frame.
    plain = {i: sse.TextFrames(lambda content, i=i: ChatCompletionChunk(**head, choices=[
        ChatChunkChoice(index=i, delta=ChatDelta(content=content))])) for i in range(group.n)}
    plain_only = asked is None and not continuous_usage and not token_ids
    async for _, out in group.merged():
        if usage is not None:
            usage.add(0, out)
        choices = []
        for s in out.outputs:
            text = texts[s.index]
            delta = text.feed(s.text, final=s.finish_reason is not None)
            if s.finish_reason is None and (delta.reasoning_content is None and delta.tool_calls is None
                                            and delta.role is None):
                if delta.content is None and (asked is None or not s.logprobs) and not (token_ids and s.token_ids):
                    continue
                if plain_only:
                    yield plain[s.index].frame(delta.content)
                    continue
            choices.append(ChatChunkChoice(index=s.index, delta=delta, logprobs=_logprobs(s, asked),
                                           finish_reason=text.finish_reason(s.finish_reason),
                                           stop_reason=s.stop_reason,
                                           token_ids=list(s.token_ids) if token_ids else UNSET))
        if choices:
            yield sse.frame(ChatCompletionChunk(**head, choices=choices,
                                                usage=usage.usage() if continuous_usage else None))
    if include_usage:
        yield sse.frame(ChatCompletionChunk(**head, choices=[], usage=usage.usage()))
