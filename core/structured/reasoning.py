"""Structured output after reasoning: where a request stands relative to its `ReasoningGate`.

A reasoning model under a grammar thinks first, freely, and the grammar holds only the answer
(vLLM's behaviour). The gate's markers are single token ids: a model's free text could spell a
marker of several tokens in many token sequences, so only a single token is a reliable signal (the
markers of reasoning models, `<think>` and `</think>`, are added tokens of their tokenizers).
`reasoning_gate` decides the start from the prompt; `GatePhase` follows one request's tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..sampling_params import ReasoningGate

# Whitespace after a marker is a token or two (Qwen3's "\n\n"); a longer tail is more conversation.
_MAX_WHITESPACE_TAIL = 4


def marker_token(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when it is exactly one token of `tokenizer` (a `corectl.tokenizer.Tokenizer`)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def reasoning_gate(tokenizer: Any, prompt_token_ids: Sequence[int], start: str = "<think>", end: str = "</think>",
                   starts_thinking: bool = False) -> ReasoningGate | None:
    """The gate for an output that follows `prompt_token_ids`; None when a marker is not one token
    (the grammar then holds the output from its first token, as without a gate).

    The prompt decides how the output starts: a prompt whose last `start` is not closed (a template
    that opens the reasoning) starts thinking; one that ends with `end`, give or take whitespace (an
    empty think block: Qwen3's `enable_thinking: false`), answers at once; otherwise the output
    starts thinking when `starts_thinking` (the model's template always opens the reasoning), and may
    open it with `start` when not.
    """
    start_id, end_id = marker_token(tokenizer, start), marker_token(tokenizer, end)
    if start_id is None or end_id is None:
        return None
    last_start, last_end = _last_index(prompt_token_ids, start_id), _last_index(prompt_token_ids, end_id)
    if last_start > last_end:
        return ReasoningGate(start=start_id, end=end_id, thinking=True)
    tail = prompt_token_ids[last_end + 1:]
    closed = last_end >= 0 and len(tail) <= _MAX_WHITESPACE_TAIL
    if closed and not tokenizer.decode(tail, skip_special_tokens=False).strip():
        return ReasoningGate(end=end_id)
    return ReasoningGate(start=start_id, end=end_id, thinking=starts_thinking)


def _last_index(token_ids: Sequence[int], token: int) -> int:
    # list.index on the reversed copy runs in C: prompts may be long, and every chat request asks.
    try:
        return len(token_ids) - 1 - list(reversed(token_ids)).index(token)
    except ValueError:
        return -1


class GatePhase:
    """One request's phase: "opening" (its first token may open the reasoning), "thinking" (free
    tokens until the end marker) or "answering" (the grammar holds). It only moves forward, with the
    tokens the request accepts, so preemption (which keeps the tokens) never sends it back."""

    def __init__(self, gate: ReasoningGate):
        self.gate = gate
        if gate.thinking:
            self.phase = "thinking"
        else:
            self.phase = "opening" if gate.start is not None else "answering"

    @property
    def thinking(self) -> bool:
        return self.phase == "thinking"

    def advance(self, token_id: int) -> bool:
        """Follow one accepted token; True when it is the grammar's to match."""
        if self.phase == "thinking":
            if token_id == self.gate.end:
                self.phase = "answering"
            return False
        if self.phase == "opening":
            self.phase = "thinking" if token_id == self.gate.start else "answering"
            return self.phase == "answering"
        return True
