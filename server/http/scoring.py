"""vLLM's scoring routes on a pooling model (`--runner pooling`): `POST /v1/score`, `POST /v1/rerank`
(also `/rerank` and `/v2/rerank`) and `POST /pooling`.

An embedding model scores a pair by the cosine similarity of the two texts' embeddings, as vLLM
does for bi-encoders: each distinct text is embedded once (one engine request, through the same
path as /v1/embeddings), then every pair is scored. A cross-encoder (a sequence classifier with one
label, e.g. bge-reranker) runs each pair through the model as one input, `tokenizer(text_1, text_2)`
(the model derives the second text's token type), and its logit is the score, through a sigmoid
unless the request sets `activation: false`, as vLLM does. A classifier of several labels cannot
score, and a generative model answers 400, as on /v1/embeddings.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated

import msgspec
import numpy as np
from corectl.pooling import MAX_EMBED_INPUTS, PoolingParams
from litestar import Controller, Request, post
from msgspec import Meta

from .auth import require_api_key
from .embedding_protocol import EmbeddingRequest
from .embeddings import _encode, _encoded, _gather
from .errors import ERROR_RESPONSES, APIError
from .generation import until_disconnected
from .protocol import Int64
from .state import ServerState

Texts = str | Annotated[list[str], Meta(max_length=MAX_EMBED_INPUTS)]


class ScoreRequest(msgspec.Struct, kw_only=True):
    """`text_1` against `text_2`: one against many, or pairwise when both are lists of one length."""

    text_1: Texts
    text_2: Texts
    model: str | None = None
    priority: Int64 = 0
    activation: bool | None = None  # a cross-encoder's sigmoid (None: on)


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: Annotated[list[str], Meta(max_length=MAX_EMBED_INPUTS)]
    model: str | None = None
    top_n: Annotated[int, Meta(ge=0)] = 0  # 0: every document
    return_documents: bool = True
    priority: Int64 = 0
    activation: bool | None = None


class PoolingRequest(EmbeddingRequest, kw_only=True):
    """POST /pooling: /v1/embeddings' request, answered with the raw pooled vectors."""


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    object: str = "score"
    score: float


class ScoreUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class PoolingData(msgspec.Struct, kw_only=True):
    index: int
    object: str = "pooling"
    data: list[float] | str


class PoolingResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: ScoreUsage


class ScoringController(Controller):
    guards = [require_api_key]
    tags = ["vLLM"]

    @post(["/v1/score", "/score"], status_code=200, responses=ERROR_RESPONSES)
    async def score(self, data: ScoreRequest, request: Request, server: ServerState) -> ScoreResponse:
        pairs = _pairs(data.text_1, data.text_2)
        scores, tokens = await _score(server, request, data.model, data.priority, pairs, "text_2", data.activation)
        return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=server.model_name,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))

    @post(["/v1/rerank", "/rerank", "/v2/rerank"], status_code=200, responses=ERROR_RESPONSES)
    async def rerank(self, data: RerankRequest, request: Request, server: ServerState) -> RerankResponse:
        if not data.documents:
            raise APIError(400, "documents must hold at least one document", "documents")
        pairs = [(data.query, document) for document in data.documents]
        scores, tokens = await _score(server, request, data.model, data.priority, pairs, "documents", data.activation)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:data.top_n or None]
        return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=server.model_name, usage=RerankUsage(tokens),
                              results=[RerankResult(index=i, relevance_score=scores[i], document=RerankDocument(
                                  data.documents[i]) if data.return_documents else None) for i in order])

    @post("/pooling", status_code=200, responses=ERROR_RESPONSES)
    async def pooling(self, data: PoolingRequest, request: Request, server: ServerState) -> PoolingResponse:
        texts = data.inputs()
        vectors, tokens = await _embed(server, request, data.model, data.priority, texts, "input",
                                       data.pooling_params())
        return PoolingResponse(id=f"pool-{uuid.uuid4().hex}", created=int(time.time()), model=server.model_name,
                               data=[PoolingData(index=i, data=_encoded(v, data.encoding_format))
                                     for i, v in enumerate(vectors)],
                               usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))


def _pairs(first: str | list[str], second: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of a list, or two lists of one length pairwise."""
    firsts = [first] if isinstance(first, str) else first
    seconds = [second] if isinstance(second, str) else second
    if not firsts or not seconds:
        raise APIError(400, "text_1 and text_2 must each hold at least one text", "text_1" if not firsts else "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise APIError(400, f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or "
                       "as many as text_2", "text_1")
    if any(not text for text in firsts + seconds):
        raise APIError(400, "texts to score must not be empty", "text_1")
    return list(zip(firsts, seconds))


async def _score(server: ServerState, request: Request, model: str | None, priority: int,
                 pairs: list[tuple[str, str]], param: str, activation: bool | None) -> tuple[list[float], int]:
    """Each pair's score and the tokens the scoring took: a cross-encoder's logit of the pair as one
    input, else the cosine of the two texts' embeddings (each distinct text embedded once)."""
    pooling = server.engine.info.pooling
    if pooling is None or pooling.task != "classify":
        texts = sorted({text for pair in pairs for text in pair})
        vectors, tokens = await _embed(server, request, model, priority, texts, param)
        index = {text: i for i, text in enumerate(texts)}
        return [_cosine(vectors[index[a]], vectors[index[b]]) for a, b in pairs], tokens
    if pooling.hidden_size != 1:
        raise APIError(400, f"this model classifies into {pooling.hidden_size} labels; scoring takes an embedding "
                       "model or a cross-encoder (one label): use /classify", "model")
    tokenizer = server.require_tokenizer(param, "texts cannot be tokenized")
    prompts = [tokenizer.hf(first, second)["input_ids"] for first, second in pairs]
    logits, tokens = await _embed(server, request, model, priority, prompts, param, PoolingParams(normalize=False))
    scores = np.array([logit[0] for logit in logits], dtype=np.float64)
    return (1 / (1 + np.exp(-scores)) if activation is not False else scores).tolist(), tokens


async def _embed(server: ServerState, request: Request, model: str | None, priority: int, texts: list[str | list[int]],
                 param: str, params: PoolingParams | None = None) -> tuple[list, int]:
    """Each text's pooled vector (one engine request each, at once) and the tokens they took."""
    server.check_accepting()
    server.check_model(model)
    server.check_priority(priority)
    tokenizer = server.require_tokenizer(param, "texts cannot be tokenized")
    prompts = [text if isinstance(text, list) else tokenizer.encode(text) for text in texts]
    params = params or PoolingParams()
    request_id = uuid.uuid4().hex
    server.begin_request()
    try:
        vectors = await until_disconnected(request.receive, lambda: _gather([
            lambda i=i, ids=ids: _encode(server, f"{request_id}-{i}", ids, None, params, priority)
            for i, ids in enumerate(prompts)]))
    finally:
        server.end_request()
    return vectors, sum(len(ids) for ids in prompts)


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))
