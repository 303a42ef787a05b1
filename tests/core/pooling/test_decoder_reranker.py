"""A causal LM loaded as a decoder reranker (vLLM's `classifier_from_token`, Qwen3-Reranker style):
its logit is the LM's logit of "yes" minus that of "no" at the last position, on a small random
Qwen3 with a tied head (as Qwen3-Reranker-0.6B); the server test covers an untied one."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from corectl import LLM
from corectl.errors import ConfigError
from support.models import build_random_checkpoint

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}
ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory_gib=0.02)
PROMPTS = [[1, 15, 27, 300, 41], [9, 8, 7], [400, 401, 402, 403, 404, 405, 406]]


def yes_no_logits(folder, prompts: list[list[int]], tokens=("no", "yes")) -> np.ndarray:
    """transformers' causal LM logits of the tokens at each prompt's last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(folder).get_vocab()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return np.array([model(torch.tensor([ids])).logits[0, -1, [vocab[t] for t in tokens]].numpy()
                         for ids in prompts])


@pytest.fixture(scope="module")
def tied(tmp_path_factory, default_model_dir):
    return build_random_checkpoint("qwen3", tmp_path_factory.mktemp("reranker"), default_model_dir)


def test_two_way_softmax_logit_is_yes_minus_no(tied):
    llm = LLM(str(tied), hf_overrides=RERANKER, **ENGINE)
    assert llm.engine.pooling.task == "classify" and llm.engine.pooling.hidden_size == 1
    got = np.array([out.outputs.embedding for out in llm.embed(PROMPTS, use_tqdm=False)])
    reference = yes_no_logits(tied, PROMPTS)
    np.testing.assert_allclose(got[:, 0], reference[:, 1] - reference[:, 0], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_reranker_in_two_pipeline_stages_scores_the_same(tied):
    """The last stage, which classifies, takes the tied head's rows from the checkpoint as it loads."""
    llm = LLM(str(tied), hf_overrides=RERANKER, pipeline_parallel_size=2, **ENGINE)
    try:
        got = np.array([out.outputs.embedding for out in llm.embed(PROMPTS, use_tqdm=False)])
    finally:
        llm.engine.executor.shutdown()
    reference = yes_no_logits(tied, PROMPTS)
    np.testing.assert_allclose(got[:, 0], reference[:, 1] - reference[:, 0], rtol=1e-4, atol=1e-4)


def test_no_post_processing_keeps_one_label_per_token(tied):
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes", "a"],
                 "method": "no_post_processing"}
    llm = LLM(str(tied), hf_overrides=overrides, **ENGINE)
    got = np.array([out.outputs.embedding for out in llm.embed(PROMPTS[:1], use_tqdm=False)])
    np.testing.assert_allclose(got, yes_no_logits(tied, PROMPTS[:1], ("no", "yes", "a")), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overrides, message", [
    ({"classifier_from_token": ["no", "yes"]}, "needs method"),
    ({"classifier_from_token": ["no", "yes", "maybe"], "method": "from_2_way_softmax"}, "two tokens"),
    ({"classifier_from_token": ["no", "not-a-token-here"], "method": "from_2_way_softmax"}, "not tokens"),
])
def test_bad_classifier_tokens_are_one_clear_error(tied, overrides, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(tied), hf_overrides={"architectures": ["Qwen3ForSequenceClassification"], **overrides}, **ENGINE)
