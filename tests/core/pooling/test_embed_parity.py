"""Pooled embeddings against transformers (`AutoModel` hidden states pooled the same way), fp32.

Prompts of mixed lengths run as one batch under a 32-token step budget, so the longer ones are
pooled across chunks (MEAN sums every chunk, CLS keeps the first chunk's row)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from corectl import LLM, PoolingParams
from corectl.errors import InvalidRequestError
from support.models import build_random_checkpoint

TOL = 1e-5
LENGTHS = (5, 17, 40, 64, 100)
CHUNK = 32


def _prompts(seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in LENGTHS]


def reference(hf_model, prompt_ids: list[int], pooling_type: str, normalize: bool = True) -> np.ndarray:
    with torch.no_grad():
        hidden = hf_model(torch.tensor([prompt_ids])).last_hidden_state[0]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.numpy()


def assert_close(outputs, expected: list[np.ndarray]) -> None:
    assert len(outputs) == len(expected)
    for out, want in zip(outputs, expected):
        got = np.array(out.outputs.embedding, dtype=np.float32)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, default_model_dir):
    from transformers import AutoModel

    folder = build_random_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3") / "qwen3", default_model_dir, seed=1)
    return folder, AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_random_qwen3_pooled_like_transformers(qwen3, pooling_type):
    folder, hf_model = qwen3
    llm = LLM(str(folder), runner="pooling", pooling_type=pooling_type, dtype="float32", kv_cache_memory_gib=0.05,
              max_num_batched_tokens=CHUNK)
    prompts = _prompts()
    assert_close(llm.embed(prompts, use_tqdm=False), [reference(hf_model, p, pooling_type) for p in prompts])
    # One at a time (no batch neighbours), unnormalised: the raw pooled hidden state.
    raw = llm.embed(prompts[3], PoolingParams(normalize=False), use_tqdm=False)
    assert_close(raw, [reference(hf_model, prompts[3], pooling_type, normalize=False)])


def test_async_scheduling_and_prefix_hits_pool_the_same(qwen3):
    """LAST pooling keeps prefix caching: a repeated prompt hits its cached blocks and pools the same."""
    folder, hf_model = qwen3
    llm = LLM(str(folder), runner="pooling", dtype="float32", kv_cache_memory_gib=0.05,
              max_num_batched_tokens=CHUNK, async_scheduling=True)
    prompts = _prompts(seed=4)
    expected = [reference(hf_model, p, "LAST") for p in prompts]
    assert_close(llm.embed(prompts, use_tqdm=False), expected)
    again = llm.embed(prompts, use_tqdm=False)
    assert_close(again, expected)
    assert again[-1].num_cached_tokens >= 96
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_usable_blocks


def test_sentence_transformers_backbone_checkpoint(tmp_path, default_model_dir):
    """A bare backbone (`Qwen3Model`, weights without `model.` and no LM head) with sentence-transformers
    modules runs as a pooling model on its own: MEAN pooling from 1_Pooling, normalised by its Normalize module."""
    from transformers import AutoModel, Qwen3Config

    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         initializer_range=0.5)
    torch.manual_seed(2)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    hf_model = AutoModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=CHUNK)
    assert llm.engine.info.pooling.pooling_type == "MEAN" and llm.engine.info.pooling.normalize
    assert not llm.engine.config.enable_prefix_caching  # MEAN needs every token's hidden state
    prompts = _prompts(seed=5)
    assert_close(llm.embed(prompts, use_tqdm=False), [reference(hf_model, p, "MEAN") for p in prompts])


def test_smollm2_gguf_mean_pooled_like_transformers(default_model_dir):
    """The embedded GGUF as a pooling model, against transformers on its converted weights."""
    from transformers import AutoModel

    hf_model = AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    llm = LLM(runner="embed", pooling_type="mean", dtype="float32", max_model_len=256, kv_cache_memory_gib=0.05,
              max_num_batched_tokens=CHUNK)
    texts = ["Paris is the capital of France.", "A haiku about the sea, " * 8]
    outputs = llm.embed(texts, use_tqdm=False)
    assert_close(outputs, [reference(hf_model, out.prompt_token_ids, "MEAN") for out in outputs])
    assert len(outputs[1].prompt_token_ids) > CHUNK


def test_matryoshka_dimensions(qwen3):
    folder, hf_model = qwen3
    llm = LLM(str(folder), runner="pooling", dtype="float32", kv_cache_memory_gib=0.05,
              hf_overrides={"matryoshka_dimensions": [16, 32]})
    prompt = _prompts()[1]
    full = torch.from_numpy(reference(hf_model, prompt, "LAST", normalize=False))
    want = torch.nn.functional.normalize(full[:16], dim=0).numpy()
    assert_close(llm.embed(prompt, PoolingParams(dimensions=16), use_tqdm=False), [want])
    with pytest.raises(InvalidRequestError) as info:
        llm.embed(prompt, PoolingParams(dimensions=20), use_tqdm=False)
    assert info.value.param == "dimensions"


def test_pooling_and_generation_refuse_each_other(qwen3, llm_int4):
    folder, _ = qwen3
    pooling = LLM(str(folder), runner="pooling", dtype="float32", kv_cache_memory_gib=0.05)
    with pytest.raises(InvalidRequestError, match="pooling model"):
        pooling.generate([[5, 6, 7]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="matryoshka"):
        pooling.embed([[5, 6, 7]], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="context length") as info:
        pooling.embed([[5] * 513], use_tqdm=False)
    assert info.value.code == "context_length_exceeded"
    assert len(pooling.embed([[5] * 512], use_tqdm=False)[0].outputs.embedding) == 64  # the whole context
    with pytest.raises(InvalidRequestError, match="makes no embeddings"):
        llm_int4.embed("hello", use_tqdm=False)


@pytest.mark.slow
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_two_ranks_pool_like_transformers(qwen3, split):
    """Two ranks (mp executor, gloo): each holds half the heads, rank 0's vectors coming back; or two
    pipeline stages, the last summing (MEAN) the rows of each chunk it gets from the first."""
    folder, hf_model = qwen3
    llm = LLM(str(folder), runner="pooling", pooling_type="MEAN", dtype="float32", kv_cache_memory_gib=0.05,
              max_num_batched_tokens=CHUNK, **split)
    try:
        prompts = _prompts(seed=6)
        assert_close(llm.embed(prompts, use_tqdm=False), [reference(hf_model, p, "MEAN") for p in prompts])
    finally:
        llm.engine.executor.shutdown()
