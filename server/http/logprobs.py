"""Logprobs in the API's shapes, from the engine's per-position dicts (chosen token first)."""
from __future__ import annotations

from corectl.outputs import PositionLogprobs

from .responses import (
    ChatLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobsList,
    TopLogprob,
)


def _text(entry) -> str:
    return entry.decoded_token or ""


def completion_logprobs(positions: list[PositionLogprobs | None], offset: int,
                        unscored: list[str] | None = None) -> tuple[CompletionLogprobs, int]:
    """OpenAI's completions logprobs for a run of tokens starting at text `offset`.

    A None position (the prompt's first token has no logprob) takes its text from `unscored`.
    Returns the logprobs and the offset after the run.
    """
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for i, position in enumerate(positions):
        if position is None:
            text = unscored[i] if unscored is not None else ""
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = next(iter(position.values()))
            text = _text(chosen)
            result.token_logprobs.append(chosen.logprob)
            result.top_logprobs.append({_text(entry): entry.logprob for entry in position.values()})
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
    return result, offset


def extend_completion_logprobs(total: CompletionLogprobs, more: CompletionLogprobs) -> None:
    total.tokens += more.tokens
    total.token_logprobs += more.token_logprobs
    total.top_logprobs += more.top_logprobs
    total.text_offset += more.text_offset


def chat_logprobs(positions: list[PositionLogprobs], top_n: int) -> list[ChatLogprob]:
    """OpenAI's chat logprobs: the chosen token, and the `top_n` most likely tokens in rank order."""
    content = []
    for position in positions:
        chosen = next(iter(position.values()))
        ranked = sorted(position.values(), key=lambda entry: entry.rank)[:top_n]
        top = [TopLogprob(_text(e), e.logprob, list(_text(e).encode("utf-8"))) for e in ranked]
        token = _text(chosen)
        content.append(ChatLogprob(token, chosen.logprob, list(token.encode("utf-8")), top))
    return content


def prompt_logprobs(positions: list[PositionLogprobs | None] | None) -> PromptLogprobsList | None:
    """vLLM's `prompt_logprobs`: per prompt position None or {token id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if p is None else {tid: PromptLogprob(e.logprob, e.rank, e.decoded_token) for tid, e in p.items()}
            for p in positions]
