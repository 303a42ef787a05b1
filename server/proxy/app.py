"""The proxy's Litestar app: `/v1/completions` and `/v1/chat/completions` (streamed or not) go
to a prefill instance, then a decode instance (`routing.py`); `/v1/models` and `/health` answer
from the decode instances.

With `max_prefill_queue`, a prompt that finds every prefill instance that busy skips them
(`routing.PrefillInstances`): the decode instance computes it, counted against `max_local_prefills`
until its first token is relayed.

A prefill half that fails for the server's sake (the instance is down, times out or answers 5xx)
is logged and skipped: the decode instance then computes the prompt itself, and the client sees a
slower answer, never an error. A prefill half refused for the request's sake (4xx) is the answer:
the decode instance would refuse it the same way. The client's `Authorization` and `X-Request-Id`
headers go to both halves.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream

from ..http.errors import APIError, EXCEPTION_HANDLERS
from .routing import PrefillInstances, RoundRobin, decode_body, disaggregates, new_transfer_id, prefill_body

logger = logging.getLogger("corectl.proxy")
_FORWARDED_HEADERS = ("authorization", "x-request-id")


class Upstreams:
    """The instances behind the proxy and the one HTTP client that reaches them."""

    def __init__(self, prefill: list[str], decode: list[str], timeout: float, max_prefill_queue: int | None = None,
                 max_local_prefills: int | None = None):
        self.prefill = PrefillInstances(prefill, max_prefill_queue, max_local_prefills)
        self.decode = RoundRobin(decode)
        # No cap on connections: each client request holds one at a time, and httpx's default of 100
        # would queue requests past that concurrency here instead of on the instances.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))


def _headers(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


class _LocalPrompt:
    """A prompt a decode instance computes because the prefill instances were full, counted until
    its first token comes back (a chat stream's first event is the role alone)."""

    def __init__(self, pool: PrefillInstances, events_before_token: int):
        self._pool, self._left, self._open = pool, events_before_token, True

    def seen(self, chunk: bytes) -> None:
        self._left -= chunk.count(b"data:")
        if self._left <= 0:
            self.release()

    def release(self) -> None:
        if self._open:
            self._open = False
            self._pool.release_local()


async def _prefill(upstreams: Upstreams, path: str, body: dict[str, Any], headers: dict[str, str]
                   ) -> tuple[str | None, _LocalPrompt | None]:
    """Run the prefill half: the transfer id to decode from (None: it failed or refused, the decode
    instance takes the request whole); or skip it, the prompt counted as the decode instance's."""
    url = upstreams.prefill.acquire()
    if url is None:
        logger.debug("every prefill instance has %d prompts in flight; the decode instance computes this one",
                     upstreams.prefill.max_queue)
        return None, _LocalPrompt(upstreams.prefill, 2 if path.endswith("/chat/completions") else 1)
    transfer_id = new_transfer_id()
    try:
        answer = await upstreams.client.post(url + path, json=prefill_body(body, transfer_id), headers=headers)
    except httpx.HTTPError as exc:
        logger.warning("prefill instance %s failed (%s); the decode instance computes the prompt", url, exc)
        return None, None
    finally:
        upstreams.prefill.release(url)
    if 400 <= answer.status_code < 500:
        # The prefill half is the client's request rewritten (max_tokens 1, no stream): its refusal may
        # name what the proxy wrote, so the decode instance answers the request as sent.
        logger.debug("prefill instance %s answered %d; the decode instance takes the request", url,
                     answer.status_code)
        return None, None
    if answer.status_code >= 500:
        logger.warning("prefill instance %s answered %d; the decode instance computes the prompt", url,
                       answer.status_code)
        return None, None
    return transfer_id, None


async def _relay(upstreams: Upstreams, path: str, request: Request) -> Response | Stream:
    body = await _json_body(request)
    headers = _headers(request)
    transfer_id = local = None
    started = time.monotonic()
    if disaggregates(body):
        transfer_id, local = await _prefill(upstreams, path, body, headers)
    prefilled = time.monotonic()
    url = upstreams.decode.pick() + path
    upstream = upstreams.client.build_request("POST", url, json=decode_body(body, transfer_id), headers=headers)
    try:
        answer = await upstreams.client.send(upstream, stream=True)
    except httpx.HTTPError as exc:
        if local is not None:
            local.release()
        raise APIError(502, f"the decode instance did not answer: {exc}", code="bad_gateway") from None
    logger.debug("transfer %s: prefill answered after %.1f ms, decode's headers %.1f ms later", transfer_id,
                 (prefilled - started) * 1e3, (time.monotonic() - prefilled) * 1e3)
    media_type = answer.headers.get("content-type", "application/json")
    if not body.get("stream") or answer.status_code != 200:
        try:
            content = await answer.aread()
        finally:
            await answer.aclose()
            if local is not None:
                local.release()
        return Response(content, status_code=answer.status_code, media_type=media_type)
    return Stream(_chunks(answer, local), status_code=200, media_type=media_type)


async def _chunks(answer: httpx.Response, local: _LocalPrompt | None) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer.aiter_raw():
            if local is not None:
                local.seen(chunk)
            yield chunk
    finally:
        await answer.aclose()
        if local is not None:
            local.release()


def create_proxy_app(prefill: list[str], decode: list[str], timeout: float = 600.0,
                     max_prefill_queue: int | None = None, max_local_prefills: int | None = None) -> Litestar:
    upstreams = Upstreams(prefill, decode, timeout, max_prefill_queue, max_local_prefills)

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Response | Stream:
        return await _relay(upstreams, "/v1/completions", request)

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request) -> Response | Stream:
        return await _relay(upstreams, "/v1/chat/completions", request)

    @get("/v1/models")
    async def models(request: Request) -> Response:
        answer = await upstreams.client.get(upstreams.decode.pick() + "/v1/models", headers=_headers(request))
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @get("/health")
    async def health() -> Response:
        return Response(b"", status_code=200)

    async def close_client() -> None:
        await upstreams.client.aclose()

    return Litestar([completions, chat_completions, models, health], exception_handlers=EXCEPTION_HANDLERS,
                    on_shutdown=[close_client])
