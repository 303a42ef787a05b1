"""POST /v1/responses and GET /v1/responses/{id}: the OpenAI Responses API, as vLLM serves it.

A turn is a chat completion (`chat.start_chat`): the same rendering, sampling, reasoning parser and
tool parsers. Its output becomes typed output items (reasoning, a message, function calls); a stream
sends them as typed events (`event: <type>` frames, each with its `sequence_number`, no `[DONE]`).
Responses are kept in the server's bounded store unless `store` is false, for `previous_response_id`.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from corectl.outputs import CompletionOutput, RequestOutput
from litestar import Controller, Request, Response, get, post
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from . import sse
from .auth import require_api_key
from .chat import start_chat
from .chat_output import ChoiceText
from .errors import ERROR_RESPONSES, to_api_error
from .generation import GenerationGroup, UsageCounter, until_disconnected
from .logprobs import chat_logprobs
from .protocol import ChatMessage
from .request_id import request_id_for
from .responses import ChatDelta, ChatLogprob, ChatMessageOut, ToolCall
from .responses_protocol import (
    ArgumentsDelta,
    ArgumentsDone,
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseEvent,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from .state import ServerState


class ResponsesController(Controller):
    path = "/v1/responses"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("", status_code=200, responses={200: ResponseSpec(ResponseObject, description="the response, or SSE "
                                                             "events"), **ERROR_RESPONSES})
    async def create_response(self, data: ResponsesRequest, request: Request, server: ServerState) -> Response:
        data.check_supported()
        history: list[ChatMessage] = []
        if data.previous_response_id is not None:
            history = server.responses.get(data.previous_response_id, "previous_response_id").conversation
        turn = Turn(data, history, f"resp_{request_id_for(request, data.request_id)}",
                    server.settings.return_tokens_as_token_ids)
        group, texts = await start_chat(data.chat_request(history), request, server, turn.response.id)
        turn.response.model = group.model_name
        if data.stream:
            return Stream(_events(turn, group, texts[0], server), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        try:
            return Response(await until_disconnected(request.receive, lambda: _collect(turn, group, texts[0], server)))
        finally:
            await group.aclose()

    @get("/{response_id:str}", responses={200: ResponseSpec(ResponseObject, description="a stored response"),
                                          **ERROR_RESPONSES})
    async def retrieve_response(self, response_id: str, server: ServerState) -> ResponseObject:
        return server.responses.get(response_id, "response_id").response


class Turn:
    """One response being made: its object (echoing the request), the conversation it continues and,
    with include message.output_text.logprobs, its tokens' logprobs."""

    def __init__(self, data: ResponsesRequest, history: list[ChatMessage], response_id: str, as_ids: bool):
        self.data = data
        self.conversation = history + data.new_messages()
        self.usage = UsageCounter()
        self.finish_reason: str | None = None
        self._as_ids = as_ids
        self.logprobs: list[ChatLogprob] = []
        self.response = ResponseObject(
            id=response_id, created_at=int(time.time()), model=data.model or "", status="in_progress",
            instructions=data.instructions, max_output_tokens=data.max_output_tokens, temperature=data.temperature,
            top_p=data.top_p, tools=data.tools or [], tool_choice=data.tool_choice or ("auto" if data.tools else "none"),
            parallel_tool_calls=data.parallel_tool_calls, text=data.text, reasoning=data.reasoning,
            previous_response_id=data.previous_response_id, store=data.store, metadata=data.metadata, user=data.user,
            max_tool_calls=data.max_tool_calls, prompt_cache_key=data.prompt_cache_key,
            prompt_cache_retention=data.prompt_cache_retention, safety_identifier=data.safety_identifier,
            top_logprobs=data.top_logprobs)

    def add(self, out: RequestOutput) -> tuple[CompletionOutput, list[ChatLogprob]]:
        """Count an engine delta; its sample and that sample's new logprobs (none unless asked)."""
        self.usage.add(0, out)
        sample = out.outputs[0]
        self.finish_reason = sample.finish_reason or self.finish_reason
        if not self.data.output_logprobs:
            return sample, []
        logprobs = chat_logprobs(sample.logprobs or [], self.data.top_logprobs, self._as_ids)
        self.logprobs += logprobs
        return sample, logprobs

    @property
    def cut(self) -> bool:
        """Whether max_output_tokens ended the output (the items it was writing are incomplete)."""
        return self.finish_reason == "length"

    def finish(self, output: list[OutputItem], server: ServerState) -> ResponseObject:
        """The response completed (or cut at max_output_tokens), kept in the store unless store=false."""
        usage = self.usage.usage()
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        response = msgspec.structs.replace(
            self.response, output=output, status="completed",
            usage=ResponseUsage(input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(cached),
                                output_tokens=usage.completion_tokens, output_tokens_details=OutputTokensDetails(),
                                total_tokens=usage.total_tokens))
        if self.cut:
            response.status, response.incomplete_details = "incomplete", IncompleteDetails("max_output_tokens")
        if self.data.store:
            server.responses.put(response, self.conversation)
        return response


