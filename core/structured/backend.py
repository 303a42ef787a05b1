"""The structured-output backend contract: what the engine asks of a grammar library.

A backend compiles a request's `StructuredOutputsParams` into a grammar and makes one matcher per
request from it. The engine (`StructuredOutputManager`) compiles off its loop, advances each
matcher with the tokens the request accepts, and asks it which tokens may come next, as one bitmask
row per constrained request in xgrammar's layout: int32 words, bit `t % 32` of word `t // 32` set
when token `t` is allowed (little-endian, as every platform we run on). The worker applies the rows
to the logits (`corectl.sample.grammar`). Backends are found by name through the
`corectl_structured_output_backends` hook; xgrammar is the built-in one.
"""
from __future__ import annotations

import abc
from typing import Any

import numpy as np

from ..sampling_params import StructuredOutputsParams


def bitmask_width(vocab_size: int) -> int:
    """Int32 words in one bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class GrammarMatcher(abc.ABC):
    """One request's position in its grammar (the engine's manager is its only user)."""

    # Whether `rollback` works. Speculative decoding walks a constrained request's matcher along
    # its drafts and back; a matcher without rollback serves its request one token a step.
    supports_rollback: bool = False

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back")

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False, without moving, when the grammar does not allow it."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 `[R, bitmask_width(V)]` array."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has ended (it accepted a stop token after a complete match)."""


class StructuredOutputBackend(abc.ABC):
    """Built once per engine, in the engine process, on a compile thread the first time a request
    asks for structured output. `vocab_size` is the model's logits width (it may exceed the
    tokenizer's: padding tokens are never allowed); `stop_token_ids` end the grammar."""

    @abc.abstractmethod
    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int]):
        ...

    @classmethod
    def load_library(cls) -> None:
        """Import what `validate` needs, once a process (xgrammar: seconds, torch with it). The
        client calls it before its first check, outside the check's deadline: a library's start-up
        is not the time a grammar takes to check."""

    @classmethod
    @abc.abstractmethod
    def validate(cls, spec: StructuredOutputsParams) -> None:
        """Check the spec cheaply, without a tokenizer, in the client's process, so that bad input is
        refused before it reaches the engine; raise `InvalidRequestError` with `param` set to
        `structured_outputs.<kind>`."""

    @abc.abstractmethod
    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar (thread-safe; called on the engine's compile threads); raise
        `InvalidRequestError` as `validate` does."""

    @abc.abstractmethod
    def new_matcher(self, grammar: Any) -> GrammarMatcher:
        """A matcher at the start of a compiled grammar."""

    @abc.abstractmethod
    def grammar_bytes(self, grammar: Any) -> int:
        """The memory a compiled grammar holds (the manager's cache is bounded by the sum)."""

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        """Write `matchers[i]`'s next-token row into row `rows[i]`; the manager calls it once a step
        with all its matchers. This default fills them one after another; a backend whose library
        fills rows on several threads overrides it."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)
