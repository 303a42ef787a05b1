"""Request intake: the one check every request passes, on the client's side, before the engine sees it.

Every path registers its requests through `OutputProcessor.add_request` (the async `EngineClient`,
whether its engine runs in another process or in this one, and the offline `LLM`), which calls
`check_request` once. The engine trusts what arrives: a token id outside the vocabulary would
otherwise fail inside a step, and with it every request batched alongside; a reused id would mix
two requests' state. Only admission (the queue bound) is decided later, where the queue is known.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import msgspec

from ..discovery import resolve_structured_output_backend
from ..errors import InvalidRequestError
from ..multimodal.inputs import MultiModalInput
from ..pooling import PoolingParams, check_pooling_params
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .messages import EngineInfo

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

# Specs that passed the backend's check, by text (each at most the server's 64 KB bound).
_MAX_PASSED = 256
_PASSED: OrderedDict[bytes, None] = OrderedDict()
_PASSED_LOCK = threading.Lock()

NO_TOKENIZER = ("this model runs without a tokenizer (skip_tokenizer_init, a shape preset, or dummy weights "
                "with no tokenizer files)")


def encode_prompt(tokenizer: Tokenizer | None, prompt) -> tuple[str | None, list[int]]:
    """A prompt as (its text, or None for token ids; its token ids). A prompt is a string, a list
    of token ids, or vLLM's dict forms: `{"prompt": text}` or `{"prompt_token_ids": [...]}`."""
    if isinstance(prompt, dict):
        prompt = _unwrap_prompt_dict(prompt)
    if not isinstance(prompt, str):
        token_ids = list(prompt) if isinstance(prompt, (list, tuple)) else None
        # Exactly int (bools and other int subclasses are refused); a C-level pass, 4x the generator's speed.
        if token_ids is None or not set(map(type, token_ids)) <= {int}:
            raise InvalidRequestError(f"a prompt is a string, a list of token ids (ints) or a dict with 'prompt' or "
                                      f"'prompt_token_ids', not {_describe(prompt)}", param="prompt")
        return None, token_ids
    if tokenizer is None:
        raise InvalidRequestError(f"{NO_TOKENIZER}, so prompts must be lists of token ids, not text", param="prompt")
    return prompt, tokenizer.encode(prompt)


def prompt_mm_inputs(prompt) -> list[MultiModalInput]:
    """The images of a prompt given as `{"prompt_token_ids": ids, "mm_inputs": [...]}` (the form
    the server and `LLM.chat` build once the images are processed); none for any other prompt."""
    return list(prompt.get("mm_inputs") or ()) if isinstance(prompt, dict) else []


def check_mm_inputs(items: list[MultiModalInput], prompt_token_ids: list[int], info: EngineInfo) -> None:
    """A prompt's images: a model that reads them, and each one's placeholder run inside the
    prompt, after the previous one's, holding nothing but the image token."""
    if not items:
        return
    if info.image_token_id is None:
        raise InvalidRequestError(f"this model ({info.architecture}) reads no images; send text only",
                                  param="messages", code="images_not_supported")
    end = 0
    for item in items:
        run = prompt_token_ids[item.offset:item.end]
        if item.offset < end or item.length < 1 or len(run) != item.length or set(run) != {info.image_token_id}:
            raise InvalidRequestError(f"image placeholders at {item.offset}..{item.end - 1} do not match the "
                                      "prompt (a truncated prompt cannot keep its images)", param="prompt")
        end = item.end


