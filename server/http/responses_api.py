"""POST /v1/responses and GET /v1/responses/{id}: the OpenAI Responses API, as vLLM serves it.

A turn is a chat completion (`chat.start_chat`): the same rendering, sampling, reasoning parser and
tool parsers. Its output becomes typed output items (reasoning, a message, function calls); a stream
sends them as typed events (`event: <type>` frames, each with its `sequence_number`, no `[DONE]`).
Responses are kept in the server's bounded store unless `store` is false, for `previous_response_id`.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from . import sse
from .auth import require_api_key
from .chat import start_chat
from .chat_output import ChoiceText
from .errors import ERROR_RESPONSES, to_api_error
from .generation import GenerationGroup, UsageCounter, until_disconnected
from .protocol import ChatMessage
from .responses import ChatDelta, ChatMessageOut, ToolCall
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
        store = server.responses
        history: list[ChatMessage] = []
        if data.previous_response_id is not None:
            history = store.get(data.previous_response_id, "previous_response_id").conversation
        turn = Turn(data, history)
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
    """One response being made: its object (echoing the request) and the conversation it continues."""

    def __init__(self, data: ResponsesRequest, history: list[ChatMessage]):
        self.data = data
        self.conversation = history + data.new_messages()
        self.usage = UsageCounter()
        self.finish_reason: str | None = None
        self.response = ResponseObject(
            id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), model=data.model or "", status="in_progress",
            instructions=data.instructions, max_output_tokens=data.max_output_tokens, temperature=data.temperature,
            top_p=data.top_p, tools=data.tools or [], tool_choice=data.tool_choice or ("auto" if data.tools else "none"),
            parallel_tool_calls=data.parallel_tool_calls, text=data.text, reasoning=data.reasoning,
            previous_response_id=data.previous_response_id, store=data.store, metadata=data.metadata, user=data.user)

    def finish(self, output: list[OutputItem], server: ServerState) -> ResponseObject:
        """The response completed (or cut at max_output_tokens), kept in the store unless store=false."""
        usage = self.usage.usage()
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        response = msgspec.structs.replace(
            self.response, output=output, status="completed",
            usage=ResponseUsage(input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(cached),
                                output_tokens=usage.completion_tokens, output_tokens_details=OutputTokensDetails(),
                                total_tokens=usage.total_tokens))
        if self.finish_reason == "length":
            response.status, response.incomplete_details = "incomplete", IncompleteDetails("max_output_tokens")
        if self.data.store:
            server.responses.put(response, self.conversation)
        return response


async def _collect(turn: Turn, group: GenerationGroup, text: ChoiceText, server: ServerState) -> ResponseObject:
    pieces = []
    async for _, out in group.merged():
        turn.usage.add(0, out)
        pieces.append(out.outputs[0].text)
        turn.finish_reason = out.outputs[0].finish_reason or turn.finish_reason
    text.feed("".join(pieces), final=True)
    message, calls = text.message()
    return turn.finish(output_items(message, calls, turn.response.id), server)


def output_items(message: ChatMessageOut, calls: list[ToolCall], response_id: str) -> list[OutputItem]:
    """A whole chat message as output items: its reasoning, its text, then each call."""
    suffix = response_id.removeprefix("resp_")
    items: list[OutputItem] = []
    if message.reasoning:
        items.append(ReasoningItem(id=f"rs_{suffix}", content=[ReasoningText(text=message.reasoning)]))
    if message.content:
        items.append(MessageItem(id=f"msg_{suffix}", content=[OutputText(text=message.content)]))
    items += [FunctionCallItem(id=f"fc_{call.id}", call_id=call.id, name=call.function.name,
                               arguments=call.function.arguments) for call in calls]
    return items


async def _events(turn: Turn, group: GenerationGroup, text: ChoiceText, server: ServerState) -> AsyncIterator[bytes]:
    events = EventWriter(turn.response.id)
    try:
        yield events.frame(ResponseCreated(response=turn.response))
        yield events.frame(ResponseInProgress(response=turn.response))
        async for _, out in group.merged():
            turn.usage.add(0, out)
            sample = out.outputs[0]
            turn.finish_reason = sample.finish_reason or turn.finish_reason
            for frame in events.feed(text.feed(sample.text, final=sample.finish_reason is not None)):
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
    and done when the output ends (reasoning: when the answer starts), in `sequence_number` order."""

    def __init__(self, response_id: str):
        self._suffix = response_id.removeprefix("resp_")
        self._sequence = 0
        self.items: list[OutputItem] = []
        self._texts: dict[int, list[str]] = {}
        self._open: dict[str | int, int] = {}  # "reasoning", "message" or a call's index -> output index
        self._closed: set[int] = set()

    def frame(self, event: ResponseEvent) -> bytes:
        event.sequence_number = self._sequence
        self._sequence += 1
        return b"event: " + type(event).__struct_config__.tag.encode() + b"\n" + sse.frame(event)

    def feed(self, delta: ChatDelta) -> list[bytes]:
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
        frames = []
        for key in list(self._open):
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
        event = OutputTextDelta if key == "message" else ReasoningTextDelta
        return frames + [self.frame(event(item_id=self.items[index].id, output_index=index, delta=text))]

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
        else:
            part = OutputText(text=text) if isinstance(item, MessageItem) else ReasoningText(text=text)
            item.content = [part]
            done = OutputTextDone if isinstance(item, MessageItem) else ReasoningTextDone
            frames = [self.frame(done(item_id=item.id, output_index=index, text=text)),
                      self.frame(ContentPartDone(item_id=item.id, output_index=index, part=part))]
        return frames + [self.frame(OutputItemDone(output_index=index, item=item))]


def _in_progress(item: OutputItem) -> OutputItem:
    return msgspec.structs.replace(item, status="in_progress")
