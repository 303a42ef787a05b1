"""vLLM's scoring routes on a pooling model (`--runner pooling`): `POST /v1/score`, `POST /v1/rerank`
(also `/rerank` and `/v2/rerank`) and `POST /pooling`.

An embedding model scores a pair by the cosine similarity of the two texts' embeddings, as vLLM
does for bi-encoders: each distinct text is embedded once (one engine request, through the same
path as /v1/embeddings), then every pair is scored. A cross-encoder (a sequence classifier with one
label, e.g. bge-reranker) runs each pair through the model as one input, `tokenizer(text_1, text_2)`
(the model derives the second text's token type), and its logit is the score, through a sigmoid
unless the request sets `use_activation: false` (vLLM's older `activation` and `softmax` too), as
vLLM does. A classifier of several labels cannot score, and a generative model answers 400, as on
/v1/embeddings. `truncate_prompt_tokens` keeps each input's last tokens as on /v1/embeddings (an
input: a text to embed, or a cross-encoder's pair); Cohere's `max_tokens_per_doc` keeps each
document's first tokens before it is paired.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import msgspec
import numpy as np
from corectl.errors import InvalidRequestError
from corectl.pooling import MAX_EMBED_INPUTS, PoolingParams
from litestar import Controller, Request, post
from msgspec import Meta

from .auth import require_api_key
from .embedding_protocol import EmbeddingRequest
from .embeddings import _encode, _encoded, _gather, _token_ids, _truncated
from .errors import ERROR_RESPONSES, APIError
from .generation import until_disconnected
from .protocol import INT32_MAX, Int64, RequestId
from .request_id import request_id_for
from .state import ServerState
from .vllm_fields import check_limited_fields

Texts = str | Annotated[list[str], Meta(max_length=MAX_EMBED_INPUTS)]
# vLLM's names for the two sides of /score, its newer ones after text_1 and text_2.
PAIR_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
# Fields of vLLM's score and rerank requests (and Cohere's rerank) this server cannot honour -> why;
# one sent with anything but null gets a 400 naming it.
REFUSED_FIELDS = {
    "mm_processor_kwargs": "scoring takes text only here, so no image is processed",
    "cache_salt": "the pooling routes do not salt the prefix cache",
    "rank_fields": "documents are strings here; rank_fields picks fields of object documents",
}
# Fields with one value honoured -> (that value, why the others are not).
LIMITED_FIELDS = {
    "padding": (("do_not_pad",), "inputs are never padded"),
    "truncation_side": (("left",), "truncate_prompt_tokens keeps each input's last tokens"),
}


class ScoringFields(msgspec.Struct, kw_only=True):
    """The fields vLLM's score and rerank requests share."""

    model: str | None = None
    user: str | None = None
    priority: Int64 = 0
    request_id: RequestId | None = None
    # Each input's last tokens (-1: as many as the context holds), as on /v1/embeddings.
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    # A cross-encoder's sigmoid (None: on); `activation` and `softmax` are vLLM's older names.
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None
    padding: str | None = None
    truncation_side: str | None = None
    mm_processor_kwargs: Any = None
    cache_salt: Any = None

    def check_supported(self) -> None:
        for name, reason in REFUSED_FIELDS.items():
            if getattr(self, name, None) is not None:
                raise APIError(400, f"{name} is not supported: {reason}", name)
        check_limited_fields(self, LIMITED_FIELDS)
        activation_on(self)  # its names must agree even where no activation applies (a cosine)


def activation_on(request: Any) -> bool:
    """Whether scores or class logits go through their activation (sigmoid, softmax): the request's
    `use_activation`, or vLLM's older `activation` and `softmax`, which must agree; default on."""
    sent = {name: value for name in ("use_activation", "activation", "softmax")
            if (value := getattr(request, name)) is not None}
    if len(set(sent.values())) > 1:
        raise APIError(400, f"{' and '.join(sent)} disagree; send use_activation alone", "use_activation")
    return next(iter(sent.values()), True)


class ScoreRequest(ScoringFields, kw_only=True):
    """`text_1` against `text_2` (or vLLM's newer names, PAIR_FIELDS): one against many, or pairwise
    when both are lists of one length."""

    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None

    def sides(self) -> tuple[str, str]:
        """The names of the two fields this request sent its texts in."""
        sent = [name for name in dict.fromkeys(name for pair in PAIR_FIELDS for name in pair)
                if getattr(self, name) is not None]
        named = [pair for pair in PAIR_FIELDS if set(pair) == set(sent)]
        if named:
            return named[0]
        if len(sent) == 1:
            missing = next(b if a == sent[0] else a for a, b in PAIR_FIELDS if sent[0] in (a, b))
            raise APIError(400, f"missing required field '{missing}'", missing)
        raise APIError(400, "send the texts to score as one pair of fields: text_1 and text_2 (or vLLM's queries and "
                       f"documents, queries and items, data_1 and data_2); got {', '.join(sent) or 'none'}",
                       sent[-1] if sent else "text_1")


