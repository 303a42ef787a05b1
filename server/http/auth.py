"""API-key check for the routes that serve the model (`--api-key`); ops routes stay open."""
from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from .errors import APIError


async def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard (async: a sync guard would cost a thread hop per request): the bearer token
    must match one of the server's keys."""
    keys: list[str] = connection.app.state.server.settings.api_keys
    if not keys:
        return
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    presented = token.strip().encode() if scheme.lower() == "bearer" else b""
    # Compare against every key, without an early exit, so timing reveals neither key nor position.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key.encode())
    if not matched:
        message = "invalid API key" if presented else "missing API key: send 'Authorization: Bearer <key>'"
        raise APIError(401, message)
