"""A vocabulary head whose fp32 weight is exactly int8 groups, served from those groups.

A GGUF's Q8_0 embedding (the embedded SmolLM2's, tied to its head) dequantizes to q * d with int8
q and an fp16 d per 32 inputs; recovered exactly (d = max |w| / 127), the head reads 1.06 bytes a
weight instead of 4 per decode step (SmolLM2-135M: 30 MB instead of 113 MB, the largest single read of
a batch-1 step) through the grouped kernel of `corectl.quantization.int4_cpu` (fp32 products, or with
AVX512-VNNI exact ones of int16 activations), whose rows do not depend on the batch (oneDNN's fp32 GEMM
runs one row through another kernel than several). Any other head (not exactly such groups) stays as it is.
"""
from __future__ import annotations

import torch
from corectl.quantization.int4_cpu import TILE, int8_linear, kernel_library, pack_int8
from torch import nn

GROUP = 32


def exact_int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes [N, K] int8, scales [N, K/32]) that reproduce `weight` exactly, or None."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % GROUP or n % TILE:
        return None
    groups = weight.view(n, k // GROUP, GROUP)
    scales = groups.abs().amax(dim=-1) / 127
    if not torch.equal(scales.half().float(), scales):
        return None
    codes = torch.round(groups / scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1))
    if not torch.equal(codes * scales.unsqueeze(-1), groups):
        return None
    return codes.to(torch.int8).view(n, k), scales


class Int8GroupHead(nn.Module):
    def __init__(self, head: nn.Linear, codes: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        # Plain attributes, like a prepacked linear's: a serving copy of the embedding, not one of the
        # model's tensors (`corectl plan` counts those).
        self.packed_weight, self.scale_zero = pack_int8(codes, scales)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return int8_linear(hidden, self.packed_weight, self.scale_zero, GROUP)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 groups of {GROUP}"


def serve_int8_head(model: nn.Module) -> bool:
    """Swap `model.lm_head` for an `Int8GroupHead` where its weight is exactly int8 groups (and the
    kernel built); True if swapped."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or kernel_library() is None:
        return False
    exact = exact_int8_groups(head.weight.detach())
    if exact is None:
        return False
    model.lm_head = Int8GroupHead(head, *exact)
    return True
