"""The tool-parser contract: a model's generated text in, its content and tool calls out.

A parser instance follows one choice of one response. `feed(text, final)` takes each new piece of
text (the whole text at once for a non-streamed response) and returns the content that is certain
to be content and the OpenAI tool-call deltas that became known; text that may still turn out to
open a tool call is held back until it is decided. `result()` gives the calls once the text is all in.

`MarkedToolParser` covers the common case, calls written as JSON objects after a start marker
(`<tool_call>`, `[TOOL_CALLS]`, ...), up to an end marker or the end of the output. Third-party
parsers subclass `ToolParser` (or `MarkedToolParser`) and register through the
`corectl_tool_parsers` hook.
"""
from __future__ import annotations

import abc
from typing import Any

from ..responses import ToolCall, ToolCallDelta
from .json_calls import JsonCallScanner


class ToolParser(abc.ABC):
    """Built per choice as `cls(tokenizer)` (the served `corectl.tokenizer.Tokenizer`)."""

    # Whether the model writes its call markers as special tokens, which must then stay in the text.
    needs_special_tokens: bool = False

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    @abc.abstractmethod
    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """Content and tool-call deltas from the text so far plus `text`; `final`: no more text comes."""

    @abc.abstractmethod
    def result(self) -> list[ToolCall] | None:
        """The complete calls after the final feed (None: the text held no call that parses, so it
        is all content; the content returned by `feed` then misses the call text, which the caller
        keeps)."""


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a marker (it may complete later)."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


class MarkedToolParser(ToolParser):
    """Calls as JSON objects after `start_marker`, each region ending at `end_marker` (None: at the
    end of the output); whitespace between regions is dropped."""

    start_marker: str = ""
    end_marker: str | None = None
    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, tokenizer: Any = None):
        super().__init__(tokenizer)
        self.scanner = JsonCallScanner(self.argument_keys)
        self._pending = ""
        self._in_calls = False
        self.began = False  # some content was passed on (for parsers whose calls only open the output)

    def find_start(self, text: str) -> tuple[int, int] | None:
        """Where the calls start in `text` (pending content) and where their JSON starts."""
        at = text.find(self.start_marker)
        return None if at < 0 else (at, at + len(self.start_marker))

    def hold(self, text: str) -> int:
        """How much of the end of pending content to hold back: what may still become a start marker."""
        return held_back(text, (self.start_marker,))

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        content = []
        while self._pending:
            if not self._in_calls:
                done, piece = self._content_step(final)
                # Whitespace between calls is not content.
                content.append("" if self.scanner.calls and not piece.strip() else piece)
            else:
                done = self._calls_step(final)
            if done:
                break
        out = "".join(content)
        self.began = self.began or bool(out)
        return out, self.scanner.deltas()

    def _content_step(self, final: bool) -> tuple[bool, str]:
        found = self.find_start(self._pending)
        if found is not None:
            piece, self._pending = self._pending[:found[0]], self._pending[found[1]:]
            self._in_calls = True
            return False, piece
        keep = 0 if final else self.hold(self._pending)
        cut = len(self._pending) - keep
        piece, self._pending = self._pending[:cut], self._pending[cut:]
        return True, piece

    def _calls_step(self, final: bool) -> bool:
        if self.end_marker is None:
            self.scanner.feed(self._pending)
            self._pending = ""
            return True
        at = self._pending.find(self.end_marker)
        if at >= 0:
            self.scanner.feed(self._pending[:at])
            self._pending = self._pending[at + len(self.end_marker):]
            self._in_calls = False
            return False
        keep = 0 if final else held_back(self._pending, (self.end_marker,))
        cut = len(self._pending) - keep
        self.scanner.feed(self._pending[:cut])
        self._pending = self._pending[cut:]
        return True

    def result(self) -> list[ToolCall] | None:
        calls = self.scanner.complete_calls()
        return calls or None
