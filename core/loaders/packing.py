"""Checkpoint tensors into a model's parameters, the packed projections into their slices.

A Hugging Face checkpoint stores q, k and v (and gate, up) as separate projections; the built-in
layers pack each group into one parameter so one GEMM computes them (`PackedLinear`,
`corectl.models.parallel`). This module names that packing for every reader of checkpoint names
(the models' loaders, GGUF's per-layer tensor grouping) and imports nothing of corectl, so any
floor may use it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

# checkpoint projection -> (packed parameter, shard id): one GEMM computes q, k and v (and gate, up)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def load_packed_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                        skip: Callable[[str], bool]) -> set[str]:
    """Copy HF checkpoint tensors into `model`'s parameters, each shard of a packed projection
    (PACKED_MODULES) into its slice; `skip` names tensors the model does not hold (a tied head,
    rotary buffers). Returns the names of the parameters filled."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        target, shard_id = _packed_target(name)
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        param = params[target]
        if shard_id is None:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)
        loaded.add(target)
    return loaded


def _packed_target(name: str) -> tuple[str, str | None]:
    for proj, (packed, shard_id) in PACKED_MODULES.items():
        if f".{proj}." in name:
            return name.replace(f".{proj}.", f".{packed}."), shard_id
    return name, None
