"""Mixture-of-experts models against transformers: greedy fp32 tokens equal for 16 tokens on 8 prompts.

Tiny random-weight Qwen3-MoE and Mixtral checkpoints (8 experts, top 2, 2 layers) saved by
transformers in the per-expert layout real checkpoints use, so the loader's stacking is covered.
"""
from __future__ import annotations

import pytest
import torch
from corectl import LLM, SamplingParams
from support.models import build_random_checkpoint, hf_greedy

NEW_TOKENS = 16
LOGPROB_TOL = 1e-3

CASES = {
    # Every layer sparse, top-k weights not renormalised (Qwen3-MoE's norm_topk_prob=False).
    "qwen3-moe": ("qwen3_moe", {}),
    # Renormalised, and layer 0 dense (mlp_only_layers): the dense and sparse layers mix.
    "qwen3-moe-norm-dense0": ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": [0]}),
    "mixtral": ("mixtral", {}),
}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (3, 9, 17, 24, 33, 40, 51, 64)]


@pytest.mark.parametrize("case", list(CASES))
def test_moe_greedy_matches_transformers(case, tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM

    arch, overrides = CASES[case]
    folder = build_random_checkpoint(arch, tmp_path / case, default_model_dir, seed=2, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    batch = prompts()
    for out, prompt_ids in zip(llm.generate(batch, params, use_tqdm=False), batch):
        expected, expected_lp = hf_greedy(hf_model, prompt_ids, NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt_ids)} tokens"
        got_lp = [next(iter(pos.values())).logprob for pos in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got_lp, expected_lp)) < LOGPROB_TOL
