"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory, bounded by
count and by encoded size, least recently used first out.

Each entry is a response and the conversation it ended (chat messages without the instructions,
which OpenAI does not carry from one turn to the next), so a follow-up renders that conversation
plus its own input. A response that does not fit alone is not kept.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from .errors import APIError
from .protocol import ChatMessage
from .responses_protocol import FunctionCallItem, MessageItem, ResponseObject
from .tools import FunctionCallIn, ToolCallIn


@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]
    size: int


class ResponseStore:
    """`max_entries` 0 disables the store: requests that need it get a 400 saying so."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def put(self, response: ResponseObject, conversation: list[ChatMessage]) -> None:
        """Keep `response`, which ended `conversation` (its output not included yet)."""
        if not self.enabled:
            return
        conversation = conversation + output_messages(response)
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))
        if size > self.max_bytes:
            return
        self._drop(response.id)
        self._entries[response.id] = StoredResponse(response, conversation, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, response_id: str, param: str) -> StoredResponse:
        """The stored response, or a 400 (404 for a lookup by path) naming `param`."""
        if not self.enabled:
            raise APIError(400, "this server keeps no responses (--responses-store-max-entries 0), so "
                           f"{param} cannot be used; send the whole conversation as input", param)
        entry = self._entries.get(response_id)
        if entry is None:
            status = 404 if param == "response_id" else 400
            raise APIError(status, f"no stored response has id {response_id!r} (it was never stored, was sent with "
                           "store=false, or was evicted from this server's bounded store)", param)
        self._entries.move_to_end(response_id)
        return entry

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size


def output_messages(response: ResponseObject) -> list[ChatMessage]:
    """A response's output as the assistant's turn in the history (reasoning is not replayed)."""
    content = "".join(part.text for item in response.output if isinstance(item, MessageItem) for part in item.content)
    calls = [ToolCallIn(id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments))
             for item in response.output if isinstance(item, FunctionCallItem)]
    return [ChatMessage(role="assistant", content=content or None if calls else content, tool_calls=calls or None)]
