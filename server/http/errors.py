"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with string codes.

Every failure a client can cause is a 4xx naming the field at fault (never 422 or 500); the
exception-handler map below is the single place where exceptions become responses.
"""
from __future__ import annotations

import logging
import re

import msgspec
from corectl.errors import (
    ConfigError,
    CorectlError,
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
)
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import ResponseSpec

logger = logging.getLogger("corectl.server")

_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")
# Seconds a client should wait before retrying a request refused because the queue is full.
RETRY_AFTER_S = 1

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error"}
_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
          415: "unsupported_media_type", 429: "rate_limit_exceeded", 499: "client_closed_request",
          500: "internal_error", 503: "service_unavailable"}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error the server itself decides on (unknown model, unsupported field, ...)."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code or _CODES.get(status_code, "invalid_request_error")


class ClientDisconnected(Exception):
    """The client went away before the response started; its request was aborted."""


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    kind = _TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    return ErrorResponse(ErrorInfo(message, kind, param, code or _CODES.get(status_code, "invalid_request_error")))


def error_response(status_code: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status_code, message, param, code), status_code=status_code, headers=headers)


def to_api_error(exc: BaseException) -> APIError:
    """The status, message, param and code for any exception a request can raise."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param, exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not available: {exc}")
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), code="model_not_found")
    if isinstance(exc, ConfigError):
        return APIError(400, str(exc), exc.field)
    if isinstance(exc, ValidationException):
        return _from_validation(exc)
    if isinstance(exc, HTTPException):
        return APIError(exc.status_code, _http_message(exc))
    if isinstance(exc, ClientDisconnected):
        return APIError(499, "the client closed the connection")
    if isinstance(exc, CorectlError):
        return APIError(400, str(exc))
    return APIError(500, "internal server error; the server log has the details")


def _from_validation(exc: ValidationException) -> APIError:
    """Litestar's msgspec decoding errors, reworded to name the field at fault."""
    extra = exc.extra if isinstance(exc.extra, list) else []
    first = extra[0] if extra and isinstance(extra[0], dict) else {}
    key, message = first.get("key"), str(first.get("message") or exc.detail)
    if key in (None, "data"):
        missing = _MISSING_FIELD.search(message)
        if missing:
            return APIError(400, f"missing required field '{missing.group(1)}'", missing.group(1))
        if message in ("'data'", ""):
            message = "the request body is missing; send a JSON object"
        return APIError(400, f"invalid request body: {message}")
    param = str(key).replace("[...]", "")
    return APIError(400, f"invalid value for '{param}': {message}", param)


def _http_message(exc: HTTPException) -> str:
    if exc.status_code == 413:
        return "the request body is larger than this server accepts (see --max-request-body)"
    if exc.status_code == 404:
        return "no such route; /docs lists the API's (unless the server runs with --disable-fastapi-docs)"
    return str(exc.detail)


def handle_exception(request: Request, exc: Exception) -> Response:
    err = to_api_error(exc)
    if err.status_code >= 500 and not isinstance(exc, (APIError, EngineDeadError)):
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status_code == 429 else None
    return error_response(err.status_code, err.message, err.param, err.code, headers)


EXCEPTION_HANDLERS = {Exception: handle_exception}

# The error responses of the generation routes, as the OpenAPI document shows them.
ERROR_RESPONSES = {
    status: ResponseSpec(ErrorResponse, description=description)
    for status, description in [
        (400, "an invalid field (`param` names it) or context_length_exceeded"),
        (401, "missing or wrong API key"),
        (404, "model_not_found"),
        (413, "request body too large"),
        (415, "the body is not sent as application/json"),
        (429, "the request queue is full; retry after `Retry-After` seconds"),
        (503, "the engine is not available, or the server is shutting down"),
    ]
}
