"""Choosing the quantization config at engine start: from `--quantization`, the checkpoint's
`quantization_config`, or a GGUF file's tensor types; then binding it to a platform kernel."""
from __future__ import annotations

import logging

from ..config import EngineConfig
from ..discovery import resolve_quantization_method
from ..errors import ConfigError
from ..platform import Platform
from .base import QuantizationConfig

logger = logging.getLogger("corectl.quantization")
NONE = "none"


def quantization_method_names() -> list[str]:
    from corectl.plugins import get_plugin_manager

    return sorted(get_plugin_manager().quantization_methods())


def resolve_quantization(config: EngineConfig, source, platform: Platform) -> QuantizationConfig | None:
    """The bound config the model is built with, or None for dense weights."""
    return select_quantization(config, source, platform.capabilities().quantization_kernels, platform.name)


def select_quantization(config: EngineConfig, source, provided: tuple[str, ...],
                        platform: str) -> QuantizationConfig | None:
    """`resolve_quantization` for a platform known by its name and the kernels it provides
    (`corectl plan` binds to a device this machine may not have)."""
    checkpoint = _checkpoint_quant_config(source.hf_config)
    requested = config.quantization
    if checkpoint is not None:
        name = str(checkpoint.get("quant_method", "")).lower()
        if requested is not None and requested != name:
            raise ConfigError("quantization", f"the checkpoint is quantized with {name!r} (its config.json "
                              f"quantization_config); it cannot be served as {requested!r}")
        method = resolve_quantization_method(name)
        return method.from_checkpoint(checkpoint, source).bind(provided, platform)
    if requested == NONE:
        return None
    if requested is None and source.gguf_file is not None and config.dtype == "auto":
        return _gguf_by_default(source, provided, platform)
    if requested is None:
        return None
    return resolve_quantization_method(requested).from_checkpoint(None, source).bind(provided, platform)


def _gguf_by_default(source, provided: tuple[str, ...], platform: str) -> QuantizationConfig | None:
    """GGUF files stay quantized where the platform has the kernel; elsewhere they are dequantized."""
    gguf = resolve_quantization_method("gguf").from_checkpoint(None, source)
    try:
        return gguf.bind(provided, platform)
    except ConfigError:
        logger.info("platform %s has no kernel for GGUF blocks (%s): serving dequantized weights",
                    platform, ", ".join(gguf.kernels))
        return None


def _checkpoint_quant_config(hf_config) -> dict | None:
    found = getattr(hf_config, "quantization_config", None)
    if found is None:
        return None
    return found if isinstance(found, dict) else found.to_dict()

