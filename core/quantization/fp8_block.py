"""Block-scaled FP8 checkpoints (DeepSeek V3/R1, Qwen3-FP8): e4m3 weights with one fp32 scale per
[bn, bk] block of each matrix (`weight_block_size`, 128 x 128 as they ship).

Layout. Every quantized linear's `weight` is e4m3 [N, K] and its `weight_scale_inv` fp32
[ceil(N / bn), ceil(K / bk)]: the dequantized weight is `weight * scale_inv` broadcast over each
block, the last blocks along either axis possibly partial. Both are kept as loaded (one byte a
weight, plus a scale per block). A packed layer (qkv, gate_up) stacks its shards' block rows, so
each shard must start on a block boundary of the packed matrix (its rows a multiple of bn, except
the last shard's); a rank's slice under tensor parallelism likewise (checked when the layer is
built). Experts stack the same way: `gate_up_proj_scale` [E, 2 * I_rank / bn, ceil(H / bk)] and
`down_proj_scale` [E, ceil(H / bn), ceil(I_rank / bk)].

Compute: W8A16, activations are never quantized. Where the platform provides `BLOCK_KERNEL` (a
GEMM that widens each e4m3 tile exactly, sums it in fp32 and scales the tile's sums by its block
scale) and bk is a multiple of `KERNEL_BK_MULTIPLE`, linear layers run it; elsewhere (CPU) the
torch path dequantizes the weight and multiplies in fp32. Experts dequantize each expert's
matrices where the torch MoE path reads them (`fused_moe_torch`'s `weight_block`).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn import functional as F

from ..errors import ConfigError
from .base import LinearMethod, MoEMethod, QuantAxes, tensor_bytes
from .scope import kernel

FP8 = torch.float8_e4m3fn
# The worker's block GEMM: (x [M, K], e4m3 weight [N, K], fp32 scale [ceil(N/bn), ceil(K/bk)],
# bias | None, block (bn, bk)) -> x @ dequantized(weight).T + bias in x's dtype, fp32 sums.
BLOCK_KERNEL = "fp8_block_w8a16"
# Its K tiles sit inside one scale block: bk must be a multiple of its smallest tile.
KERNEL_BK_MULTIPLE = 16
TORCH_PATH = "fp8_block_torch"


def parse_block_size(value: Any) -> tuple[int, int]:
    """`weight_block_size` as (bn, bk); ConfigError unless it is two positive integers."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ConfigError("quantization", f"weight_block_size must be two positive integers [rows, columns] "
                          f"(e.g. [128, 128]); the checkpoint has {value!r}")
    return int(value[0]), int(value[1])


def block_kernel_for(block: tuple[int, int], provided: tuple[str, ...]) -> str:
    """The kernel a block-scaled config binds to: the platform's GEMM where it takes this block, else torch."""
    return BLOCK_KERNEL if BLOCK_KERNEL in provided and block[1] % KERNEL_BK_MULTIPLE == 0 else TORCH_PATH


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 [N, K] of an e4m3 `weight` [N, K] and its block scales [ceil(N/bn), ceil(K/bk)]."""
    n, k = weight.shape
    expanded = scale.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return weight.float() * expanded


def fp8_block_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                               bias: torch.Tensor | None, block: tuple[int, int]) -> torch.Tensor:
    """`BLOCK_KERNEL`'s contract and the torch path: x @ the dequantized weight.T (+ bias), fp32 math."""
    out = F.linear(x.float(), dequantize_blocks(weight, scale, block))
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def _check_aligned(what: str, start: int, size: int, full: int, block: int) -> None:
    """A slice [start, start + size) of `full` features whose scale blocks it can keep: it starts
    on a block boundary and ends on one or at the end."""
    if start % block or (size % block and start + size != full):
        raise ConfigError("quantization", f"{what}: features {start}..{start + size} of {full} do not fall on the "
                          f"checkpoint's scale blocks of {block}; block FP8 needs each packed shard and each "
                          "tensor-parallel slice to start on a block boundary")


