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


# JSON has no -inf, which a token masked out has under --logprobs-mode processed_*: vLLM's floor.
LOGPROB_FLOOR = -9999.0


def _value(entry) -> float:
    return max(entry.logprob, LOGPROB_FLOOR)


def _text(entry) -> str:
    return entry.decoded_token or ""


def _name(token_id: int, entry, as_ids: bool) -> str:
    """How a logprob names its token: its text, or vLLM's "token_id:<id>" (return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_ids else _text(entry)


def completion_logprobs(positions: list[PositionLogprobs | None], offset: int,
                        unscored: list[str] | None = None, as_ids: bool = False) -> tuple[CompletionLogprobs, int]:
    """OpenAI's completions logprobs for a run of tokens starting at text `offset`.

    A None position (the prompt's first token has no logprob) takes its text from `unscored`.
    With `as_ids` the tokens are named by id; the offsets still count the text. Returns the
    logprobs and the offset after the run.
    """
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for i, position in enumerate(positions):
        if position is None:
            text = name = unscored[i] if unscored is not None else ""
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen_id, chosen = next(iter(position.items()))
            text, name = _text(chosen), _name(chosen_id, chosen, as_ids)
            result.token_logprobs.append(_value(chosen))
            result.top_logprobs.append({_name(tid, entry, as_ids): _value(entry) for tid, entry in position.items()})
        result.tokens.append(name)
        result.text_offset.append(offset)
        offset += len(text)
    return result, offset


def extend_completion_logprobs(total: CompletionLogprobs, more: CompletionLogprobs) -> None:
    total.tokens += more.tokens
    total.token_logprobs += more.token_logprobs
    total.top_logprobs += more.top_logprobs
    total.text_offset += more.text_offset


def chat_logprobs(positions: list[PositionLogprobs], top_n: int, as_ids: bool = False) -> list[ChatLogprob]:
    """OpenAI's chat logprobs: the chosen token, and the `top_n` most likely tokens in rank order;
    with `as_ids` each token named by id."""
    content = []
    for position in positions:
        chosen_id, chosen = next(iter(position.items()))
        ranked = sorted(position.items(), key=lambda item: item[1].rank)[:top_n]
        names = [_name(tid, e, as_ids) for tid, e in ranked]
        top = [TopLogprob(name, _value(e), list(name.encode("utf-8"))) for name, (_, e) in zip(names, ranked)]
        token = _name(chosen_id, chosen, as_ids)
        content.append(ChatLogprob(token, _value(chosen), list(token.encode("utf-8")), top))
    return content


def prompt_logprobs(positions: list[PositionLogprobs | None] | None) -> PromptLogprobsList | None:
    """vLLM's `prompt_logprobs`: per prompt position None or {token id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if p is None else {tid: PromptLogprob(_value(e), e.rank, e.decoded_token) for tid, e in p.items()}
            for p in positions]
