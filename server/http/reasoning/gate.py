"""A chat output's reasoning, decided by its prompt: where the parser starts, and the gate that lets
a constrained output think before its grammar applies (vLLM's structured output after reasoning).

The gate needs the parser's markers to be single tokens of the served tokenizer (core's
`corectl.structured.reasoning`); otherwise the grammar holds the output from its first token and the
parser leaves that output alone, as it must then be all content.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import msgspec
from corectl.sampling_params import SamplingParams
from corectl.structured.reasoning import marker_token, reasoning_gate

from .base import ReasoningParser

logger = logging.getLogger("corectl.server")


class ChatReasoning:
    """One chat request's reasoning: `params` carry the gate when the output is constrained, and
    `parser()` makes each choice's parser (None: the output is all content)."""

    def __init__(self, parser_cls: type[ReasoningParser] | None, tokenizer: Any, prompt: list[int],
                 params: SamplingParams):
        self._parser_cls, self._tokenizer = parser_cls, tokenizer
        self.gate = None
        if parser_cls is not None and _markers_are_tokens(parser_cls, tokenizer):
            self.gate = reasoning_gate(tokenizer, prompt, parser_cls.start, parser_cls.end, parser_cls.starts_thinking)
        spec = params.structured_outputs
        if spec is not None and self.gate is not None:
            params = params.clone(structured_outputs=msgspec.structs.replace(spec, reasoning=self.gate))
        self.params = params
        self._parsed = parser_cls is not None and (spec is None or self.gate is not None)

    def parser(self) -> ReasoningParser | None:
        if not self._parsed:
            return None
        parser = self._parser_cls(self._tokenizer)
        # The prompt decided unless the output may still open the reasoning itself.
        if self.gate is not None and (self.gate.thinking or self.gate.start is None):
            parser.begin(self.gate.thinking)
        return parser


@functools.lru_cache(maxsize=8)
def _markers_are_tokens(parser_cls: type[ReasoningParser], tokenizer: Any) -> bool:
    """Whether the parser's markers are single tokens of the tokenizer; logged once when not."""
    if parser_cls.start is not None and parser_cls.end is not None and all(
            marker_token(tokenizer, marker) is not None for marker in (parser_cls.start, parser_cls.end)):
        return True
    logger.warning("reasoning parser %s: its markers (%r, %r) are not single tokens of this tokenizer, so the "
                   "prompt does not tell where the reasoning starts, and constrained outputs (response_format, "
                   "structured_outputs, guided_*, forced tool calls) follow their grammar from the first token, "
                   "all content", parser_cls.__name__, parser_cls.start, parser_cls.end)
    return False
