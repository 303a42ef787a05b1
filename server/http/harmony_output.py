"""One chat choice of a harmony model (gpt-oss) as the client sees it: its channels split out.

After the prompt's `<|start|>assistant` the model writes messages: a header (`<|channel|>` and the
channel, maybe a recipient `to=...` and a content type), `<|message|>`, the text, and `<|end|>`
(then `<|start|>assistant` and the next header), `<|call|>` after a tool call or `<|return|>` at
the end (those two are stop tokens, so they are not in the text). As vLLM splits them:
`analysis` is reasoning (`reasoning_content` / `reasoning`), `final` and `commentary` without a
recipient are content, and a message to `functions.<name>` is a tool call whose arguments are its
text. The text must keep the special tokens (the request runs with `skip_special_tokens: false`).
An output that does not open with a header (a grammar held it from its first token) is all content,
without the harmony tokens it may hold.
Streams feed each delta as it comes, a whole response its text once: both take the same path.
"""
from __future__ import annotations

import re

from .harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START
from .responses import ChatDelta, ChatMessageOut, FunctionCall, FunctionDelta, ToolCall, ToolCallDelta
from .tool_parsers.base import held_back
from .tools import new_call_id

_ENDS = (END, CALL, RETURN)
_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_MARKERS = re.compile("|".join(re.escape(token) for token in _TOKENS))
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."


class HarmonyText:
    """The ChoiceText of a harmony model: `feed` returns each piece's delta, `message` the whole."""

    def __init__(self, role: str):
        self.role = role
        self._pending = ""
        self._in_header = True
        self._raw = False  # no header opened the output: all of it is content
        self._kind = "content"  # where the current message's text goes: reasoning, content or call
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []

    def feed(self, text: str, final: bool) -> ChatDelta:
        self._pending += text
        reasoning, content, calls = [], [], []
        while self._pending:
            if self._raw:
                # The request keeps special tokens for the parser; a client never sees harmony's (the
                # start of one at the end waits for the rest).
                keep = 0 if final else held_back(self._pending, _TOKENS)
                content.append(_MARKERS.sub("", self._pending[:len(self._pending) - keep]))
                self._pending = self._pending[len(self._pending) - keep:]
                break
            elif self._in_header:
                if not self._header(calls, final):
                    break
            elif not self._body(reasoning, content, calls, final):
                break
        if final:
            self._pending = ""  # a header cut off by max_tokens says nothing
        self._reasoning += reasoning
        self._content += content
        return ChatDelta(content="".join(content) or None, reasoning_content="".join(reasoning) or None,
                         reasoning="".join(reasoning) or None, tool_calls=calls or None)

    def _header(self, calls: list[ToolCallDelta], final: bool) -> bool:
        """Read a complete header from the pending text; False when it needs more text."""
        if not self._opens_header(self._pending, final):
            self._raw = True
            return True
        at = self._pending.find(MESSAGE)
        if at < 0:
            return False
        header, self._pending = self._pending[:at], self._pending[at + len(MESSAGE):]
        self._in_header = False
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith(_FUNCTIONS):
            self._kind = "call"
            call = ToolCall(id=new_call_id(), function=FunctionCall(recipient.group(1)[len(_FUNCTIONS):], ""))
            self._calls.append(call)
            calls.append(ToolCallDelta(index=len(self._calls) - 1, id=call.id, type="function",
                                       function=FunctionDelta(name=call.function.name, arguments="")))
        else:
            self._kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
        return True

    def _opens_header(self, text: str, final: bool) -> bool:
        """Whether `text` is (or, unless final, may still become) a header's start."""
        start = text.lstrip()
        if not start or start.startswith((CHANNEL, START)):
            return True
        return not final and any(marker.startswith(start) for marker in (CHANNEL, START))

    def _body(self, reasoning: list[str], content: list[str], calls: list[ToolCallDelta], final: bool) -> bool:
        """Pass on the current message's text up to its end marker; False when it needs more text."""
        ends = [(at, marker) for marker in _ENDS if (at := self._pending.find(marker)) >= 0]
        if ends:
            at, marker = min(ends)
            piece, self._pending = self._pending[:at], self._pending[at + len(marker):]
            self._in_header = True
        else:
            keep = 0 if final else held_back(self._pending, _ENDS)
            piece, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        if piece:
            if self._kind == "call":
                call = self._calls[-1]
                call.function.arguments += piece
                calls.append(ToolCallDelta(index=len(self._calls) - 1, function=FunctionDelta(arguments=piece)))
            else:
                (reasoning if self._kind == "reasoning" else content).append(piece)
        return bool(ends)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an output that ended by itself after calling tools."""
        return "tool_calls" if reason == "stop" and self._calls else reason

    def message(self) -> tuple[ChatMessageOut, list[ToolCall]]:
        """The whole message, after the text was fed with `final`."""
        content = "".join(self._content)
        message = ChatMessageOut(role=self.role, content=None if self._calls and not content.strip() else content,
                                 tool_calls=list(self._calls))
        message.reasoning_content = message.reasoning = "".join(self._reasoning) or None
        return message, list(self._calls)
