"""vLLM's `POST /classify` (and `/v1/classify`) on a sequence classifier (`*ForSequenceClassification`
served by the pooling runner): each input's class probabilities (softmax of the head's logits; a
one-label head's sigmoid; raw logits with `activation: false`) and its most likely label, named by
the config's `id2label`. Inputs are /v1/embeddings' (text or token ids, `truncate_prompt_tokens`,
`add_special_tokens`); any other model answers 400.
"""
from __future__ import annotations

import time
import uuid

import msgspec
import numpy as np
from corectl.pooling import PoolingParams
from litestar import Controller, Request, post

from .auth import require_api_key
from .embedding_protocol import EmbeddingRequest
from .embeddings import _token_ids
from .errors import ERROR_RESPONSES, APIError
from .scoring import ScoreUsage, _embed, activation_on
from .state import ServerState


class ClassificationRequest(EmbeddingRequest, kw_only=True):
    # Softmax (sigmoid for one label), on unless `use_activation` (vLLM's older `activation`,
    # `softmax`) is false.
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None


class ClassificationData(msgspec.Struct, kw_only=True):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: ScoreUsage


class ClassifyController(Controller):
    guards = [require_api_key]
    tags = ["vLLM"]

    @post(["/classify", "/v1/classify"], status_code=200, responses=ERROR_RESPONSES)
    async def classify(self, data: ClassificationRequest, request: Request,
                       server: ServerState) -> ClassificationResponse:
        pooling = server.engine.info.pooling
        if pooling is None or pooling.task != "classify":
            raise APIError(400, "this model is not a sequence classifier: /classify takes a model served with a "
                           "classification head (a *ForSequenceClassification checkpoint)", "model")
        activation = activation_on(data)
        prompts = [ids for _, ids in _token_ids(data, server)]
        logits, tokens = await _embed(server, request, data.model, data.priority, prompts, "input",
                                      PoolingParams(normalize=False, dimensions=data.dimensions))
        results = [_classified(i, np.asarray(row, dtype=np.float64), pooling.labels, activation)
                   for i, row in enumerate(logits)]
        return ClassificationResponse(id=f"classify-{uuid.uuid4().hex}", created=int(time.time()),
                                      model=server.model_name, data=results,
                                      usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))


def _classified(index: int, logits: np.ndarray, labels: tuple[str, ...], activation: bool) -> ClassificationData:
    if not activation:
        probs = logits
    elif len(logits) == 1:
        probs = 1 / (1 + np.exp(-logits))
    else:
        shifted = np.exp(logits - logits.max())
        probs = shifted / shifted.sum()
    return ClassificationData(index=index, label=labels[int(np.argmax(logits))], probs=probs.tolist(),
                              num_classes=len(logits))
