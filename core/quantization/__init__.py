"""Quantized weights: configs read from checkpoints, a linear (or experts') method per layer,
platform kernels.

See docs/quantization.md. `base` holds the contract, `scope` binds methods to a model's layers,
`selection` picks the config at engine start; the built-in methods are `gguf`, `fp8` (with
compressed-tensors FP8) and `int4` (AWQ, GPTQ), registered by `plugin` like third-party ones.
"""
from .base import KernelTable, LinearMethod, MoEMethod, QuantAxes, QuantizationConfig, layer_bytes, tensor_bytes
from .scope import bind_linear_methods, process_loaded_weights, quantization_scope

__all__ = ["KernelTable", "LinearMethod", "MoEMethod", "QuantAxes", "QuantizationConfig", "bind_linear_methods",
           "layer_bytes", "process_loaded_weights", "quantization_scope", "tensor_bytes"]
