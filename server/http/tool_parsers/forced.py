"""The calls a grammar forced (`tool_choice` "required" or a named function; see `server/http/tools.py`),
read back from the output the grammar shaped."""
from __future__ import annotations

from ..responses import FunctionCall, FunctionDelta, ToolCall, ToolCallDelta
from ..tools import new_call_id
from .base import MarkedToolParser, ToolParser


class RequiredCallsParser(MarkedToolParser):
    """"required": the output is a JSON array of `{"name": ..., "parameters": {...}}` objects."""

    argument_keys = ("parameters",)

    def find_start(self, text: str) -> tuple[int, int] | None:
        return 0, 0


class NamedCallParser(ToolParser):
    """A named function: the output is that function's arguments object."""

    def __init__(self, name: str):
        super().__init__(None)
        self.name = name
        self.id = new_call_id()
        self.arguments = ""

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        first = not self.arguments
        self.arguments += text
        if first and self.arguments:
            return "", [ToolCallDelta(index=0, id=self.id, type="function",
                                      function=FunctionDelta(name=self.name, arguments=self.arguments))]
        return "", [ToolCallDelta(index=0, function=FunctionDelta(arguments=text))] if text else []

    def result(self) -> list[ToolCall] | None:
        """The call, also when max_tokens cut its arguments short: the grammar let the output be nothing
        else, a stream has sent it as a call already, and vLLM returns it so (finish_reason "length")."""
        if not self.arguments:
            return None
        return [ToolCall(id=self.id, function=FunctionCall(self.name, self.arguments))]