class RerankRequest(ScoringFields, kw_only=True):
    query: str
    documents: Annotated[list[str], Meta(max_length=MAX_EMBED_INPUTS)]
    top_n: Annotated[int, Meta(ge=0)] = 0  # 0: every document
    return_documents: bool = True
    # Cohere's: each document cut to its first that many tokens before it is scored.
    max_tokens_per_doc: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    rank_fields: Any = None


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
        data.check_supported()
        first, second = data.sides()
        pairs = _pairs(getattr(data, first), getattr(data, second), first, second)
        request_id = f"score-{request_id_for(request, data.request_id)}"
        scores, tokens = await _score(server, request, data, pairs, second, request_id)
        return ScoreResponse(id=request_id, created=int(time.time()), model=server.model_name,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))

    @post(["/v1/rerank", "/rerank", "/v2/rerank"], status_code=200, responses=ERROR_RESPONSES)
    async def rerank(self, data: RerankRequest, request: Request, server: ServerState) -> RerankResponse:
        data.check_supported()
        if not data.documents:
            raise APIError(400, "documents must hold at least one document", "documents")
        pairs = [(data.query, document) for document in _clipped(server, data.documents, data.max_tokens_per_doc)]
        request_id = f"rerank-{request_id_for(request, data.request_id)}"
        scores, tokens = await _score(server, request, data, pairs, "documents", request_id)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:data.top_n or None]
        return RerankResponse(id=request_id, model=server.model_name, usage=RerankUsage(tokens),
                              results=[RerankResult(index=i, relevance_score=scores[i], document=RerankDocument(
                                  data.documents[i]) if data.return_documents else None) for i in order])

    @post("/pooling", status_code=200, responses=ERROR_RESPONSES)
    async def pooling(self, data: PoolingRequest, request: Request, server: ServerState) -> PoolingResponse:
        prompts = [ids for _, ids in _token_ids(data, server)]
        request_id = f"pool-{request_id_for(request, data.request_id)}"
        vectors, tokens = await _embed(server, request, data.model, data.priority, prompts, "input",
                                       data.pooling_params(), request_id)
        return PoolingResponse(id=request_id, created=int(time.time()), model=server.model_name,
                               data=[PoolingData(index=i, data=_encoded(v, data.encoding_format))
                                     for i, v in enumerate(vectors)],
                               usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))


def _pairs(first: str | list[str], second: str | list[str], first_name: str,
           second_name: str) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of a list, or two lists of one length pairwise."""
    firsts = [first] if isinstance(first, str) else first
    seconds = [second] if isinstance(second, str) else second
    if not firsts or not seconds:
        raise APIError(400, f"{first_name} and {second_name} must each hold at least one text",
                       first_name if not firsts else second_name)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise APIError(400, f"{first_name} holds {len(firsts)} texts and {second_name} {len(seconds)}: give one "
                       f"{first_name}, or as many as {second_name}", first_name)
    if any(not text for text in firsts + seconds):
        raise APIError(400, "texts to score must not be empty", first_name)
    return list(zip(firsts, seconds))


def _clipped(server: ServerState, documents: list[str], limit: int | None) -> list[str]:
    """Cohere's max_tokens_per_doc: each document as the text of its first `limit` tokens."""
    if limit is None:
        return documents
    tokenizer = server.require_tokenizer("max_tokens_per_doc", "documents cannot be cut to a number of tokens")
    clipped = []
    for document in documents:
        ids = tokenizer.encode(document, add_special_tokens=False)
        clipped.append(document if len(ids) <= limit else tokenizer.decode(ids[:limit]))
    return clipped


async def _score(server: ServerState, request: Request, data: ScoringFields, pairs: list[tuple[str, str]],
                 param: str, request_id: str) -> tuple[list[float], int]:
    """Each pair's score and the tokens the scoring took: a cross-encoder's logit of the pair as one
    input, else the cosine of the two texts' embeddings (each distinct text embedded once)."""
    pooling = server.engine.info.pooling
    tokenizer = server.require_tokenizer(param, "texts cannot be tokenized")
    if pooling is None or pooling.task != "classify":
        texts = sorted({text for pair in pairs for text in pair})
        prompts = _truncated(data, server, [(None, tokenizer.encode(text)) for text in texts])
        vectors, tokens = await _embed(server, request, data.model, data.priority, [ids for _, ids in prompts],
                                       param, request_id=request_id)
        index = {text: i for i, text in enumerate(texts)}
        return [_cosine(vectors[index[a]], vectors[index[b]]) for a, b in pairs], tokens
    if pooling.hidden_size != 1:
        raise APIError(400, f"this model classifies into {pooling.hidden_size} labels; scoring takes an embedding "
                       "model or a cross-encoder (one label): use /classify", "model")
    prompts = _truncated(data, server, [(None, tokenizer.hf(first, second)["input_ids"]) for first, second in pairs])
    logits, tokens = await _embed(server, request, data.model, data.priority, [ids for _, ids in prompts], param,
                                  PoolingParams(normalize=False), request_id)
    scores = np.array([logit[0] for logit in logits], dtype=np.float64)
    return (1 / (1 + np.exp(-scores)) if activation_on(data) else scores).tolist(), tokens


async def _embed(server: ServerState, request: Request, model: str | None, priority: int, prompts: list[list[int]],
                 param: str, params: PoolingParams | None = None, request_id: str | None = None) -> tuple[list, int]:
    """Each prompt's pooled vector (one engine request each, at once) and the tokens they took; an
    input the engine refuses is named `param`, the field it came from."""
    server.check_accepting()
    server.check_model(model)
    server.check_priority(priority)
    params = params or PoolingParams()
    request_id = request_id or uuid.uuid4().hex
    server.begin_request()
    try:
        vectors = await until_disconnected(request.receive, lambda: _gather([
            lambda i=i, ids=ids: _encode(server, f"{request_id}-{i}", ids, None, params, priority)
            for i, ids in enumerate(prompts)]))
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param if exc.param == "input" else exc.param, exc.code) from None
    finally:
        server.end_request()
    return vectors, sum(len(ids) for ids in prompts)


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))