class Fp8BlockLinearMethod(LinearMethod):
    """One linear layer's e4m3 weight and block scales (module doc)."""

    def __init__(self, block: tuple[int, int], kernel_name: str, static_input_scales: bool = False):
        self.block, self.static_input_scales = block, static_input_scales
        self.gemm = kernel(BLOCK_KERNEL) if kernel_name == BLOCK_KERNEL else fp8_block_linear_reference

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        bn, bk = self.block
        n, k = layer.out_features, layer.in_features
        for shard_id, (offset, size, first) in (layer.shards or {}).items():
            _check_aligned(f"shard {shard_id!r}", offset, size, n, bn)
            _check_aligned(f"shard {shard_id!r} of the checkpoint", first, size, layer.full_sizes[shard_id], bn)
        _check_aligned("this rank's inputs", layer.first_input or 0, k, getattr(layer, "full_in_features", k), bk)
        layer.register_quant_param("weight", torch.empty(n, k, dtype=FP8), QuantAxes())
        scale = layer.register_quant_param("weight_scale_inv", torch.ones(_blocks(n, bn), _blocks(k, bk)),
                                           QuantAxes())
        scale.weight_loader = functools.partial(self._load_scale, layer)
        if self.static_input_scales:
            # Read past (W8A16 never quantizes activations), as the per-channel method does.
            layer.register_quant_param("input_scale", torch.ones(len(layer.full_sizes or (None,))),
                                       QuantAxes(None, 1, None, per_shard=True))

    def process_weights_after_loading(self, layer) -> None:
        if hasattr(layer, "input_scale"):
            del layer.input_scale

    def _load_scale(self, layer, param, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """This rank's blocks of a checkpoint's `weight_scale_inv` (one shard's, of a packed layer)."""
        bn, bk = self.block
        full_k = getattr(layer, "full_in_features", layer.in_features)
        offset, size, first = layer.shards[shard_id] if shard_id is not None else (0, layer.out_features, 0)
        full_n = layer.full_sizes[shard_id] if shard_id is not None else layer.out_features
        expected = (_blocks(full_n, bn), _blocks(full_k, bk))
        if tuple(loaded.shape) != expected:
            raise ConfigError("quantization", f"weight_scale_inv{f' of shard {shard_id!r}' if shard_id else ''} has "
                              f"shape {tuple(loaded.shape)}; a [{full_n}, {full_k}] weight in {bn} x {bk} blocks "
                              f"needs {expected}")
        src = loaded.narrow(0, first // bn, _blocks(size, bn))
        src = src.narrow(1, (layer.first_input or 0) // bk, _blocks(layer.in_features, bk))
        param.data.narrow(0, offset // bn, src.shape[0]).copy_(src)
        param.loaded_shards.add(shard_id)

    def served_bytes(self, layer) -> int:
        return tensor_bytes(layer.weight, layer.weight_scale_inv, layer.bias)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self.gemm(rows, layer.weight, layer.weight_scale_inv, layer.bias, self.block)
        return out.view(*x.shape[:-1], out.shape[-1])


class Fp8BlockMoEMethod(MoEMethod):
    """A mixture-of-experts layer's e4m3 experts with block scales, run by the torch MoE path."""

    unused_tensors = ("input_scale",)
    graph_capture_blocker = "its block-FP8 experts run the torch MoE path, which reads expert counts back to the host"

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        (bn, bk), e, h, rows = self.block, layer.num_experts, layer.hidden_size, layer.rows
        if layer.first_row % bn or rows % bn:
            raise ConfigError("quantization", f"the experts' gate/up rows {layer.first_row}..{layer.first_row + rows} "
                              f"(of {layer.intermediate_size}) are not whole scale blocks of {bn}: gate and up "
                              "stack their block rows, so each rank's slice must be whole blocks")
        _check_aligned("the experts' down inputs", layer.first_row, rows, layer.intermediate_size, bk)
        layer.weight_block = self.block
        layer.register_expert_param("gate_up_proj", torch.empty(e, 2 * rows, h, dtype=FP8), layer.load_gate_up)
        layer.register_expert_param("down_proj", torch.empty(e, h, rows, dtype=FP8), layer.load_down)
        layer.register_expert_param("gate_up_proj_scale", torch.ones(e, 2 * rows // bn, _blocks(h, bk)),
                                    functools.partial(self._load_gate_up_scale, layer))
        layer.register_expert_param("down_proj_scale", torch.ones(e, _blocks(h, bn), _blocks(rows, bk)),
                                    functools.partial(self._load_down_scale, layer))

    def _load_gate_up_scale(self, layer, param, loaded: torch.Tensor, proj: str, expert: int) -> None:
        (bn, bk), rows = self.block, layer.rows // self.block[0]
        self._expect(layer, loaded, (_blocks(layer.intermediate_size, bn), _blocks(layer.hidden_size, bk)), proj,
                     expert)
        offset = 0 if proj == "gate_proj" else rows
        param.data[expert].narrow(0, offset, rows).copy_(loaded.narrow(0, layer.first_row // bn, rows))

    def _load_down_scale(self, layer, param, loaded: torch.Tensor, proj: str, expert: int) -> None:
        bn, bk = self.block
        self._expect(layer, loaded, (_blocks(layer.hidden_size, bn), _blocks(layer.intermediate_size, bk)), proj,
                     expert)
        param.data[expert].copy_(loaded.narrow(1, layer.first_row // bk, param.shape[2]))

    @staticmethod
    def _expect(layer, loaded: torch.Tensor, expected: tuple[int, int], proj: str, expert: int) -> None:
        if tuple(loaded.shape) != expected:
            raise ConfigError("quantization", f"expert {expert} {proj}.weight_scale_inv has shape "
                              f"{tuple(loaded.shape)}; its weight's blocks need {expected}")

    def apply(self, layer, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return layer.run_experts(hidden, router_logits, layer.gate_up_proj_scale, layer.down_proj_scale)
