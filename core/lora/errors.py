"""The error every adapter problem is raised as (a 400 in the server, naming adapter and problem)."""
from __future__ import annotations

from ..errors import InvalidRequestError


class LoRAAdapterError(InvalidRequestError):
    """An adapter cannot be served; the message names the adapter and the problem."""

    def __init__(self, message: str, param: str | None = "lora_request", code: str = "invalid_request_error"):
        super().__init__(message, param=param, code=code)
