"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with mixture-of-experts MLPs.

Layer i is sparse unless it is listed in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step`; dense layers keep a gated MLP of `intermediate_size`. No shared expert.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .llama import GatedMLP
from .moe import SparseMoeBlock, load_moe_weights
from .qwen import Qwen3ForCausalLM


def is_sparse_layer(config, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return GatedMLP(config)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(getattr(config, "norm_topk_prob", False)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_moe_weights(self, weights, self.skips_weight)
