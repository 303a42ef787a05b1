"""Weight loaders: resolve `EngineConfig.model` to a checkpoint and stream its weights into a model.

Local safetensors folders, hub ids (downloaded or from the hub cache), GGUF files (dequantized once
into a cached safetensors folder) and random "dummy" weights.
"""
from __future__ import annotations

from .resolve import resolve_model_source
from .source import ModelSource

__all__ = ["ModelSource", "resolve_model_source"]
