"""Phi-3 / Phi-4 against transformers: fused qkv and gate_up checkpoints, LongRoPE (short factors
before `original_max_position_embeddings`, long ones after: decoding crosses it) with a partial
rotary factor, greedy fp32 through prefix hits and preemption."""
from __future__ import annotations

import pytest
import torch
from support.arch_parity import assert_engine_matches, save_random_model
from support.new_arch_configs import PHI3_ORIGINAL, VOCAB, phi3_config


@pytest.mark.parametrize("longrope", [True, False], ids=["longrope-partial", "default-partial"])
def test_phi3_greedy_matches_transformers(longrope, tmp_path, default_model_dir):
    hf_model = save_random_model(phi3_config(longrope), tmp_path / "phi3", default_model_dir, seed=4)
    llm = assert_engine_matches(tmp_path / "phi3", hf_model, VOCAB, variant=not longrope)
    rotary = llm.engine.executor.worker.runner.model.model.layers[0].self_attn.rotary
    assert rotary.rotary_dim == 12


def test_long_factors_change_the_model(tmp_path, default_model_dir):
    """Positions past the original length rotate differently from the short factors' extension, so
    the parity above covers the switch."""
    from transformers import AutoModelForCausalLM

    base = save_random_model(phi3_config(True), tmp_path / "phi3", default_model_dir, seed=4)
    config = phi3_config(True)
    config.rope_parameters["long_factor"] = config.rope_parameters["short_factor"]
    other = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    other.load_state_dict(base.state_dict())
    prompt = torch.arange(3, 3 + PHI3_ORIGINAL + 8)[None]
    with torch.no_grad():
        assert (other(prompt).logits[0, -1] - base(prompt).logits[0, -1]).abs().max() > 0.1
