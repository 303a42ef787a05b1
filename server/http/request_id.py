"""`X-Request-Id`: every response carries the request's id, the client's when it sent one.

The middleware takes the client's `X-Request-Id` header (or makes an id), binds it to the log
context and writes it on the response. A generation route may name its engine request after the
body's vLLM `request_id` field instead (`request_id_for`); the header then carries that id, so the
id a client sees is the one in the logs, the traces and the dashboard.
"""
from __future__ import annotations

import uuid

import structlog
from litestar import Request
from litestar.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_MAX_LENGTH = 256
_STATE_KEY = "request_id"


def _sent_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == HEADER:
            text = value.decode("latin-1").strip()
            return text[:_MAX_LENGTH] if text else None
    return None


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        sent = _sent_id(scope)
        state[_STATE_KEY] = sent or uuid.uuid4().hex
        state["request_id_sent"] = sent is not None

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                headers.append((HEADER, state[_STATE_KEY].encode("latin-1", "replace")))
                message = {**message, "headers": headers}
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=state[_STATE_KEY]):
            await app(scope, receive, send_with_id)

    return middleware


def request_id_for(request: Request, body_id: str | None) -> str:
    """The id of this HTTP request's work: the X-Request-Id header when sent, else the body's
    `request_id` (vLLM's field), else the one the middleware made. The response header follows."""
    state = request.scope.setdefault("state", {})
    if not state.get("request_id_sent") and body_id is not None:
        state[_STATE_KEY] = body_id
    return state.get(_STATE_KEY) or uuid.uuid4().hex
