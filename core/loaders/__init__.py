"""Weight loaders: resolve `EngineConfig.model` to a checkpoint and stream its weights into a model.

Local safetensors folders, hub ids (downloaded or from the hub cache), GGUF files (dequantized once
into a cached safetensors folder) and random "dummy" weights.

The public names load on first use: `corectl.loaders.default_model`, which the API process reads,
must not pull torch and transformers' config classes in with them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_getattr

_EXPORTS = {"ModelSource": "corectl.loaders.source", "resolve_model_source": "corectl.loaders.resolve"}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr("corectl.loaders", _EXPORTS, globals())


if TYPE_CHECKING:
    from .resolve import resolve_model_source
    from .source import ModelSource
