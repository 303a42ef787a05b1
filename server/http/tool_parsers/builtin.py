"""The built-in tool parsers, for the formats the common open models write (vLLM's names)."""
from __future__ import annotations

from typing import Any

from ..harmony_output import HarmonyText
from ..responses import ToolCall, ToolCallDelta
from .base import MarkedToolParser, ToolParser, held_back


class HermesToolParser(MarkedToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call: Hermes 2/3,
    Qwen2.5 and Qwen3 (their chat templates describe the tools in this format)."""

    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    needs_special_tokens = True


class MistralToolParser(MarkedToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`: Mistral 7B Instruct v0.3, Mixtral, Mistral
    Nemo and Small (`[TOOL_CALLS]` is a special token, so it is kept in the text). The newer
    `[TOOL_CALLS]name[ARGS]{...}` form (tokenizer v11+) is not read."""

    start_marker = "[TOOL_CALLS]"
    needs_special_tokens = True


class Llama3JsonToolParser(MarkedToolParser):
    """Llama 3.1/3.2/3.3's JSON calls: `{"name": ..., "parameters": {...}}` as the whole output (several
    separated by `;`), optionally after `<|python_tag|>`."""

    start_marker = "<|python_tag|>"

    def find_start(self, text: str) -> tuple[int, int] | None:
        found = super().find_start(text)
        if found is None and not self.began and text.lstrip().startswith("{"):
            at = len(text) - len(text.lstrip())
            return at, at
        return found

    def hold(self, text: str) -> int:
        # Leading whitespace may still come before a call's `{`.
        if not self.began and not text.strip():
            return len(text)
        return held_back(text, (self.start_marker,))


class HarmonyToolParser(ToolParser):
    """vLLM's `openai` parser: the calls of the harmony format (messages to `functions.<name>`), with
    the text of the `final` and plain `commentary` channels as content. A gpt-oss model's chat reads
    its channels this way (`HarmonyText`) whatever the flags; this lets launch commands that name
    the parser start, and reads harmony text that another model's template asks for."""

    needs_special_tokens = True

    def __init__(self, tokenizer: Any = None):
        super().__init__(tokenizer)
        self._text = HarmonyText("assistant")

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        delta = self._text.feed(text, final)
        return delta.content or "", list(delta.tool_calls or [])

    def result(self) -> list[ToolCall] | None:
        return self._text.message()[1] or None