def _unwrap_prompt_dict(prompt: dict):
    """The text or ids of a vLLM-style prompt dict (TextPrompt, TokensPrompt)."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "mm_inputs"})
    if unknown:
        raise InvalidRequestError(f"prompt dicts take 'prompt' or 'prompt_token_ids' only; this engine does not "
                                  f"take {', '.join(map(repr, unknown))}", param="prompt")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequestError("a prompt dict needs exactly one of 'prompt' (text) and 'prompt_token_ids'",
                                  param="prompt")
    if "prompt" in prompt and not isinstance(prompt["prompt"], str):
        raise InvalidRequestError(f"'prompt' must be a string, not {_describe(prompt['prompt'])}", param="prompt")
    return prompt.get("prompt", prompt.get("prompt_token_ids"))


def _describe(value) -> str:
    return type(value).__name__ if not isinstance(value, (list, tuple)) else f"a {type(value).__name__} holding " + (
        ", ".join(sorted({type(v).__name__ for v in value})) or "nothing")


def check_request(request_ids: list[str], prompt_token_ids: list[int], params: SamplingParams, info: EngineInfo,
                  in_use: Callable[[str], bool]) -> None:
    """Raise InvalidRequestError naming the field the engine cannot take.

    `request_ids` are the user's id and the ids of its core requests (one per sample); none may be
    `in_use`. The context must hold the prompt plus `max_tokens` (at least one token when unset).
    A grammar (`structured_outputs`) must parse with the engine's backend.
    """
    if info.pooling is not None:
        raise InvalidRequestError("this model is served as a pooling model (--runner pooling): it makes embeddings "
                                  "(/v1/embeddings, LLM.embed), not text", param="model")
    _check_id(request_ids, in_use)
    if params.stop and info.tokenizer_dir is None:
        raise InvalidRequestError(f"{NO_TOKENIZER}, so stop strings cannot be matched; use stop_token_ids",
                                  param="stop")
    if not prompt_token_ids:
        raise InvalidRequestError("prompt is empty", param="prompt")
    if params.structured_outputs is not None:
        check_structured_outputs(params.structured_outputs, info)
    _check_in_vocab(prompt_token_ids, info.vocab_size, "prompt")
    if params.logit_bias:
        _check_in_vocab(params.logit_bias, info.vocab_size, "logit_bias")
    if params.stop_token_ids:
        _check_in_vocab(params.stop_token_ids, info.vocab_size, "stop_token_ids")
    if params.allowed_token_ids:
        _check_in_vocab(params.allowed_token_ids, info.vocab_size, "allowed_token_ids")
    if params.bad_words_token_ids:
        _check_in_vocab([t for word in params.bad_words_token_ids for t in word], info.vocab_size, "bad_words")
    _check_context_length(len(prompt_token_ids), params.max_tokens or 1, info.max_model_len)


def prepare_request(prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    tokenizer: Tokenizer | None) -> tuple[str | None, list[int], SamplingParams]:
    """Apply the request's own prompt and word edits before intake checks it: `truncate_prompt_tokens`
    keeps the prompt's last tokens (the text then no longer matches and is dropped), `bad_words`
    become the token ids the sampler forbids."""
    if params.truncate_prompt_tokens is not None and len(prompt_token_ids) > params.truncate_prompt_tokens:
        prompt, prompt_token_ids = None, prompt_token_ids[-params.truncate_prompt_tokens:]
    if params.bad_words and params.bad_words_token_ids is None:
        if tokenizer is None:
            raise InvalidRequestError(f"{NO_TOKENIZER}, so bad_words cannot be tokenized", param="bad_words")
        params = params.clone(bad_words_token_ids=bad_words_token_ids(params.bad_words, tokenizer))
    return prompt, prompt_token_ids, params


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word as written and, where it tokenizes differently
    with the same number of tokens, after a space (the word inside a sentence)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not bare:
            raise InvalidRequestError(f"bad_words entry {word!r} has no tokens", param="bad_words")
        out.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def check_pooling_request(request_id: str, prompt_token_ids: list[int], params: PoolingParams, info: EngineInfo,
                          in_use: Callable[[str], bool]) -> None:
    """The intake of an embedding: a pooling engine, a free id, a non-empty prompt of known token ids
    that fits the context alone (nothing is generated), and `dimensions` the model can truncate to."""
    if info.pooling is None:
        raise InvalidRequestError("this model is served for generation: it makes no embeddings; serve an "
                                  "embedding model, or this one with --runner pooling", param="model")
    _check_id([request_id], in_use)
    if not prompt_token_ids:
        raise InvalidRequestError("prompt is empty", param="prompt")
    _check_in_vocab(prompt_token_ids, info.vocab_size, "prompt")
    _check_context_length(len(prompt_token_ids), 0, info.max_model_len)
    check_pooling_params(params, info.pooling)


def _check_id(request_ids: list[str], in_use: Callable[[str], bool]) -> None:
    taken = next((rid for rid in request_ids if in_use(rid)), None)
    if taken is not None:
        raise InvalidRequestError(f"request id {taken!r} is already in use; ids must be unique", param="request_id")


def check_structured_outputs(spec: StructuredOutputsParams, info: EngineInfo) -> None:
    """Refuse a grammar the engine's backend cannot parse here, before the engine compiles it.

    Thread-safe: the async client runs it off its event loop first (`grammar_intake`). A spec
    that passed is remembered by its text, so `check_request` on the same request (and a client
    that sends one schema again and again) costs a lookup."""
    if info.structured_outputs_backend is None:
        raise InvalidRequestError(f"{NO_TOKENIZER}, so output cannot be constrained to a grammar",
                                  param="structured_outputs")
    key = info.structured_outputs_backend.encode() + b" " + msgspec.json.encode(spec)
    with _PASSED_LOCK:
        passed = key in _PASSED
        if passed:
            _PASSED.move_to_end(key)
    if not passed:
        resolve_structured_output_backend(info.structured_outputs_backend).validate(spec)
        with _PASSED_LOCK:
            _PASSED[key] = None
            if len(_PASSED) > _MAX_PASSED:
                _PASSED.popitem(last=False)
    if spec.reasoning is not None:
        markers = [spec.reasoning.end] + ([spec.reasoning.start] if spec.reasoning.start is not None else [])
        _check_in_vocab(markers, info.vocab_size, "structured_outputs.reasoning")


def _check_in_vocab(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"{param} names token id {bad}, outside this model's vocabulary [0, {vocab_size})",
                                  param=param)


def _check_context_length(num_prompt_tokens: int, num_completion_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens + num_completion_tokens > max_model_len:
        completion = f" plus {num_completion_tokens} completion tokens" if num_completion_tokens else ""
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens; the request asks for "
            f"{num_prompt_tokens} prompt tokens{completion}",
            param="max_tokens" if num_prompt_tokens < max_model_len else "prompt", code="context_length_exceeded",
        )
