"""Building a model under a quantization config: which layers defer their dense weight, which
method each layer gets, and the kernels the methods call.

The worker builds the model inside `quantization_scope(config, kernels)`; quantizable layers
(linear layers, and mixture-of-experts layers' stacked experts) then allocate no dense weight
(`deferred_weight_device`). `bind_linear_methods` gives every such layer its method by module
name after construction (`linear_method`, or `moe_method` for experts), and
`process_loaded_weights` runs each method's repacking once the checkpoint is in. Model code
never changes for a new method.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..errors import ConfigError
from .base import KernelTable, QuantizableLayer, QuantizationConfig

_ACTIVE: QuantizationConfig | None = None
_KERNELS: KernelTable = {}


@contextlib.contextmanager
def quantization_scope(config: QuantizationConfig | None, kernels: KernelTable | None = None) -> Iterator[None]:
    """Layers built inside defer their dense weights to `bind_linear_methods` when `config` is set."""
    global _ACTIVE, _KERNELS
    previous = _ACTIVE, _KERNELS
    _ACTIVE, _KERNELS = config, {**_KERNELS, **(kernels or {})}
    try:
        yield
    finally:
        _ACTIVE, _KERNELS = previous


def deferred_weight_device() -> str | None:
    """"meta" while a quantization config is active (the method allocates the real weights)."""
    return "meta" if _ACTIVE is not None else None


def kernel(name: str) -> Callable[..., torch.Tensor]:
    """A kernel the worker provided for the methods (looked up when a method binds to a layer)."""
    if name not in _KERNELS:
        raise ConfigError("quantization", f"kernel {name!r} was not provided by this platform's worker")
    return _KERNELS[name]


def optional_kernel(name: str) -> Callable[..., torch.Tensor] | None:
    """A kernel the worker may provide (a faster path of something core also does in torch)."""
    return _KERNELS.get(name)


def bind_linear_methods(model: nn.Module, config: QuantizationConfig, dtype: torch.dtype,
                        device: torch.device) -> int:
    """Give every quantizable layer of `model` its method (or its dense weight); returns how many
    layers are quantized. Runs inside the same `quantization_scope` the model was built in. A
    method with a `graph_capture_blocker` keeps a model that could be captured in CUDA graphs out
    of them, saying why (`CausalLM.supports_graph_capture`)."""
    quantized = 0
    for prefix, layer in model.named_modules():
        if isinstance(layer, QuantizableLayer):
            method = layer.quant_method_for(config, prefix)
            layer.set_quant_method(method, dtype, device)
            quantized += method is not None
            blocker = getattr(method, "graph_capture_blocker", "")
            if blocker and getattr(model, "supports_graph_capture", False):
                model.supports_graph_capture, model.graph_capture_blocker = False, blocker
    return quantized


@torch.no_grad()
def process_loaded_weights(model: nn.Module) -> None:
    """Check every quantized layer got all its shards, then repack them for their kernels. (A
    mixture-of-experts layer's loader already counted every expert's tensors: `load_moe_weights`.)"""
    for prefix, layer in model.named_modules():
        if isinstance(layer, QuantizableLayer) and layer.quant_method is not None:
            layer.check_loaded(prefix)
            layer.quant_method.process_weights_after_loading(layer)
