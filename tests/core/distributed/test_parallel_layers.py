"""Each rank's parallel layers hold and load exactly their slice of a checkpoint tensor.

The layers take their layout from the tensor-parallel state when built; these tests build every
rank's layers in turn under that rank's state (no collective runs: nothing is called forward) and
check that the slices have 1/N of the rows and together rebuild the checkpoint tensor.
"""
from __future__ import annotations

import pytest
import torch
from corectl.distributed import TensorParallel, parallel_state, shard_range
from corectl.errors import ConfigError
from corectl.loaders.packing import load_packed_weights
from corectl.models.llama import LlamaForCausalLM
from corectl.models.parallel import (
    PackedLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_tensor_parallel,
)
from transformers import LlamaConfig


def build_as(rank: int, world_size: int, make):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallel_state, "_state", TensorParallel(rank, world_size))
        return make()


def test_shard_range_splits_evenly_and_shares_scarce_units():
    assert [shard_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # 2 KV heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1.
    assert [shard_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError):
        shard_range(6, 0, 4)


@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_qkv_holds_its_heads_and_replicates_scarce_kv_heads(world_size):
    head_dim, heads, kv_heads, hidden = 4, 4, 2, 8
    full = {"q": torch.randn(heads * head_dim, hidden), "k": torch.randn(kv_heads * head_dim, hidden),
            "v": torch.randn(kv_heads * head_dim, hidden)}
    sizes = {name: t.shape[0] for name, t in full.items()}
    ranks = [build_as(r, world_size, lambda: PackedLinear(hidden, sizes, bias=False, unit=head_dim))
             for r in range(world_size)]
    for layer in ranks:
        for name, tensor in full.items():
            layer.weight.weight_loader(layer.weight, tensor, name)
    q_rows = heads * head_dim // world_size
    kv_rows = max(1, kv_heads // world_size) * head_dim
    assert all(layer.weight.shape == (q_rows + 2 * kv_rows, hidden) for layer in ranks)
    assert torch.equal(torch.cat([layer.weight[:q_rows] for layer in ranks]), full["q"])
    kv_heads_held = [layer.weight[q_rows:q_rows + kv_rows] for layer in ranks]
    per_head = world_size // kv_heads if world_size > kv_heads else 1
    # Consecutive ranks share a KV head when there are more ranks than KV heads.
    assert torch.equal(torch.cat(kv_heads_held[::per_head]), full["k"])


def test_row_parallel_splits_inputs_and_keeps_the_bias_on_rank_zero():
    weight, bias = torch.randn(6, 8), torch.randn(6)
    ranks = [build_as(r, 2, lambda: RowParallelLinear(8, 6, bias=True)) for r in range(2)]
    for layer in ranks:
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
    assert [layer.weight.shape for layer in ranks] == [(6, 4), (6, 4)]
    assert torch.equal(torch.cat([layer.weight for layer in ranks], dim=1), weight)
    assert torch.equal(ranks[0].bias, bias) and not ranks[1].bias.any()
    # The partial products summed (what the all-reduce does) equal the whole layer.
    x = torch.randn(3, 8)
    total = sum(torch.nn.functional.linear(x[:, 4 * r:4 * r + 4], layer.weight, layer.bias)
                for r, layer in enumerate(ranks))
    torch.testing.assert_close(total, torch.nn.functional.linear(x, weight, bias))


def test_vocab_layers_split_the_vocabulary_and_pad_the_last_range():
    vocab, hidden = 11, 4
    table = torch.randn(vocab, hidden)
    for make in (lambda: VocabParallelEmbedding(vocab, hidden), lambda: ParallelLMHead(hidden, vocab)):
        ranks = [build_as(r, 2, make) for r in range(2)]
        for layer in ranks:
            layer.weight.weight_loader(layer.weight, table)
        assert [layer.weight.shape[0] for layer in ranks] == [6, 6]
        assert torch.equal(torch.cat([layer.weight for layer in ranks])[:vocab], table)
        assert not ranks[1].weight[5:].any()


def test_a_rank_holds_half_of_every_split_weight_of_a_llama():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    full = LlamaForCausalLM(config, max_positions=16, dtype=torch.float32)
    checkpoint = {name.replace("qkv_proj", "q_proj"): p for name, p in full.named_parameters()
                  if "qkv" not in name and "gate_up" not in name}
    half = build_as(1, 2, lambda: LlamaForCausalLM(config, max_positions=16, dtype=torch.float32))
    held = dict(half.named_parameters())
    for name, param in full.named_parameters():
        replicated = name.endswith("norm.weight")
        assert held[name].numel() == (param.numel() if replicated else param.numel() // 2), name
    # The loader path reaches the slices through each parameter's weight_loader.
    with torch.no_grad():
        filled = load_packed_weights(half, checkpoint.items(), lambda name: False)
    assert "model.layers.0.self_attn.o_proj.weight" in filled
    torch.testing.assert_close(held["model.layers.0.self_attn.o_proj.weight"],
                               full.get_parameter("model.layers.0.self_attn.o_proj.weight")[:, 16:])


def test_sizes_that_do_not_split_the_model_are_refused_at_startup():
    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96)
    check_tensor_parallel(config, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size: 4 does not divide its 6 attention heads"):
        check_tensor_parallel(config, 4)
    with pytest.raises(ConfigError, match="KV heads"):
        check_tensor_parallel(config, 3)