async def _collect(turn: Turn, group: GenerationGroup, text: ChoiceText, server: ServerState) -> ResponseObject:
    pieces = []
    async for _, out in group.merged():
        sample, _ = turn.add(out)
        pieces.append(sample.text)
    text.feed("".join(pieces), final=True)
    message, calls = text.message()
    return turn.finish(output_items(message, calls, turn), server)


def output_items(message: ChatMessageOut, calls: list[ToolCall], turn: Turn) -> list[OutputItem]:
    """A whole chat message as output items: its reasoning, its text, then each call. Cut at
    max_output_tokens, the message is incomplete, and so is reasoning that nothing followed."""
    suffix = turn.response.id.removeprefix("resp_")
    items: list[OutputItem] = []
    if message.reasoning:
        items.append(ReasoningItem(id=f"rs_{suffix}", content=[ReasoningText(text=message.reasoning)]))
    if message.content:
        items.append(MessageItem(id=f"msg_{suffix}", content=[OutputText(text=message.content,
                                                                          logprobs=turn.logprobs)]))
    items += [FunctionCallItem(id=f"fc_{call.id}", call_id=call.id, name=call.function.name,
                               arguments=call.function.arguments) for call in calls]
    if turn.cut:
        for item in items:
            if isinstance(item, MessageItem) or (isinstance(item, ReasoningItem) and len(items) == 1):
                item.status = "incomplete"
    return items


async def _events(turn: Turn, group: GenerationGroup, text: ChoiceText, server: ServerState) -> AsyncIterator[bytes]:
    events = EventWriter(turn)
    try:
        yield events.frame(ResponseCreated(response=turn.response))
        yield events.frame(ResponseInProgress(response=turn.response))
        async for _, out in group.merged():
            sample, logprobs = turn.add(out)
            delta = text.feed(sample.text, final=sample.finish_reason is not None)
            for frame in events.feed(delta, logprobs):
                yield frame
        for frame in events.close_all():
            yield frame
        response = turn.finish(events.items, server)
        done = ResponseIncomplete if response.status == "incomplete" else ResponseCompleted
        yield events.frame(done(response=response))
    except Exception as exc:
        err = to_api_error(exc)
        yield events.frame(ErrorEvent(code=err.code, message=err.message, param=err.param))
    finally:
        await group.aclose()


