"""Exceptions that cross the core's public boundary; the server maps them to OpenAI errors."""
from __future__ import annotations


class CorectlError(Exception):
    """Base class for errors raised by corectl."""


class ConfigError(CorectlError, ValueError):
    """An engine option has a bad value; `field` names the option."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # keeps the field when it crosses a process (a tensor-parallel rank's error)
        return type(self), (self.field, self.message)


class InvalidRequestError(CorectlError, ValueError):
    """A request cannot be served as asked; `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request_error"):
        super().__init__(message)
        self.param = param
        self.code = code

    def __reduce__(self):
        return type(self), (str(self), self.param, self.code)


class EngineDeadError(CorectlError, RuntimeError):
    """The engine loop stopped; no further request can be served by this client."""


class QueueFullError(CorectlError, RuntimeError):
    """The bounded request queue is full; retry later."""


class ModelNotFoundError(CorectlError, FileNotFoundError):
    """A model path or id could not be resolved to weights."""
