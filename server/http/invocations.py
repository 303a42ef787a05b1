"""POST /invocations, Amazon SageMaker's single route, as vLLM serves it: the body's shape says which
API it is for (`messages`: chat completions, `prompt`: completions, `input`: embeddings), and the
request then runs exactly as on that route, streaming included. `GET/POST /ping` is the health check
beside it (`ops.py`)."""
from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response, post

from .auth import require_api_key
from .chat import chat_completion
from .completions import completion
from .embedding_protocol import EmbeddingRequest
from .embeddings import embedding
from .errors import ERROR_RESPONSES, APIError
from .protocol import ChatCompletionRequest, CompletionRequest
from .state import ServerState

# The key that tells each API's body apart, in the order they are tried, with its request type and route.
_ROUTES = (("messages", ChatCompletionRequest, chat_completion), ("prompt", CompletionRequest, completion),
           ("input", EmbeddingRequest, embedding))


class InvocationsController(Controller):
    guards = [require_api_key]
    tags = ["Operations"]

    @post("/invocations", status_code=200, responses=ERROR_RESPONSES)
    async def invocations(self, data: dict[str, Any], request: Request, server: ServerState) -> Response:
        for key, request_type, route in _ROUTES:
            if key in data:
                try:
                    body = msgspec.convert(data, request_type)
                except msgspec.ValidationError as exc:
                    raise APIError(400, f"invalid request body for {route.__name__.replace('_', ' ')}: {exc}") from None
                result = await route(body, request, server)
                return result if isinstance(result, Response) else Response(result)
        raise APIError(400, "/invocations takes a chat completion ('messages'), a completion ('prompt') or an "
                       "embedding ('input') request body")

