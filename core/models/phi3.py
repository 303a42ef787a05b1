"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama's decoder with fused checkpoint projections.

The checkpoints store q, k and v as one `qkv_proj` and gate and up as one `gate_up_proj` (rows in
that order). Our layers pack the same projections (`PackedLinear`), but each rank holds its own
heads and rows of every shard, so a fused tensor is split into its shards by row and each shard
loads through the packed layer's loader (`corectl.loaders.packing`), as separate projections do.
LongRoPE and a partial rotary factor (Phi-4-mini) live in `RotaryEmbedding`; Phi-3's
`sliding_window`, where a config sets one, applies to every layer (`sliding_window.py`).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from .llama import LlamaForCausalLM
from .pipeline import held_by_other_stage

# A fused checkpoint projection and the separate projections it holds, in row order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_NAME = re.compile(r"^(?P<module>.*)\.(?P<fused>qkv_proj|gate_up_proj)\.(?P<kind>weight|bias)$")


def split_fused(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each fused tensor as its separate projections' tensors (sized by the packed layer's full
    shard sizes); every other tensor as it is."""
    modules = dict(model.named_modules())
    for name, tensor in weights:
        match = _FUSED_NAME.match(name)
        if match is None or held_by_other_stage(model, name):  # another pipeline stage's: skipped
            yield name, tensor
            continue
        layer = modules[f"{match['module']}.{match['fused']}"]
        sizes = list(layer.full_sizes.values())
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"{name}: expected {sum(sizes)} rows ({' + '.join(map(str, sizes))}), "
                             f"checkpoint has {tuple(tensor.shape)}")
        for proj, part in zip(_FUSED[match["fused"]], tensor.split(sizes, dim=0)):
            yield f"{match['module']}.{proj}.{match['kind']}", part


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(split_fused(self, weights))
