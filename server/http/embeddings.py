"""POST /v1/embeddings: one vector per input, from a pooling model (`--runner pooling`).

Each input is one prefill-only engine request (`EngineClient.encode`), all of a request's inputs at
once. An input longer than the context is refused with `context_length_exceeded`, unless the server
runs with `--embed-chunking`: then it is split into chunks of at most `max_model_len` tokens, each
pooled unnormalised, and the chunk vectors are averaged weighted by their token counts before
normalisation applies (vLLM's chunked processing; for MEAN pooling this is the mean over every
token, each chunk attending only to itself). A generative model answers this route with 400, as a
pooling model answers the text routes. Every check on an input is intake's
(`corectl.engine.intake.check_pooling_request`); this route names the field as its client sent it.
"""
from __future__ import annotations

import base64
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
import numpy as np
from corectl.errors import InvalidRequestError
from corectl.pooling import PoolingParams, finish_embedding
from litestar import Controller, Request, post
from litestar.openapi import ResponseSpec

from .auth import require_api_key
from .embedding_protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from .errors import ERROR_RESPONSES, APIError
from .generation import record_request, until_disconnected
from .request_id import request_id_for
from .state import ServerState

T = TypeVar("T")


class EmbeddingsController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/embeddings", status_code=200, responses={
        200: ResponseSpec(EmbeddingResponse, description="one embedding per input"), **ERROR_RESPONSES})
    async def create_embedding(self, data: EmbeddingRequest, request: Request,
                               server: ServerState) -> EmbeddingResponse:
        return await embedding(data, request, server)


async def embedding(data: EmbeddingRequest, request: Request, server: ServerState) -> EmbeddingResponse:
    """POST /v1/embeddings (and /invocations with an input): one embedding per input."""
    server.check_accepting()
    server.check_model(data.model)
    server.check_priority(data.priority)
    # Intake checks each input (a pooling engine, the vocabulary, the context, `dimensions`); the
    # route only renames what it refuses (`_as_input_error`).
    params = data.pooling_params()
    prompts = _token_ids(data, server)
    request_id = f"embd-{request_id_for(request, data.request_id)}"
    server.begin_request()
    try:
        vectors = await until_disconnected(request.receive, lambda: _gather([
            _embedder(server, f"{request_id}-{i}", prompt, params, data.priority)
            for i, prompt in enumerate(prompts)]))
    finally:
        server.end_request()
    num_tokens = sum(len(ids) for _, ids in prompts)
    return EmbeddingResponse(
        id=request_id, created=int(time.time()), model=server.model_name,
        data=[EmbeddingData(index=i, embedding=_encoded(v, data.encoding_format)) for i, v in enumerate(vectors)],
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


def _token_ids(data: EmbeddingRequest, server: ServerState) -> list[tuple[str | None, list[int]]]:
    """Each input as (its text, or None for token ids; its token ids)."""
    inputs = data.inputs()
    if not any(isinstance(item, str) for item in inputs):
        return _truncated(data, server, [(None, list(item)) for item in inputs])
    tokenizer = server.require_tokenizer("input", "inputs must be token ids, not text")
    return _truncated(data, server, [(text, tokenizer.encode(text, add_special_tokens=data.add_special_tokens))
                                     for text in inputs])


class Truncating(Protocol):
    """A request that may keep only its inputs' last tokens (embeddings, score, rerank)."""

    truncate_prompt_tokens: int | None


def _truncated(data: Truncating, server: ServerState,
               prompts: list[tuple[str | None, list[int]]]) -> list[tuple[str | None, list[int]]]:
    """vLLM's truncate_prompt_tokens: each input's last k tokens (-1: the context's length); a
    truncated input no longer matches its text."""
    keep = data.truncate_prompt_tokens
    if keep is None:
        return prompts
    if keep == -1:
        keep = server.engine.info.max_model_len
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
    return [(text if len(ids) <= keep else None, ids[-keep:]) for text, ids in prompts]


def _embedder(server: ServerState, request_id: str, prompt: tuple[str | None, list[int]], params: PoolingParams,
              priority: int) -> Callable[[], Awaitable[list[float] | np.ndarray]]:
    """The work of one input: one engine request, or one per chunk of an input past the context
    (with --embed-chunking; without, intake refuses it)."""
    text, ids = prompt
    limit = server.engine.info.max_model_len
    if len(ids) <= limit or not server.settings.embed_chunking:
        return lambda: _encode(server, request_id, ids, text, params, priority)
    # Chunks are pooled unnormalised; truncated to `dimensions` already, as truncation commutes with
    # the weighted mean (and so intake checks `dimensions` on every chunk).
    raw = PoolingParams(dimensions=params.dimensions, normalize=False)

    async def chunked() -> np.ndarray:
        chunks = [ids[start:start + limit] for start in range(0, len(ids), limit)]
        vectors = await _gather([
            lambda c=c, chunk=chunk: _encode(server, f"{request_id}.{c}", chunk, None, raw, priority)
            for c, chunk in enumerate(chunks)])
        weights = np.array([len(chunk) for chunk in chunks], dtype=np.float32)
        mean = (np.asarray(vectors, dtype=np.float32) * weights[:, None]).sum(0) / weights.sum()
        return finish_embedding(mean, params, server.engine.info.pooling)

    return chunked


async def _encode(server: ServerState, request_id: str, ids: list[int], text: str | None, params: PoolingParams,
                  priority: int) -> list[float]:
    """One engine request's embedding; its metrics and log line are recorded when it ends."""
    out = None
    trace_parent = None if server.tracer is None else server.tracer.parent()
    try:
        async for out in server.engine.encode(ids, params, request_id, priority):
            pass
    except InvalidRequestError as exc:
        raise _as_input_error(exc) from None
    except anyio.get_cancelled_exc_class():
        record_request(server, request_id, "aborted", ["abort"], None, ids if text is None else text, time.monotonic())
        raise
    if server.metrics is not None:
        server.metrics.prompt_tokens.inc(len(ids))
    now, reasons = time.monotonic(), [out.finish_reason or "abort"]
    if server.tracer is not None:
        server.tracer.emit(trace_parent, request_id, server.model_name, None, out.metrics, reasons, now)
    record_request(server, request_id, "finished", reasons, out.metrics, ids if text is None else text, now)
    if out.finish_reason == "abort":
        raise APIError(503, "the engine could not take this request (it is overloaded); retry later")
    return out.outputs.embedding


def _as_input_error(exc: InvalidRequestError) -> InvalidRequestError:
    """Intake's refusal as this route names it: the engine's `prompt` is the client's `input`, and an
    input past the context is told how to be embedded anyway."""
    message = str(exc)
    if exc.code == "context_length_exceeded":
        message += " (a server run with --embed-chunking embeds longer inputs in chunks)"
    return InvalidRequestError(message, "input" if exc.param == "prompt" else exc.param, exc.code)


async def _gather(works: list[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run every work at once; their results in order. The first failure cancels the others and is raised."""
    results: list = [None] * len(works)
    errors: list[Exception] = []

    async def run(index: int, work: Callable[[], Awaitable[T]], scope: anyio.CancelScope) -> None:
        try:
            results[index] = await work()
        except Exception as exc:
            errors.append(exc)
            scope.cancel()

    async with anyio.create_task_group() as tg:
        for index, work in enumerate(works):
            tg.start_soon(run, index, work, tg.cancel_scope)
    if errors:
        raise errors[0]
    return results


def _encoded(vector: list[float] | np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as the client asked for it: floats, or OpenAI's base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist() if isinstance(vector, np.ndarray) else vector
