"""The built-in reasoning parsers (vLLM's names)."""
from __future__ import annotations

from .base import ThinkTagParser


class Qwen3ReasoningParser(ThinkTagParser):
    """Qwen3 (and QwQ): the model opens its reasoning with `<think>` itself; an output that does not
    (thinking disabled with `chat_template_kwargs: {"enable_thinking": false}`) is all content."""


class DeepSeekR1ReasoningParser(ThinkTagParser):
    """DeepSeek-R1 and its distills: the chat template opens `<think>` in the prompt, so the output is
    reasoning up to `</think>` (all of it when the output ends first)."""

    starts_thinking = True
