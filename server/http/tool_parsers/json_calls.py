"""Tool calls written as JSON objects, followed character by character as their text arrives.

Models write a call as `{"name": "f", "arguments": {...}}` (some say "parameters"), alone, in a JSON
array, or several separated by commas, semicolons or whitespace. The scanner tracks JSON nesting and
strings itself (no partial-JSON parsing, no re-parsing of the text so far), so each character is
looked at once. A call's name is known when its string closes; its arguments are passed on as raw
text fragments as they arrive, which is what OpenAI's streamed `function.arguments` pieces are.
Arguments written as a JSON string holding JSON are passed on once decoded, whole.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..responses import FunctionCall, FunctionDelta, ToolCall, ToolCallDelta
from ..tools import new_call_id

_WHITESPACE = " \t\r\n"


@dataclass
class ScannedCall:
    id: str
    name: str | None = None
    arguments: str = ""  # the raw JSON text of the arguments seen so far
    string_arguments: bool = False  # the arguments are a JSON string (decoded once complete)
    arguments_done: bool = False
    closed: bool = False
    name_sent: bool = False
    arguments_sent: int = 0

    def streamable_arguments(self) -> str:
        """The argument text that may be sent so far (a call closed without arguments has `{}`)."""
        if self.closed and not self.arguments:
            return "{}"
        if not self.string_arguments:
            return self.arguments
        return self.decoded_arguments() if self.arguments_done else ""

    def decoded_arguments(self) -> str:
        if not self.arguments:
            return "{}"
        if self.string_arguments:
            try:
                return json.loads(self.arguments)
            except ValueError:
                return self.arguments
        return self.arguments


class JsonCallScanner:
    """`argument_keys` name the member holding a call's arguments."""

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments", "parameters")):
        self.argument_keys = argument_keys
        self.calls: list[ScannedCall] = []
        self._depth = 0  # containers open
        self._in_string = False
        self._escape = False
        self._call_level: int | None = None  # the depth of the open call object's members
        self._state = "key"  # at the call level: key, colon, value, in_value
        self._text = ""  # the key, name or skipped value being read
        self._key = ""
        self._pending_space = ""  # whitespace after the arguments: sent only if the value goes on

    def feed(self, text: str) -> None:
        for ch in text:
            self._step(ch)

    def _step(self, ch: str) -> None:
        structural = not self._in_string
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        if self._call_level is None:
            self._outside_call(ch, structural)
        elif structural and self._depth == self._call_level and self._state != "in_value":
            self._between_members(ch)
        else:
            self._in_member(ch, structural)

    def _outside_call(self, ch: str, structural: bool) -> None:
        if not structural:
            return
        if ch == "{":
            self._depth += 1
            self._call_level = self._depth
            self._state, self._text = "key", ""
            self.calls.append(ScannedCall(new_call_id()))
        elif ch == "[":
            self._depth += 1
        elif ch == "]":
            self._depth = max(0, self._depth - 1)

    def _between_members(self, ch: str) -> None:
        """Structural characters at the call object's level, outside a value."""
        if ch == "}":
            self._close_call()
        elif self._state == "key" and ch == '"':
            self._text = ""
            self._state = "key_string"
        elif self._state == "colon" and ch == ":":
            self._state = "value"
        elif self._state == "value" and ch not in _WHITESPACE:
            self._start_value(ch)

    def _in_member(self, ch: str, structural: bool) -> None:
        if self._state == "key_string":
            if self._in_string:
                self._text += ch
            else:
                self._key, self._state = json.loads(f'"{self._text}"'), "colon"
            return
        at_level = structural and self._depth == self._call_level
        if at_level and ch in ",}":
            self._end_value()
            if ch == "}":
                self._close_call()
            return
        if structural and ch in "{[":
            self._depth += 1
        elif structural and ch in "}]":
            self._depth -= 1
        if at_level and ch in _WHITESPACE:
            self._pending_space += ch
        else:
            self._take(self._pending_space + ch)
            self._pending_space = ""

    def _start_value(self, ch: str) -> None:
        self._state, self._text, self._pending_space = "in_value", "", ""
        call = self.calls[-1]
        if self._key in self.argument_keys:
            call.string_arguments = ch == '"'
        if ch in "{[":
            self._depth += 1
        self._take(ch)

    def _take(self, text: str) -> None:
        if self._key in self.argument_keys:
            self.calls[-1].arguments += text
        else:
            self._text += text

    def _end_value(self) -> None:
        call = self.calls[-1]
        if self._key == "name":
            try:
                name = json.loads(self._text)
            except ValueError:
                name = None
            call.name = name if isinstance(name, str) else None
        elif self._key in self.argument_keys:
            call.arguments_done = True
        self._state, self._text, self._pending_space = "key", "", ""

    def _close_call(self) -> None:
        self.calls[-1].closed = True
        self._depth -= 1
        self._call_level = None

    # -- what the client gets ----------------------------------------------------------------------

    def deltas(self) -> list[ToolCallDelta]:
        """What changed since the last call, as OpenAI's tool-call deltas (a call's name comes first;
        its arguments wait for it)."""
        out = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            arguments = call.streamable_arguments()
            new = arguments[call.arguments_sent:]
            if not call.name_sent:
                out.append(ToolCallDelta(index=index, id=call.id, type="function",
                                         function=FunctionDelta(name=call.name, arguments=new)))
                call.name_sent = True
            elif new:
                out.append(ToolCallDelta(index=index, function=FunctionDelta(arguments=new)))
            call.arguments_sent = len(arguments)
        return out

    def complete_calls(self) -> list[ToolCall] | None:
        """Every call, if each is closed, named, and has arguments that are a JSON object; else None."""
        calls = []
        for call in self.calls:
            arguments = call.decoded_arguments()
            if not call.closed or call.name is None or not _is_json_object(arguments):
                return None
            calls.append(ToolCall(id=call.id, function=FunctionCall(call.name, arguments)))
        return calls


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
