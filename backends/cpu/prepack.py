"""Linear layers whose weights oneDNN reorders once, at load time, instead of on every call.

`F.linear` on a CPU hands oneDNN a plain row-major weight, which it reorders into its blocked
layout on each call: decode reads and writes every weight twice more than it needs to. Measured
on 2 AVX-512 cores over SmolLM2-135M's 30 layers (weights streamed from DRAM), one bf16 decode
token's GEMMs take 25 ms plain and 11 ms prepacked; batch 16 takes 26 ms vs 16 ms. The packing
is for a batch of 1 (decode); larger batches (prefill) run on it at the plain path's speed or better.
"""
from __future__ import annotations

import functools

import torch
from torch import nn


@functools.lru_cache(maxsize=None)
def can_prepack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


class PrepackedLinear(nn.Module):
    """`nn.Linear`'s forward over a oneDNN-packed copy of its weight (an opaque tensor)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # A tensor-parallel row layer's sum over ranks (corectl.models.parallel.RowParallelLinear).
        self.reduce_output = getattr(linear, "reduce_output", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return out if self.reduce_output is None else self.reduce_output(out)

    def forward_gated(self, gate_up: torch.Tensor) -> None:
        """A swapped down projection keeps `RowParallelLinear.forward_gated`, which gated MLPs call
        when layer kernels are installed: a dense layer has no fused form (None)."""

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every `nn.Linear` of `model` for a `PrepackedLinear`; returns how many were swapped.
    A weight shared with another module (a tied lm_head) stays where it is: the packed copy is extra."""
    if not can_prepack(dtype):
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear) and getattr(child, "quant_method", None) is None
             and child.weight.dtype == dtype]
    for parent, name, child in swaps:
        setattr(parent, name, PrepackedLinear(child))
    return len(swaps)
