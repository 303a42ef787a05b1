"""vLLM's /v1/score, /v1/rerank (and /rerank, /v2/rerank) and /pooling on the embedded SmolLM2 served as
an embedding model: scores are the cosine similarity of /v1/embeddings' vectors, rerank orders by them,
/pooling returns the pooled vectors; bad requests are 400s naming the field."""
from __future__ import annotations

import numpy as np
import pytest

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris."]


@pytest.fixture(scope="module")
def vectors(pooling_http):
    r = pooling_http.post("/v1/embeddings", json={"input": [QUERY, *DOCS]})
    assert r.status_code == 200, r.text
    return [np.asarray(item["embedding"]) for item in r.json()["data"]]


def cosine(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_score_is_the_cosine_of_the_embeddings(pooling_http, vectors):
    r = pooling_http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("score-") and body["usage"]["prompt_tokens"] > 0
    scores = [item["score"] for item in body["data"]]
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose(scores, [cosine(vectors[0], v) for v in vectors[1:]], rtol=1e-5, atol=1e-6)
    pairwise = pooling_http.post("/score", json={"text_1": [QUERY, DOCS[0]], "text_2": [DOCS[0], DOCS[2]]}).json()
    np.testing.assert_allclose([item["score"] for item in pairwise["data"]],
                               [cosine(vectors[0], vectors[1]), cosine(vectors[1], vectors[3])], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_by_score(pooling_http, vectors, path):
    r = pooling_http.post(path, json={"query": QUERY, "documents": DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    expected = sorted(range(3), key=lambda i: -cosine(vectors[0], vectors[i + 1]))[:2]
    assert [item["index"] for item in results] == expected
    assert [item["document"]["text"] for item in results] == [DOCS[i] for i in expected]
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]


def test_pooling_returns_the_vectors(pooling_http, vectors):
    r = pooling_http.post("/pooling", json={"input": DOCS[:2]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [item["object"] for item in data] == ["pooling", "pooling"]
    np.testing.assert_allclose(data[1]["data"], vectors[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
])
def test_bad_requests_are_400s(pooling_http, path, body, param):
    r = pooling_http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_generative_model_refuses_scoring(http):
    r = http.post("/v1/score", json={"text_1": "a", "text_2": "b"})
    assert r.status_code == 400, r.text


# Cross-encoders: a random BERT classifier with one label, each (query, document) pair run through
# transformers as `tokenizer(query, document)` (token type ids included) for the expected logits.
PAIR_QUERY = "what is the capital of france"
PAIR_DOCS = ["paris is the capital of france", "the cat sat on the mat", "a big river"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    from support.encoders import build_encoder
    from support.server import encoder_client

    folder = build_encoder("BertForSequenceClassification", tmp_path_factory.mktemp("reranker"), seed=2, num_labels=1)
    with encoder_client(folder) as client:
        yield folder, client


def pair_logits(folder, pairs) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        return np.array([model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0].item() for a, b in pairs])


@pytest.fixture(scope="module")
def logits(cross_encoder) -> np.ndarray:
    """transformers' logit of each (PAIR_QUERY, document) pair, computed once for the score and rerank tests."""
    return pair_logits(cross_encoder[0], [(PAIR_QUERY, doc) for doc in PAIR_DOCS])


def test_cross_encoder_scores_each_pair_through_the_model(cross_encoder, logits):
    folder, client = cross_encoder
    r = client.post("/v1/score", json={"text_1": PAIR_QUERY, "text_2": PAIR_DOCS})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([item["score"] for item in r.json()["data"]], 1 / (1 + np.exp(-logits)),
                               rtol=1e-5, atol=1e-6)
    raw = client.post("/score", json={"text_1": PAIR_QUERY, "text_2": PAIR_DOCS, "activation": False}).json()
    np.testing.assert_allclose([item["score"] for item in raw["data"]], logits, rtol=1e-5, atol=1e-5)
    # The pair's order matters to a cross-encoder (token types, attention over both texts at once).
    swapped = client.post("/v1/score", json={"text_1": PAIR_DOCS[0], "text_2": PAIR_QUERY}).json()
    np.testing.assert_allclose(swapped["data"][0]["score"],
                               1 / (1 + np.exp(-pair_logits(folder, [(PAIR_DOCS[0], PAIR_QUERY)])[0])), rtol=1e-5)


def test_cross_encoder_reranks_with_the_official_client_shape(cross_encoder, logits):
    _, client = cross_encoder
    r = client.post("/v1/rerank", json={"query": PAIR_QUERY, "documents": PAIR_DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [item["index"] for item in results] == list(np.argsort(-logits)[:2])
    np.testing.assert_allclose([item["relevance_score"] for item in results],
                               1 / (1 + np.exp(-np.sort(logits)[::-1][:2])), rtol=1e-5)


def test_cross_encoder_refuses_a_pair_past_the_context(cross_encoder):
    _, client = cross_encoder
    r = client.post("/v1/score", json={"text_1": PAIR_QUERY, "text_2": " ".join(["cat"] * 80)})
    assert r.status_code == 400, r.text
    assert client.post("/v1/score", json={"text_1": "dog", "text_2": "cat"}).status_code == 200
