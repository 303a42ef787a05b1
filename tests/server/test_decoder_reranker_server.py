"""A decoder reranker served as vLLM serves Qwen3-Reranker (`--hf-overrides` with `classifier_from_token`):
/v1/score, /score and /rerank give each pair the sigmoid of the LM's "yes" minus "no" logit at the
pair's last token, checked against transformers on a small random Qwen3 with an untied LM head."""
from __future__ import annotations

import json

import numpy as np
import pytest
from support.models import build_random_checkpoint
from support.server import encoder_client

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}
QUERY = "Which city is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel tower is in Paris."]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, default_model_dir):
    folder = build_random_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3-reranker"), default_model_dir,
                                     tie_word_embeddings=False)
    with encoder_client(folder, "--hf-overrides", json.dumps(RERANKER)) as client:
        yield folder, client


def reference_scores(folder, pairs) -> np.ndarray:
    """sigmoid(logit(yes) - logit(no)) of transformers' Qwen3ForCausalLM at each pair's last token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    no, yes = (tokenizer.get_vocab()[token] for token in ("no", "yes"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = [model(torch.tensor([tokenizer(a, b)["input_ids"]])).logits[0, -1] for a, b in pairs]
    return np.array([torch.sigmoid(lg[yes] - lg[no]).item() for lg in logits])


def test_score_and_rerank_match_the_lm_yes_no_logits(reranker):
    folder, client = reranker
    want = reference_scores(folder, [(QUERY, doc) for doc in DOCS])
    scored = client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS})
    assert scored.status_code == 200, scored.text
    np.testing.assert_allclose([item["score"] for item in scored.json()["data"]], want, rtol=1e-4, atol=1e-5)
    reranked = client.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()["results"]
    assert [r["index"] for r in reranked] == list(np.argsort(-want)[:2])
    np.testing.assert_allclose([r["relevance_score"] for r in reranked], np.sort(want)[::-1][:2], rtol=1e-4, atol=1e-5)