class EventWriter:
    """Chat deltas as Responses stream events: each output item is added when its first text comes
    and done when the output ends (reasoning: when the answer starts), in `sequence_number` order.
    A text delta carries the logprobs of the tokens since the last one; the done events, all."""

    def __init__(self, turn: Turn):
        self._turn = turn
        self._suffix = turn.response.id.removeprefix("resp_")
        self._sequence = 0
        self._pending_logprobs: list[ChatLogprob] = []
        self.items: list[OutputItem] = []
        self._texts: dict[int, list[str]] = {}
        self._open: dict[str | int, int] = {}  # "reasoning", "message" or a call's index -> output index
        self._closed: set[int] = set()

    def frame(self, event: ResponseEvent) -> bytes:
        event.sequence_number = self._sequence
        self._sequence += 1
        return b"event: " + type(event).__struct_config__.tag.encode() + b"\n" + sse.frame(event)

    def feed(self, delta: ChatDelta, logprobs: list[ChatLogprob]) -> list[bytes]:
        self._pending_logprobs += logprobs
        frames = []
        if delta.reasoning_content:
            frames += self._text_delta("reasoning", delta.reasoning_content)
        if delta.content:
            frames += self._close("reasoning")
            frames += self._text_delta("message", delta.content)
        for call in delta.tool_calls or []:
            frames += self._close("reasoning")
            frames += self._call_delta(call.index, call.id, call.function.name, call.function.arguments or "")
        return frames

    def close_all(self) -> list[bytes]:
        """The end of the output: every open item done (a message or reasoning cut at
        max_output_tokens as incomplete)."""
        frames = []
        for key, index in list(self._open.items()):
            item = self.items[index]
            if self._turn.cut and index not in self._closed and not isinstance(item, FunctionCallItem):
                item.status = "incomplete"
            frames += self._close(key)
        return frames

    def _open_item(self, key: str | int, item: OutputItem) -> tuple[int, list[bytes]]:
        index = self._open.get(key)
        if index is not None:
            return index, []
        index = self._open[key] = len(self.items)
        self.items.append(item)
        self._texts[index] = []
        frames = [self.frame(OutputItemAdded(output_index=index, item=_in_progress(item)))]
        if isinstance(item, (MessageItem, ReasoningItem)):
            part = OutputText(text="") if isinstance(item, MessageItem) else ReasoningText(text="")
            frames.append(self.frame(ContentPartAdded(item_id=item.id, output_index=index, part=part)))
        return index, frames

    def _text_delta(self, key: str, text: str) -> list[bytes]:
        item = (MessageItem(id=f"msg_{self._suffix}") if key == "message"
                else ReasoningItem(id=f"rs_{self._suffix}"))
        index, frames = self._open_item(key, item)
        if index in self._closed:
            return frames  # reasoning after the answer began: not a separate item
        self._texts[index].append(text)
        item_id = self.items[index].id
        if key == "message":
            event = OutputTextDelta(item_id=item_id, output_index=index, delta=text, logprobs=self._pending_logprobs)
            self._pending_logprobs = []
        else:
            event = ReasoningTextDelta(item_id=item_id, output_index=index, delta=text)
        return frames + [self.frame(event)]

    def _call_delta(self, key: int, call_id: str | None, name: str | None, arguments: str) -> list[bytes]:
        index, frames = self._open_item(key, FunctionCallItem(id=f"fc_{call_id}", call_id=call_id or "",
                                                              name=name or "", arguments=""))
        if arguments:
            self._texts[index].append(arguments)
            frames.append(self.frame(ArgumentsDelta(item_id=self.items[index].id, output_index=index,
                                                    delta=arguments)))
        return frames

    def _close(self, key: str | int) -> list[bytes]:
        index = self._open.get(key)
        if index is None or index in self._closed:
            return []
        self._closed.add(index)
        item, text = self.items[index], "".join(self._texts[index])
        if isinstance(item, FunctionCallItem):
            item.arguments = text
            frames = [self.frame(ArgumentsDone(item_id=item.id, output_index=index, name=item.name, arguments=text))]
        elif isinstance(item, MessageItem):
            part = OutputText(text=text, logprobs=self._turn.logprobs)
            item.content = [part]
            frames = [self.frame(OutputTextDone(item_id=item.id, output_index=index, text=text,
                                                logprobs=self._turn.logprobs)),
                      self.frame(ContentPartDone(item_id=item.id, output_index=index, part=part))]
        else:
            item.content = [ReasoningText(text=text)]
            frames = [self.frame(ReasoningTextDone(item_id=item.id, output_index=index, text=text)),
                      self.frame(ContentPartDone(item_id=item.id, output_index=index, part=item.content[0]))]
        return frames + [self.frame(OutputItemDone(output_index=index, item=item))]


def _in_progress(item: OutputItem) -> OutputItem:
    return msgspec.structs.replace(item, status="in_progress")
