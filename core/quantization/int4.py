"""AWQ and GPTQ 4-bit weight-only checkpoints (W4A16, groups of `group_size` inputs).

Both store unsigned 4-bit codes with a per-group scale and zero point, w = (q - z) * s, packed
eight to an int32:
  - AWQ: qweight [K, N/8] packed along the outputs in the order 0 2 4 6 1 3 5 7; qzeros
    [K/G, N/8] likewise; scales [K/G, N].
  - GPTQ (AutoGPTQ's format): qweight [K/8, N] packed along the inputs in order; qzeros [K/G, N/8]
    packed in order and stored minus one; scales [K/G, N]; g_idx [K], each input's group (with
    act-order the groups are a permutation of the inputs, not runs of G).
Loading unpacks both into codes [N, K], zeros and scales [K/G, N] and g_idx, then repacks for the
bound kernel: "w4a16" (a worker's dequantize-in-the-GEMM kernel over [K/8, N] int32 words),
"cpu_int4pack" (torch's packed int4 GEMM; act-order inputs are permuted into runs of G first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from ..errors import ConfigError
from .base import LinearMethod, QuantAxes, QuantizationConfig
from .int4_cpu import int4_linear, pack_int4
from .scope import kernel as provided_kernel

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_int32(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Pack 4-bit codes eight to an int32 along `dim` (nibble i holds element order[i] of each eight)."""
    codes = codes.to(torch.int32).movedim(dim, -1)
    grouped = codes.reshape(*codes.shape[:-1], -1, 8)[..., list(order)]
    words = (grouped << _SHIFTS).sum(dim=-1, dtype=torch.int64)
    return (words - (words >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32).movedim(-1, dim)


def unpack_int32(words: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The inverse of `pack_int32`: int32 words -> uint8 codes, eight per word along `dim`."""
    words = words.movedim(dim, -1)
    nibbles = (words.unsqueeze(-1) >> _SHIFTS) & 0xF
    codes = torch.empty_like(nibbles)
    codes[..., list(order)] = nibbles
    return codes.reshape(*words.shape[:-1], -1).movedim(-1, dim).to(torch.uint8)


def dequantize_w4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """Weight [N, K] from codes [N, K], zeros and scales [groups, N] and each input's group g_idx [K]."""
    g = g_idx.long()
    return (codes.float() - zeros[g].t().float()) * scales[g].t().float()


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    g_idx: torch.Tensor) -> torch.Tensor:
    """The "w4a16" kernel's contract, as dequantize-then-matmul: qweight [K/8, N] int32 (inputs in
    order), scales [groups, N], zeros [groups, N] (codes), g_idx [K] -> x @ W.T in x's dtype."""
    codes = unpack_int32(qweight, 0).t()
    return (x.float() @ dequantize_w4(codes, zeros, scales, g_idx).t()).to(x.dtype)


@dataclass(frozen=True)
class _W4Config(QuantizationConfig):
    kernels = ("w4a16", "cpu_int4pack")
    group_size: int = 128
    desc_act: bool = False
    ignored: tuple[str, ...] = ()

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        if any(part in name for name in layer.checkpoint_weight_names(prefix) for part in self.ignored):
            return None
        return W4LinearMethod(self)


@dataclass(frozen=True)
class AWQConfig(_W4Config):
    name = "awq"

    @classmethod
    def from_checkpoint(cls, quant_config: dict[str, Any] | None, source) -> "AWQConfig":
        qc = _require(quant_config, "awq")
        if qc.get("zero_point", True) is False or qc.get("version", "gemm").lower() != "gemm":
            raise ConfigError("quantization", "AWQ checkpoints are served in the GEMM layout with zero points; "
                              f"this one has version {qc.get('version')!r}, zero_point {qc.get('zero_point')!r}")
        return cls(group_size=int(qc.get("group_size", qc.get("q_group_size", 128))),
                   ignored=tuple(qc.get("modules_to_not_convert") or ()))


@dataclass(frozen=True)
class GPTQConfig(_W4Config):
    name = "gptq"

    @classmethod
    def from_checkpoint(cls, quant_config: dict[str, Any] | None, source) -> "GPTQConfig":
        qc = _require(quant_config, "gptq")
        if qc.get("sym") is False and qc.get("checkpoint_format", "gptq") != "gptq":
            raise ConfigError("quantization", f"GPTQ checkpoint_format {qc.get('checkpoint_format')!r} is not read")
        return cls(group_size=int(qc.get("group_size", 128)), desc_act=bool(qc.get("desc_act", False)),
                   ignored=tuple(qc.get("modules_to_not_convert") or ()))


def _require(quant_config: dict | None, name: str) -> dict:
    if quant_config is None:
        raise ConfigError("quantization", f"{name!r} serves {name.upper()} checkpoints (config.json with a "
                          "quantization_config); it does not quantize dense weights on the fly")
    bits = quant_config.get("bits", quant_config.get("w_bit", 4))
    if bits != 4:
        raise ConfigError("quantization", f"{name} checkpoints with {bits}-bit weights are not supported (4-bit are)")
    return quant_config
