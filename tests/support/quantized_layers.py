"""Quantized linear layers built outside a model: one tensor-parallel rank's layer with the method
a quantization config picks, loaded and repacked, the check that row-parallel ranks' partial
products sum to the whole, and random operands of the 4-bit GEMM."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from corectl.distributed import TensorParallel, parallel_state
from corectl.quantization import layer_bytes, quantization_scope
from corectl.quantization.int4 import pack_int32
from support.close import assert_close


def assert_row_parallel_sums(make_loaded_layer: Callable[[int], torch.nn.Module], x: torch.Tensor,
                             dense: torch.Tensor, world_size: int, tol: float, norm: str = "fro") -> None:
    """Each rank's row-parallel layer (`make_loaded_layer(rank)`, loaded and repacked) computes its
    inputs' part of x @ dense.T, and the parts sum to the whole product (within `assert_close`'s
    `tol` and `norm`)."""
    total = torch.zeros(x.shape[0], dense.shape[0])
    for rank in range(world_size):
        layer = make_loaded_layer(rank)
        columns = slice(layer.first_input, layer.first_input + layer.in_features)
        partial = layer.quant_method.apply(layer, x[:, columns])
        assert_close(partial, x[:, columns] @ dense[:, columns].t(), tol, norm=norm)
        total += partial
    assert_close(total, x @ dense.t(), tol, norm=norm)


def build_quantized_layer(config, kernels: dict, make: Callable[[], torch.nn.Module], prefix: str,
                          dtype: torch.dtype, rank: int = 0, world_size: int = 1) -> torch.nn.Module:
    """`make()` on tensor-parallel rank `rank` of `world_size`, given the method `config` picks for
    `prefix` with the worker kernels `kernels`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallel_state, "_state", TensorParallel(rank, world_size))
        with quantization_scope(config, kernels):
            layer = make()
            layer.set_quant_method(config.linear_method(prefix, layer), dtype, torch.device("cpu"))
    return layer


def finish_loading(layer: torch.nn.Module, prefix: str) -> None:
    """Repack a loaded layer; it then holds exactly what `served_bytes` stated from the shapes alone."""
    planned = layer.quant_method.served_bytes(layer)
    layer.check_loaded(prefix)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer_bytes(layer) == planned


def w4_operands(m: int, k: int, n: int, group: int, act_order: bool, offsets: bool = False):
    """Operands of the 4-bit GEMM; `offsets`: float offsets per group (GGUF) instead of zero codes."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    groups = k // group
    scales = torch.rand(groups, n) * 0.05 + 0.01
    zeros = torch.randn(groups, n) * 0.1 if offsets else torch.randint(0, 16, (groups, n), dtype=torch.int32)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k)]
    return torch.randn(m, k), pack_int32(codes.t(), 0), scales, zeros, g_idx, codes
