"""`corectl plan` at tensor-parallel size 2 against the model itself built as rank 0 of two (on the meta
device, as a rank builds it): the layers tensor parallelism splits count half, and what every rank
holds whole counts whole (a vision tower, MoE routers, DeepSeek's low-rank projections), and so
do the buffers (rotary tables whole, MLA's absorbed per-head up-projections divided). Counted
as split, these configs' tower and projections put the plan 28% and 1.5% under the rank's bytes."""
from __future__ import annotations

import pytest
import torch
from corectl.distributed.parallel_state import PipelineParallel, TensorParallel, _viewed
from corectl.loaders.hf_config import lift_text_config
from corectl.models.registry import resolve_model_class
from corectl.planning_weights import planned_model, rank_share, size_weights
from corectl.worker.worker import _model_info
from transformers import LlamaConfig, Qwen2_5_VLConfig

VOCAB = 49152


def _llama():
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _qwen2_5_vl():
    # The vision tower (width 256, four blocks) outweighs the text model: counted as split it would
    # put a rank's share far under what the rank holds.
    return Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         tie_word_embeddings=False),
        vision_config=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[3]))


def _deepseek_v3():
    from transformers import DeepseekV3Config

    # kv_lora_rank 512 and q_lora_rank 256 of hidden 512: DeepSeek's replicated projections weigh.
    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=256, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=512,
                            q_lora_rank=256, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=4,
                            topk_group=2, max_position_embeddings=512, tie_word_embeddings=False)


def _held_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _buffer_bytes(model) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers())


@pytest.mark.parametrize("make_config,architecture", [
    (_llama, "LlamaForCausalLM"), (_qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration"),
    (_deepseek_v3, "DeepseekV3ForCausalLM")])
def test_a_ranks_planned_weights_are_what_rank_0_of_two_holds(make_config, architecture):
    hf = make_config()
    hf.architectures = [architecture]
    lift_text_config(hf)
    model_cls = resolve_model_class(hf)
    whole = planned_model(model_cls, hf, torch.float32, 256, None, ())
    info = _model_info(hf, whole, "float32")
    weights = size_weights(whole, info.head_dim)
    _, served, _ = rank_share(info, weights, 2)
    with _viewed(PipelineParallel(), TensorParallel(rank=0, world_size=2)):
        rank_0 = planned_model(model_cls, hf, torch.float32, 256, None, ())
    assert served == _held_bytes(rank_0)
    assert served < _held_bytes(whole)
    # Buffers: rotary tables whole on every rank, MLA's absorbed per-head up-projections divided.
    assert weights.buffer_bytes_per_rank(2) == _buffer_bytes(rank_0)
