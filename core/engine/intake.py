"""Checks every request passes before it reaches the engine, shared by the async client and the
offline path: a token id outside the vocabulary would otherwise fail inside a step, and with it
every request batched alongside."""
from __future__ import annotations

from collections.abc import Iterable

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams

NO_TOKENIZER = ("this model runs without a tokenizer (skip_tokenizer_init, a shape preset, or dummy weights "
                "with no tokenizer files)")


def check_token_ids(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequestError naming the field whose token ids the model cannot take."""
    if not prompt_token_ids:
        raise InvalidRequestError("prompt is empty", param="prompt")
    _check_in_vocab(prompt_token_ids, vocab_size, "prompt")
    if params.logit_bias:
        _check_in_vocab(params.logit_bias, vocab_size, "logit_bias")
    if params.stop_token_ids:
        _check_in_vocab(params.stop_token_ids, vocab_size, "stop_token_ids")


def check_text_features(params: SamplingParams, has_tokenizer: bool) -> None:
    """Stop strings are matched on detokenized text, which a tokenizer-free engine never produces."""
    if params.stop and not has_tokenizer:
        raise InvalidRequestError(f"{NO_TOKENIZER}, so stop strings cannot be matched; use stop_token_ids",
                                  param="stop")


def text_prompt_error() -> InvalidRequestError:
    return InvalidRequestError(f"{NO_TOKENIZER}, so prompts must be lists of token ids, not text", param="prompt")


def _check_in_vocab(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"{param} names token id {bad}, outside this model's vocabulary [0, {vocab_size})",
                                  param=param)
