"""Phi-3 / Phi-4 against transformers: fused qkv and gate_up checkpoints, LongRoPE (short factors
before `original_max_position_embeddings`, long ones after: decoding crosses it) with a partial
rotary factor, greedy fp32 through prefix hits and preemption."""
from __future__ import annotations

import pytest
import torch
from support.arch_parity import assert_engine_matches, save_random_model

VOCAB = 49152
ORIGINAL = 24


def _config(longrope: bool):
    from transformers import Phi3Config

    rotary_dim = 12  # head_dim 16 x 0.75
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    if longrope:
        generator = torch.Generator().manual_seed(1)
        factors = [(1.0 + 4 * torch.rand(rotary_dim // 2, generator=generator)).tolist() for _ in range(2)]
        rope = dict(rope, rope_type="longrope", short_factor=factors[0], long_factor=factors[1],
                    original_max_position_embeddings=ORIGINAL)
    return Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      original_max_position_embeddings=ORIGINAL, initializer_range=0.5, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, rope_parameters=rope, tie_word_embeddings=False)


@pytest.mark.parametrize("longrope", [True, False], ids=["longrope-partial", "default-partial"])
def test_phi3_greedy_matches_transformers(longrope, tmp_path, default_model_dir):
    hf_model = save_random_model(_config(longrope), tmp_path / "phi3", default_model_dir, seed=4)
    llm = assert_engine_matches(tmp_path / "phi3", hf_model, VOCAB, variant=not longrope)
    rotary = llm.engine.executor.worker.runner.model.model.layers[0].self_attn.rotary
    assert rotary.rotary_dim == 12


def test_long_factors_change_the_model(tmp_path, default_model_dir):
    """Positions past the original length rotate differently from the short factors' extension, so
    the parity above covers the switch."""
    from transformers import AutoModelForCausalLM

    base = save_random_model(_config(True), tmp_path / "phi3", default_model_dir, seed=4)
    config = _config(True)
    config.rope_parameters["long_factor"] = config.rope_parameters["short_factor"]
    other = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    other.load_state_dict(base.state_dict())
    prompt = torch.arange(3, 3 + ORIGINAL + 8)[None]
    with torch.no_grad():
        assert (other(prompt).logits[0, -1] - base(prompt).logits[0, -1]).abs().max() > 0.1
