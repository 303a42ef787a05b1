"""`rtn_int4`: weight-only 4-bit round-to-nearest, made at load time from a dense checkpoint.

Each weight row is cut into groups of 32 inputs; a group's codes 0..15 span its min..max, and the
layer runs corectl's packed int4 CPU GEMM (kernel "cpu_int4pack", which the built-in CPU platform
lists). A quantization method is a frozen `QuantizationConfig` dataclass (which layers get which
`LinearMethod`) and the method itself (parameters, loading, repacking, apply).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from corectl.quantization import LinearMethod, QuantAxes, QuantizationConfig, tensor_bytes
from corectl.quantization.int4_cpu import int4_linear, int4pack_bytes, register_int4pack

GROUP = 32


def rtn_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] in 0..15, scales [N, K/32], mins [N, K/32]): weight ~= codes * scale + min."""
    groups = weight.float().reshape(weight.shape[0], -1, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    codes = ((groups - lo.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, 15)
    return codes.reshape(weight.shape).to(torch.uint8), scales, lo


def rtn_int4_dequantized(weight: torch.Tensor) -> torch.Tensor:
    codes, scales, mins = rtn_int4(weight)
    return codes.float() * scales.repeat_interleave(GROUP, 1) + mins.repeat_interleave(GROUP, 1)


@dataclass(frozen=True)
class RTNInt4Config(QuantizationConfig):
    name = "rtn_int4"
    kernels = ("cpu_int4pack",)

    @classmethod
    def from_checkpoint(cls, quant_config, source) -> "RTNInt4Config":
        return cls()

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        return RTNInt4Method() if layer.in_features % GROUP == 0 else None


class RTNInt4Method(LinearMethod):
    def create_weights(self, layer, dtype: torch.dtype) -> None:
        # The dense weight loads as usual (each rank's slice); it is quantized after loading.
        layer.register_quant_param("weight", torch.empty(layer.out_features, layer.in_features, dtype=dtype),
                                   QuantAxes())

    def process_weights_after_loading(self, layer) -> None:
        codes, scales, mins = rtn_int4(layer.weight.data)
        del layer.weight
        register_int4pack(layer, codes, scales, mins + 8 * scales)

    def served_bytes(self, layer) -> int:
        # Loaded dense, served packed: what `corectl plan` counts for the layer.
        return int4pack_bytes(layer.out_features, layer.in_features, GROUP) + tensor_bytes(layer.bias)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, layer.packed_weight, layer.scale_zero, GROUP, layer.bias)
