"""The reasoning-parser contract: a model's generated text in, its reasoning and its content out.

A parser instance follows one choice of one response: `feed(text, final)` takes each new piece of
text (all of it at once for a non-streamed response) and returns the reasoning and the content that
became certain; text that may still be part of a marker is held back until it is decided. Content
is what tool parsing and the client's `content` see; reasoning goes to `reasoning_content`.
"""
from __future__ import annotations

import abc
from typing import Any

from ..tool_parsers.base import held_back


class ReasoningParser(abc.ABC):
    """Built per choice as `cls(tokenizer)` (the served `corectl.tokenizer.Tokenizer`).

    A parser states its markers, the text that opens (`start`) and closes (`end`) the reasoning, and
    whether the model's chat template always opens it in the prompt (`starts_thinking`). When both
    markers are single tokens of the served tokenizer, the server reads from the prompt where the
    output starts (`begin`) and lets a constrained output think before its grammar applies; a parser
    that states no markers leaves constrained outputs alone (all content).
    """

    start: str | None = None
    end: str | None = None
    starts_thinking = False

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    def begin(self, thinking: bool) -> None:
        """Told before any text when the prompt decided where the output starts: inside the
        reasoning (`thinking`: the prompt left it open), or after it (the prompt closed it: the
        output is all content). Not called when the output may open the reasoning itself."""

    @abc.abstractmethod
    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) from the text so far plus `text`; `final`: no more text comes."""


class ThinkTagParser(ReasoningParser):
    """Reasoning between `start` and `end` tags at the beginning of the output.

    `starts_thinking` (or `begin(True)`: the prompt opened the reasoning): the output is reasoning
    until `end` (a `start` the model repeats is dropped); otherwise the output is reasoning only when
    it opens with `start`, and content from the first character otherwise.
    """

    start = "<think>"
    end = "</think>"

    def __init__(self, tokenizer: Any = None):
        super().__init__(tokenizer)
        self._pending = ""
        self._state = "opening"  # opening: a start tag may come; thinking; answering
        self._thinking = self.starts_thinking  # what an output that does not open with `start` is
        self._after_end = False  # the newlines models write after the end tag are not content

    def begin(self, thinking: bool) -> None:
        if thinking:
            self._thinking = True
        else:
            self._state = "answering"

    def _answer(self) -> str:
        content, self._pending = self._pending, ""
        if self._after_end:
            content = content.lstrip("\n")
            self._after_end = not content
        return content

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self._pending += text
        if self._state == "opening":
            self._open(final)
        if self._state == "thinking":
            return self._think(final)
        if self._state == "answering":
            return "", self._answer()
        return "", ""

    def _open(self, final: bool) -> None:
        stripped = self._pending.lstrip()
        if stripped.startswith(self.start):
            self._pending, self._state = stripped[len(self.start):], "thinking"
        elif final or not self.start.startswith(stripped):
            self._state = "thinking" if self._thinking else "answering"

    def _think(self, final: bool) -> tuple[str, str]:
        at = self._pending.find(self.end)
        if at >= 0:
            reasoning, self._pending = self._pending[:at], self._pending[at + len(self.end):]
            self._state, self._after_end = "answering", True
            return reasoning, self._answer()
        keep = 0 if final else held_back(self._pending, (self.end,))
        cut = len(self._pending) - keep
        reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        return reasoning, ""
