"""The built-in reasoning parsers (vLLM's names)."""
from __future__ import annotations

from typing import Any

from ..harmony_output import HarmonyText
from .base import ReasoningParser, ThinkTagParser


class Qwen3ReasoningParser(ThinkTagParser):
    """Qwen3 (and QwQ): the model opens its reasoning with `<think>` itself; an output that does not
    (thinking disabled with `chat_template_kwargs: {"enable_thinking": false}`) is all content."""


class DeepSeekR1ReasoningParser(ThinkTagParser):
    """DeepSeek-R1 and its distills: the chat template opens `<think>` in the prompt, so the output is
    reasoning up to `</think>` (all of it when the output ends first)."""

    starts_thinking = True


class HarmonyReasoningParser(ReasoningParser):
    """vLLM's `openai_gptoss` parser: the harmony format's `analysis` channel is reasoning, its
    `final` channel content. A gpt-oss model's chat reads its channels this way (`HarmonyText`, calls
    included) whatever the flags; this lets launch commands that name the parser start."""

    def __init__(self, tokenizer: Any = None):
        super().__init__(tokenizer)
        self._text = HarmonyText("assistant")

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        delta = self._text.feed(text, final)
        return delta.reasoning_content or "", delta.content or ""
