"""What every error response of the server looks like: OpenAI's `{"error": {...}}` with a 4xx or 5xx."""
from __future__ import annotations

import httpx

ERROR_KEYS = {"message", "type", "param", "code"}


def openai_error(response: httpx.Response) -> dict:
    """The response's error object, after checking it has OpenAI's shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS and error["message"] and isinstance(error["message"], str), error
    assert isinstance(error["type"], str) and isinstance(error["code"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    return error


def expect_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = openai_error(response)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error
