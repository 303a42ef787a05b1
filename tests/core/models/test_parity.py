"""Greedy parity against transformers: same tokens, chosen-token logprobs within 1e-3 (fp32).

transformers' reference for SmolLM2 is read from the folder the loader converted the GGUF into:
tests/core/loaders/test_loaders.py holds that folder's weights and config equal to those
transformers reads from the GGUF itself, which costs tens of seconds of dequantizing in Python."""
from __future__ import annotations

import pytest
import torch
from corectl import LLM, SamplingParams
from support.models import CHAT_PROMPTS, build_random_checkpoint, hf_greedy_choices

NEW_TOKENS = 32
LOGPROB_TOL = 1e-3


def _assert_parity(ours, prompt_ids, hf_model):
    got = list(ours.outputs[0].token_ids)
    assert len(got) == NEW_TOKENS
    expected, expected_lp = hf_greedy_choices(hf_model, prompt_ids, got)
    assert got == expected, f"prompt {prompt_ids[:8]}...: ours {got} vs transformers {expected}"
    got_lp = [next(iter(pos.values())).logprob for pos in ours.outputs[0].logprobs]
    assert max(abs(a - b) for a, b in zip(got_lp, expected_lp)) < LOGPROB_TOL


@pytest.fixture(scope="module")
def hf_smollm2(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def test_smollm2_gguf_chat_greedy_matches_transformers(llm_fp32, hf_smollm2):
    tok = llm_fp32.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    outputs = llm_fp32.generate(prompts, params, use_tqdm=False)
    for out, prompt_ids in zip(outputs, prompts):
        _assert_parity(out, prompt_ids, hf_smollm2)


def test_capital_of_france(llm_fp32):
    out = llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_random_weight_models_match_transformers(arch, tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM

    folder = build_random_checkpoint(arch, tmp_path / arch, default_model_dir, seed=1)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (5, 17, 40, 64)]
    for out, prompt_ids in zip(llm.generate(prompts, params, use_tqdm=False), prompts):
        _assert_parity(out, prompt_ids, hf_model)
