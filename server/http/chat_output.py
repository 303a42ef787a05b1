"""One chat choice's generated text as the client sees it: reasoning, content and tool calls.

The text goes through the reasoning parser first (when the server has one), then what is content
goes through the tool parser the request's `tool_choice` picked: the server's `--tool-call-parser`
for "auto", the reader of the forced grammar's output for "required" or a named function. Streams
feed each delta as it comes; a whole response feeds its text once, so both take the same path.
"""
from __future__ import annotations

from .reasoning.base import ReasoningParser
from .responses import ChatDelta, ChatMessageOut, ToolCall
from .tool_parsers.base import ToolParser


class ChoiceText:
    def __init__(self, role: str, reasoning: ReasoningParser | None, tools: ToolParser | None):
        self.role = role
        self.reasoning = reasoning
        self.tools = tools
        self.calls_sent = False
        self._reasoning_text: list[str] = []
        self._content_text: list[str] = []  # the content before tool parsing (the answer if no call parses)
        self._content: list[str] = []

    def feed(self, text: str, final: bool) -> ChatDelta:
        """The delta this piece of text adds (empty fields are None)."""
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning is not None else ("", text)
        self._reasoning_text.append(reasoning)
        self._content_text.append(content)
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        self._content.append(content)
        self.calls_sent = self.calls_sent or bool(calls)
        return ChatDelta(content=content or None, reasoning_content=reasoning or None, reasoning=reasoning or None,
                         tool_calls=calls or None)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an output that ended by itself after calling tools."""
        return "tool_calls" if reason == "stop" and self.calls_sent else reason

    def message(self) -> tuple[ChatMessageOut, list[ToolCall]]:
        """The whole message, after the text was fed with `final`."""
        calls = self.tools.result() if self.tools is not None else None
        content = "".join(self._content if calls else self._content_text)
        if calls and not content.strip():
            content = None  # OpenAI's null content beside calls
        message = ChatMessageOut(role=self.role, content=content, tool_calls=calls or [])
        if self.reasoning is not None:
            message.reasoning_content = message.reasoning = "".join(self._reasoning_text) or None
        return message, calls or []
