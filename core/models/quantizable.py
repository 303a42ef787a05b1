"""The part of the parallel linear layers a quantization method plugs into.

A layer built while a quantization config is active (`corectl.quantization.scope`) holds its
dense weight on the meta device; `corectl.quantization.scope.bind_linear_methods` then asks the
config for a method by the layer's name, and the method registers the parameters it loads
(qweight, scales, ...). `load_sliced` narrows a checkpoint tensor to this rank's slice along the
axes each parameter declares (`QuantAxes`), in the same units as the dense loaders: the shard
rows of a packed column-parallel layer, the input columns of a row-parallel one.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..quantization.base import LinearMethod, QuantAxes, QuantizableLayer, QuantizationConfig
from .kernels import UsesLayerKernels


class QuantizableLinear(UsesLayerKernels, QuantizableLayer):
    """Mixin for `PackedLinear` and `RowParallelLinear` (both `nn.Linear`s). Without a method the
    layer is dense: its GEMM is the installed kernels' `dense_linear` where that takes the shape,
    else F.linear."""

    quant_method: LinearMethod | None = None
    # PackedLinear: shard id -> (offset here, rows here, first checkpoint row); RowParallelLinear: None.
    shards: dict[str, tuple[int, int, int]] | None = None
    full_sizes: dict[str, int] | None = None
    # RowParallelLinear: the first input feature this rank holds (None: inputs are not split).
    first_input: int | None = None

    def set_quant_method(self, method: LinearMethod | None, dtype: torch.dtype, device: torch.device) -> None:
        """Give the layer its method (None: materialise the dense weight it deferred)."""
        del self.weight
        if self.bias is not None and self.bias.is_meta:
            self.bias = self._on_device(self.bias, device, dtype)
        if method is None:
            self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=dtype, device=device))
            self._attach_dense_loaders()
            return
        self.quant_method = method
        with torch.device(device):
            method.create_weights(self, dtype)

    def _on_device(self, param: nn.Parameter, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
        fresh = nn.Parameter(torch.zeros(param.shape, dtype=dtype, device=device))
        fresh.weight_loader = param.weight_loader
        return fresh

    def _attach_dense_loaders(self) -> None:
        """Give the dense weight (and bias) the layer's own slicing loaders; each layer defines it."""
        raise NotImplementedError

    def register_quant_param(self, name: str, tensor: torch.Tensor, axes: QuantAxes) -> nn.Parameter:
        """Register a parameter a method loads through `load_sliced`."""
        param = nn.Parameter(tensor, requires_grad=False)
        param.quant_axes = axes
        param.loaded_shards = set()
        param.weight_loader = self.load_sliced
        self.register_parameter(name, param)
        return param

    def quant_method_for(self, config: QuantizationConfig, prefix: str) -> LinearMethod | None:
        return config.linear_method(prefix, self)

    def checkpoint_weight_names(self, prefix: str) -> list[str]:
        """The checkpoint weights this layer holds (a packed layer names each shard's)."""
        return [f"{prefix}.weight"]

    def quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def linear_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + bias through the layer's method, or densely."""
        if self.quant_method is not None:
            return self.quantized_forward(x)
        return self.dense_forward(x, self.weight, self.bias)

    def load_sliced(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """Copy this rank's slice of checkpoint tensor `loaded` into `param` (of `shard_id`'s rows)."""
        axes: QuantAxes = param.quant_axes
        dest, src = param.data, loaded
        if axes.per_shard:
            index = 0 if shard_id is None else list(self.full_sizes).index(shard_id)
            dest, src = dest[index], src.reshape(())
        elif shard_id is not None and axes.out_axis is not None:
            offset, size, first = (_packed(v, axes.out_pack, shard_id) for v in self.shards[shard_id])
            full = self.full_sizes[shard_id]
            if src.shape[axes.out_axis] * axes.out_pack != full:
                raise ValueError(f"shard {shard_id!r} expects {full} output features along axis "
                                 f"{axes.out_axis}, checkpoint has {tuple(src.shape)}")
            dest, src = dest.narrow(axes.out_axis, offset, size), src.narrow(axes.out_axis, first, size)
        if self.first_input is not None and axes.in_axis is not None:
            first = _packed(self.first_input, axes.in_pack, "input")
            src = src.narrow(axes.in_axis, first, _packed(self.in_features, axes.in_pack, "input"))
        if tuple(dest.shape) != tuple(src.shape):
            raise ValueError(f"shape mismatch: parameter slice {tuple(dest.shape)} vs checkpoint {tuple(src.shape)}")
        shared = shard_id is not None and axes.out_axis is None and not axes.per_shard
        if shared and param.loaded_shards and not torch.equal(dest, src.to(dest.dtype)):
            # One tensor for every shard (GPTQ's g_idx): shards computed in one GEMM must agree.
            raise ConfigError("model", f"the shards of a packed layer disagree on a shared tensor ({shard_id!r} "
                              "differs from the others, e.g. act-order g_idx); they cannot run as one GEMM")
        dest.copy_(src)
        param.loaded_shards.add(shard_id)

    def check_loaded(self, prefix: str) -> None:
        """Raise naming a quantized parameter some shard of the checkpoint did not fill."""
        expected = set(self.full_sizes) if self.full_sizes else {None}
        for name, param in self.named_parameters(recurse=False):
            missing = expected - getattr(param, "loaded_shards", expected)
            if missing and param.loaded_shards:
                parts = ", ".join(sorted(str(s) for s in missing))
                raise ConfigError("model", f"checkpoint has no {name} for shard(s) {parts} of {prefix}: the "
                                  "quantized checkpoint is incomplete (missing scales or packed weights)")


def _packed(value: int, pack: int, what: str) -> int:
    if value % pack:
        raise ConfigError("tensor_parallel_size", f"this rank's {what} slice starts or ends at {value}, inside a "
                          f"group of {pack} quantized values; choose a tensor-parallel size that splits whole groups")
    return value // pack
