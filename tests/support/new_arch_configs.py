"""Small random configs of the newer architectures (Phi-3 with partial LongRoPE, gpt-oss with sinks
and experts, Llama 4 text with chunked attention), shared by their parity tests on one device and
at tensor-parallel size 2."""
from __future__ import annotations

import torch

VOCAB = 49152
PHI3_ORIGINAL = 24  # Phi-3's original_max_position_embeddings: LongRoPE switches factors past it
LLAMA4_CHUNK = 8  # Llama 4's attention_chunk_size


def phi3_config(longrope: bool):
    from transformers import Phi3Config

    rotary_dim = 12  # head_dim 16 x 0.75
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    if longrope:
        generator = torch.Generator().manual_seed(1)
        factors = [(1.0 + 4 * torch.rand(rotary_dim // 2, generator=generator)).tolist() for _ in range(2)]
        rope = dict(rope, rope_type="longrope", short_factor=factors[0], long_factor=factors[1],
                    original_max_position_embeddings=PHI3_ORIGINAL)
    return Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      original_max_position_embeddings=PHI3_ORIGINAL, initializer_range=0.5, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, rope_parameters=rope, tie_word_embeddings=False)


def gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    return GptOssConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=512, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        swiglu_limit=1.5, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 128}), **overrides})


def randomise_sinks(model) -> None:
    """transformers initialises sinks (and biases) to zero-ish values; large ones make them matter."""
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(3 * torch.randn(layer.self_attn.sinks.shape, generator=generator))
            for bias in (layer.mlp.router.bias, layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                bias.copy_(torch.randn(bias.shape, generator=generator))


def llama4_config(**overrides):
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=LLAMA4_CHUNK, no_rope_layers=[1, 1, 1, 0], floor_scale=4,
        attn_scale=0.5, max_position_embeddings=512, initializer_range=0.5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False), **overrides})
