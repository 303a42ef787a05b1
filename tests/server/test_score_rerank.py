"""vLLM's /v1/score, /v1/rerank (and /rerank, /v2/rerank) and /pooling on the embedded SmolLM2 served as
an embedding model: scores are the cosine similarity of /v1/embeddings' vectors, rerank orders by them,
/pooling returns the pooled vectors; vLLM's other names for score's texts, truncate_prompt_tokens,
use_activation (and its older names), Cohere's max_tokens_per_doc; every other field of vLLM's score
and rerank requests is refused by name, as are bad requests."""
from __future__ import annotations

import uuid

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


@pytest.mark.parametrize("first,second", [("queries", "documents"), ("queries", "items"), ("data_1", "data_2")])
def test_score_takes_vllms_newer_names(pooling_http, vectors, first, second):
    r = pooling_http.post("/v1/score", json={first: QUERY, second: DOCS})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([item["score"] for item in r.json()["data"]],
                               [cosine(vectors[0], v) for v in vectors[1:]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("body,param", [
    ({"text_1": "a"}, "text_2"), ({"queries": "a", "text_2": "b"}, "queries"),
    ({"queries": "a", "documents": ["b"], "items": ["c"]}, "items"),
])
def test_score_needs_one_pair_of_names(pooling_http, body, param):
    r = pooling_http.post("/v1/score", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_truncate_prompt_tokens_keeps_each_texts_last_tokens_as_embeddings_does(pooling_http, vectors):
    keep = {"truncate_prompt_tokens": 3}
    r = pooling_http.post("/v1/embeddings", json={"input": [QUERY, *DOCS], **keep})
    cut = [np.asarray(item["embedding"]) for item in r.json()["data"]]
    assert not np.allclose(cut[1], vectors[1])
    scored = pooling_http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS, **keep}).json()
    np.testing.assert_allclose([item["score"] for item in scored["data"]], [cosine(cut[0], v) for v in cut[1:]],
                               rtol=1e-5, atol=1e-6)
    assert scored["usage"]["prompt_tokens"] == 3 * 4
    reranked = pooling_http.post("/rerank", json={"query": QUERY, "documents": DOCS, **keep}).json()
    assert sorted(r["relevance_score"] for r in reranked["results"]) == pytest.approx(
        sorted(cosine(cut[0], v) for v in cut[1:]), rel=1e-5)
    pooled = pooling_http.post("/pooling", json={"input": DOCS[:2], **keep}).json()
    np.testing.assert_allclose(pooled["data"][1]["data"], cut[2], rtol=1e-5, atol=1e-6)


def test_request_id_names_the_work(pooling_http):
    rid = f"mine-{uuid.uuid4().hex}"
    r = pooling_http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS[0], "request_id": rid})
    assert r.json()["id"] == f"score-{rid}" and r.headers["x-request-id"] == rid
    r = pooling_http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "request_id": rid})
    assert r.json()["id"] == f"rerank-{rid}"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/score", {"mm_processor_kwargs": {"do_resize": False}}, "mm_processor_kwargs"),
    ("/v1/score", {"cache_salt": "tenant-1"}, "cache_salt"),
    ("/v1/score", {"padding": "max_length"}, "padding"),
    ("/v1/score", {"truncation_side": "right"}, "truncation_side"),
    ("/v1/score", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v2/rerank", {"rank_fields": ["text"]}, "rank_fields"),
    ("/v2/rerank", {"max_tokens_per_doc": 0}, "max_tokens_per_doc"),
])
def test_fields_it_cannot_honour_are_400s(pooling_http, path, body, param):
    texts = {"text_1": QUERY, "text_2": DOCS} if "score" in path else {"query": QUERY, "documents": DOCS}
    r = pooling_http.post(path, json={**texts, **body})
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
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_2", r.text
    assert client.post("/v1/score", json={"text_1": "dog", "text_2": "cat"}).status_code == 200


def test_cross_encoder_use_activation_and_its_older_names(cross_encoder, logits):
    _, client = cross_encoder
    for name in ("use_activation", "activation", "softmax"):
        raw = client.post("/score", json={"text_1": PAIR_QUERY, "text_2": PAIR_DOCS, name: False}).json()
        np.testing.assert_allclose([item["score"] for item in raw["data"]], logits, rtol=1e-5, atol=1e-5)
    r = client.post("/score", json={"text_1": PAIR_QUERY, "text_2": PAIR_DOCS, "use_activation": True,
                                    "softmax": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_activation", r.text


def test_cross_encoder_truncate_prompt_tokens_keeps_each_pairs_last_tokens(cross_encoder, logits):
    """A pair is one input: its last k tokens run (k keeping the first separator, so the model's token
    types match transformers' on the same slice)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder, client = cross_encoder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    keep = max(len(tokenizer(doc, add_special_tokens=False)["input_ids"]) for doc in PAIR_DOCS) + 3
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    pairs = [tokenizer(PAIR_QUERY, doc, return_tensors="pt") for doc in PAIR_DOCS]
    with torch.no_grad():
        want = np.array([model(**{k: v[:, -keep:] for k, v in pair.items()}).logits[0, 0].item() for pair in pairs])
    r = client.post("/v1/rerank", json={"query": PAIR_QUERY, "documents": PAIR_DOCS, "truncate_prompt_tokens": keep,
                                        "use_activation": False})
    assert r.status_code == 200, r.text
    got = {item["index"]: item["relevance_score"] for item in r.json()["results"]}
    np.testing.assert_allclose([got[i] for i in range(3)], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(want, logits) and r.json()["usage"]["total_tokens"] == 3 * keep


def test_cross_encoder_max_tokens_per_doc_scores_each_documents_first_tokens(cross_encoder, logits):
    from transformers import AutoTokenizer

    folder, client = cross_encoder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    clipped = [tokenizer.decode(tokenizer(doc, add_special_tokens=False)["input_ids"][:2]) for doc in PAIR_DOCS]
    want = pair_logits(folder, [(PAIR_QUERY, doc) for doc in clipped])
    r = client.post("/v2/rerank", json={"query": PAIR_QUERY, "documents": PAIR_DOCS, "max_tokens_per_doc": 2,
                                        "use_activation": False})
    assert r.status_code == 200, r.text
    results = {item["index"]: item for item in r.json()["results"]}
    np.testing.assert_allclose([results[i]["relevance_score"] for i in range(3)], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(want, logits)
    assert [results[i]["document"]["text"] for i in range(3)] == PAIR_DOCS  # the documents as sent
