"""Request and response bodies of POST /v1/embeddings (OpenAI's shape plus vLLM's extensions).

`input` is a string, a list of strings, a list of token ids or a list of token-id lists, as OpenAI
takes it. Every size a client controls is bounded here (docs/serving.md, "Request bounds"): at most
`MAX_EMBED_INPUTS` inputs, token ids as 32-bit integers (the vocabulary is checked by intake), a
positive `dimensions`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from corectl.pooling import MAX_EMBED_INPUTS, PoolingParams
from msgspec import Meta

from .errors import APIError
from .protocol import Int64, RequestId

TokenId = Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """POST /v1/embeddings."""

    input: str | list[str | TokenId | list[TokenId]] | None = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1, le=(1 << 31) - 1)] | None = None
    user: str | None = None
    # vLLM's extensions
    normalize: bool | None = None
    add_special_tokens: bool = True
    priority: Int64 = 0
    # Keep each input's last tokens (-1: as many as the context holds).
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=(1 << 31) - 1)] | None = None
    request_id: RequestId | None = None
    # vLLM's chat form of an embedding request, which this server does not take.
    messages: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    mm_processor_kwargs: Any = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a string or a list of token ids; 400 naming `input` when the field is
        empty, holds an empty input, mixes kinds or holds more than MAX_EMBED_INPUTS."""
        for name in ("messages", "chat_template", "chat_template_kwargs", "mm_processor_kwargs"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported: embeddings take text or token ids in input, not "
                               "chat messages", name)
        value = self.input
        if value is None:
            raise APIError(400, "input is required", "input")
        if isinstance(value, str):
            inputs: list = [value]
        elif not value:
            raise APIError(400, "input must not be empty", "input")
        elif all(isinstance(item, int) for item in value):
            inputs = [value]
        elif all(isinstance(item, str) for item in value) or all(isinstance(item, list) for item in value):
            inputs = value
        else:
            raise APIError(400, "input must be a string, a list of strings, a list of token ids or a list of "
                           "token-id lists, not a mix", "input")
        if len(inputs) > MAX_EMBED_INPUTS:
            raise APIError(400, f"input holds {len(inputs)} inputs; a request may embed at most {MAX_EMBED_INPUTS}",
                           "input")
        if any(len(item) == 0 for item in inputs):
            raise APIError(400, "input must not hold an empty string or an empty token list", "input")
        return inputs

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize)


class EmbeddingData(msgspec.Struct, kw_only=True):
    """One input's vector: a list of floats, or (`encoding_format` base64) its little-endian float32
    bytes in base64, as OpenAI sends them."""

    object: str = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
