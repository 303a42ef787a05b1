"""Weight loaders: resolve `EngineConfig.model` to a checkpoint and stream its weights into a model.

Local safetensors folders, hub ids (downloaded or from the hub cache), GGUF files (dequantized once
into a cached safetensors folder) and random "dummy" weights.

The public names load on first use: `corectl.loaders.default_model`, which the API process reads,
must not pull torch and transformers' config classes in with them.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {"ModelSource": "corectl.loaders.source", "resolve_model_source": "corectl.loaders.resolve"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'corectl.loaders' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .resolve import resolve_model_source
    from .source import ModelSource
