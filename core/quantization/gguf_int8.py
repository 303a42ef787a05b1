"""GGUF layers served as int8 groups (Q8_0, Q6_K, and int4 types mixed with them) through the
worker's "w8a16" kernel: codes [N, K] int8 as loaded, a scale (and, where a member type has one,
an offset) per group of 16 or 32 inputs and output, [N, K / group]."""
from __future__ import annotations

import functools

import torch

from ..errors import ConfigError
from ..loaders.gguf_blocks import Int8Groups, dequantize_groups
from .base import LinearMethod, QuantAxes, tensor_bytes
from .scope import kernel as provided_kernel


def w8a16_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                    group: int) -> torch.Tensor:
    """The "w8a16" kernel's contract, as dequantize-then-matmul in fp32: x [M, K] @ W.T, W[n, k] =
    codes[n, k] * scales[n, k // group] + offsets[n, k // group] (None: 0), in x's dtype."""
    return (x.float() @ dequantize_groups(codes, scales, offsets, group).t()).to(x.dtype)


class GGUFInt8Method(LinearMethod):
    """Codes (the `weight` the checkpoint fills), scales and, with `offsets`, mins while loading;
    the same tensors, renamed, for the kernel after."""

    def __init__(self, group: int, offsets: bool):
        self.group, self.offsets = group, offsets
        self.gemm = provided_kernel("w8a16")

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.out_features, layer.in_features
        if k % self.group:
            raise ConfigError("model", f"{k} input features do not split into GGUF groups of {self.group}")
        layer.register_quant_param("weight", torch.zeros(n, k, dtype=torch.int8), QuantAxes(0, 1, 1, 1))
        # Scales and offsets in fp16 for half-precision models, as the int4 layers keep them: the
        # file's own precision for d (Q8_0 exact; Q6_K's d*sc products within 2**-12).
        group_dtype = torch.float32 if dtype == torch.float32 else torch.float16
        for name in ("group_scales", "group_mins") if self.offsets else ("group_scales",):
            buffer = torch.zeros(n, k // self.group, dtype=group_dtype)
            buffer.quant_axes, buffer.loaded_shards = QuantAxes(0, 1, 1, self.group), set()
            layer.register_buffer(name, buffer)
        layer.weight.weight_loader = functools.partial(self._load, layer)

    def _load(self, layer, param, loaded: Int8Groups, shard_id: str | None = None) -> None:
        if not isinstance(loaded, Int8Groups):
            raise ValueError("a GGUF int8 layer loads int8 groups (corectl.loaders.gguf_weights), not a tensor")
        layer.load_sliced(param, loaded.codes, shard_id)
        layer.load_sliced(layer.group_scales, loaded.scales, shard_id)
        if self.offsets:
            layer.load_sliced(layer.group_mins, loaded.mins, shard_id)

    def process_weights_after_loading(self, layer) -> None:
        served = {"w8_codes": layer.weight.data, "w8_scales": layer.group_scales,
                  "w8_offsets": layer.group_mins if self.offsets else None}
        del layer.weight, layer.group_scales
        if self.offsets:
            del layer.group_mins
        for name, tensor in served.items():
            layer.register_buffer(name, tensor, persistent=False)

    def served_bytes(self, layer) -> int:
        """What was loaded, as it was loaded: a byte per code, the scales and the offsets."""
        mins = layer.group_mins if self.offsets else None
        return tensor_bytes(layer.weight, layer.group_scales, mins, layer.bias)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self.gemm(rows, layer.w8_codes, layer.w8_scales, layer.w8_offsets, self.group)
        out = out if layer.bias is None else out + layer.bias
        return out.view(*x.shape[:-1], out.shape[-1])
