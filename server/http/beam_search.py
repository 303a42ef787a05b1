"""`use_beam_search` on /v1/completions, as vLLM serves it: `n` beams per prompt, `length_penalty`.

The search (`corectl.beam_search.BeamSearch`) runs over the engine client: each step sends every
live beam as a one-token request for its top logprobs, all at once, and the beams of a prompt
share its KV blocks through the prefix cache. The response holds each prompt's `n` best beams,
best first, as its choices; it does not stream.
"""
from __future__ import annotations

import time

import anyio
from corectl.beam_search import BeamSearch, BeamSearchParams
from corectl.errors import InvalidRequestError
from corectl.outputs import PositionLogprobs
from corectl.sampling_params import SamplingParams

from .errors import APIError
from .generation import until_disconnected
from .protocol import CompletionRequest
from .responses import CompletionChoice, CompletionResponse, Usage
from .state import ServerState


def check_beam_request(data: CompletionRequest) -> BeamSearchParams:
    """The search a `use_beam_search` request asks for; 400 naming what beam search cannot do."""
    for field, unsupported in (("stream", data.stream), ("echo", data.echo), ("logprobs", data.logprobs is not None),
                               ("prompt_logprobs", data.prompt_logprobs is not None),
                               ("stop", bool(data.stop)), ("seed", data.seed is not None)):
        if unsupported:
            raise APIError(400, f"{field} is not available with use_beam_search", field)
    if data.constraint_field is not None:
        raise APIError(400, f"{data.constraint_field} is not available with use_beam_search", data.constraint_field)
    try:
        return BeamSearchParams(beam_width=data.n, max_tokens=data.max_tokens or 16, ignore_eos=data.ignore_eos,
                                temperature=data.temperature or 0.0, length_penalty=data.length_penalty)
    except InvalidRequestError as exc:
        raise APIError(400, f"use_beam_search: {exc}", "n" if exc.param == "beam_width" else exc.param) from None


async def beam_search_response(server: ServerState, data: CompletionRequest, prompts: list[str | list[int]],
                               request_id: str, lora, receive) -> CompletionResponse:
    """The request's beams; `prompts` are its prompts (text is tokenized here), `lora` its adapter."""
    params = check_beam_request(data)
    tokenizer = server.engine.tokenizer
    if any(isinstance(p, str) for p in prompts):
        tokenizer = server.require_tokenizer("prompt", "prompts must be token ids")
    ids = [tokenizer.encode(p, add_special_tokens=data.add_special_tokens) if isinstance(p, str) else p
           for p in prompts]
    search = BeamSearch(ids, params, _eos(server))
    step = 0
    while batch := search.requests():
        names = [f"{request_id}-s{step}-{i}" for i in range(len(batch))]
        positions = await until_disconnected(
            receive, lambda: _step(server, batch, search.step_params, names, data.priority, lora))
        search.advance(positions)
        step += 1
    choices, completion_tokens = [], 0
    for index, (output, prompt_len) in enumerate(zip(search.results(None), search.prompt_lengths)):
        for rank, beam in enumerate(output.sequences):
            generated = beam.tokens[prompt_len:]
            completion_tokens += len(generated)
            text = "" if tokenizer is None else tokenizer.decode(generated, skip_special_tokens=data.skip_special_tokens)
            choices.append(CompletionChoice(index=index * data.n + rank, text=text, logprobs=None,
                                            finish_reason=beam.finish_reason, stop_reason=None))
    prompt_tokens = sum(search.prompt_lengths)
    return CompletionResponse(id=request_id, created=int(time.time()), model=server.model_name, choices=choices,
                              usage=Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, None))


def _eos(server: ServerState) -> int | None:
    tokenizer = server.engine.tokenizer
    return None if tokenizer is None else tokenizer.eos_token_id


async def _step(server: ServerState, batch: list[list[int]], params: SamplingParams, ids: list[str],
                priority: int, lora) -> list[PositionLogprobs]:
    """One token for every beam at once; each beam's logprobs at that token."""
    positions: list[PositionLogprobs | None] = [None] * len(batch)

    async def one(index: int) -> None:
        async for out in server.engine.generate(batch[index], params, ids[index], priority, lora):
            for sample in out.outputs:
                if sample.logprobs:
                    positions[index] = sample.logprobs[0]

    try:
        async with anyio.create_task_group() as tg:
            for index in range(len(batch)):
                tg.start_soon(one, index)
    except BaseExceptionGroup as group:  # a refused beam (e.g. past the context) is the request's error
        raise group.exceptions[0] from None
    if any(p is None for p in positions):
        raise APIError(503, "the engine could not take this request (it is overloaded); retry later")
    return positions  # type: ignore[return-value]
