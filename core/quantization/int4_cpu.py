"""Groups of affine int4 weights on CPUs, through torch's packed int4 GEMM.

`torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K], packed, group, scale_zero [K/g, N, 2])`
computes x @ W.T with W[n, k] = (q[n, k] - 8) * scale + zero of k's group (checked against the
dequantized weights in tests/core/quantization). `_convert_weight_to_int4pack_for_cpu` takes the
codes as int32 [N, K]. In torch 2.13 the kernel is vectorised for bf16 activations only; fp32
activations take a scalar path measured 20-50x slower at SmolLM2's shapes, so activations are
cast to bf16 around the GEMM whatever the model's dtype. The packed weight is [N, K/2] uint8
(two codes a byte).
"""
from __future__ import annotations

import torch

ACT_DTYPE = torch.bfloat16


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros_at_8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scale_zero) from codes [N, K] in [0, 16), per-group scales [N, K/g] and
    the weight value at code 8 per group [N, K/g]."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scale_zero = torch.stack([scales.t(), zeros_at_8.t()], dim=-1).to(ACT_DTYPE).contiguous()
    return packed, scale_zero


def register_int4pack(layer: torch.nn.Module, codes: torch.Tensor, scales: torch.Tensor,
                      zeros_at_8: torch.Tensor) -> None:
    """Pack (as `pack_int4`) and keep the result as the layer's buffers `packed_weight` and
    `scale_zero`: buffers, so the model's tensors count them (`corectl plan` compares), but
    left out of state dicts (the checkpoint holds another layout)."""
    packed, scale_zero = pack_int4(codes, scales, zeros_at_8)
    layer.register_buffer("packed_weight", packed, persistent=False)
    layer.register_buffer("scale_zero", scale_zero, persistent=False)


def int4pack_bytes(out_features: int, in_features: int, group: int) -> int:
    """Bytes `pack_int4` returns for an [N, K] weight in groups of `group` inputs: two codes a
    byte, and a (scale, zero) pair in ACT_DTYPE per group and output."""
    return out_features * in_features // 2 + in_features // group * out_features * 2 * ACT_DTYPE.itemsize


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).to(ACT_DTYPE)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group, scale_zero).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1])
