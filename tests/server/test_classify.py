"""vLLM's POST /classify (and /v1/classify) on a random BERT sequence classifier through a real server:
each input's label (from id2label) and probabilities against transformers' logits; a classifier of
several labels cannot score pairs; models without a classification head answer 400."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from support.encoders import build_encoder
from support.server import encoder_client

TEXTS = ["the cat sat on the mat", "what is the capital of france", "rain"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    folder = build_encoder("BertForSequenceClassification", tmp_path_factory.mktemp("classifier"), seed=6,
                           num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    with encoder_client(folder) as client:
        yield folder, client


@pytest.fixture(scope="module")
def logits(classifier) -> np.ndarray:
    """transformers' logits of TEXTS, computed once for both routes."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = classifier[0]
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        return np.stack([model(**tokenizer(text, return_tensors="pt")).logits[0].numpy() for text in TEXTS])


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_classify_labels_and_probabilities(classifier, logits, path):
    _, client = classifier
    r = client.post(path, json={"input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-") and body["usage"]["prompt_tokens"] > 0
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    for i, item in enumerate(body["data"]):
        assert item["index"] == i and item["num_classes"] == 3
        assert item["label"] == LABELS[int(np.argmax(logits[i]))]
        np.testing.assert_allclose(item["probs"], probs[i], rtol=1e-5, atol=1e-6)
    for name in ("use_activation", "activation", "softmax"):  # vLLM's name, and its older ones
        raw = client.post(path, json={"input": TEXTS[0], name: False}).json()["data"][0]
        np.testing.assert_allclose(raw["probs"], logits[0], rtol=1e-5, atol=1e-5)
    disagree = client.post(path, json={"input": TEXTS[0], "use_activation": False, "activation": True})
    assert disagree.status_code == 400 and disagree.json()["error"]["param"] == "use_activation"


def test_a_multi_label_classifier_cannot_score(classifier):
    _, client = classifier
    r = client.post("/v1/score", json={"text_1": "a", "text_2": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    r = client.post("/classify", json={"input": " ".join(["cat"] * 80)})
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("fixture", ["pooling_http", "http"])
def test_models_without_a_classifier_refuse(request, fixture):
    r = request.getfixturevalue(fixture).post("/classify", json={"input": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
