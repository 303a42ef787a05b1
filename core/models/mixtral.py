"""Mixtral: Mistral's attention with a mixture-of-experts MLP in every layer.

The router always renormalises its top-k weights. Checkpoints name the block `block_sparse_moe`
and the expert projections w1 (gate), w3 (up) and w2 (down); they load into the same layout as
Qwen3-MoE's (`corectl.models.moe`).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from .llama import MistralForCausalLM
from .moe import SparseMoeBlock, load_moe_weights

_EXPERT_PROJ = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_PROJ_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def hf_name(name: str) -> str:
    """A Mixtral checkpoint name in the Qwen3-MoE naming the shared loader reads."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _EXPERT_PROJ.sub(lambda m: f".experts.{m[1]}.{_PROJ_NAMES[m[2]]}.", name)


class MixtralForCausalLM(MistralForCausalLM):
    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((hf_name(name), tensor) for name, tensor in weights)
        return load_moe_weights(self, renamed, self.skips_weight)
