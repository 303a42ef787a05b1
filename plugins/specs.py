"""Typed records that plugins yield. They hold dotted paths, never imported objects."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PlatformSpec:
    """A hardware platform: `path` names a `corectl.platform.Platform` subclass.

    `priority` orders platforms for `--platform auto`: the available platform with the highest
    priority wins (CPU is the floor at 0).
    """

    name: str
    path: str
    priority: int = 0
    description: str = ""
    plugin: str = field(default="", compare=False)


@dataclass(frozen=True)
class ModelSpec:
    """A model implementation for one Hugging Face `architectures` entry (e.g. `LlamaForCausalLM`)."""

    architecture: str
    path: str
    plugin: str = field(default="", compare=False)


@dataclass(frozen=True)
class AttentionBackendSpec:
    """An attention backend: `path` names a `corectl.attention.AttentionBackend` subclass.

    `platforms` lists the platform names it runs on.
    """

    name: str
    path: str
    platforms: tuple[str, ...] = ()
    plugin: str = field(default="", compare=False)


@dataclass(frozen=True)
class NamedSpec:
    """A class a plugin registers under a name users choose it by: `path` names the class,
    `plugin` is filled in by the plugin manager."""

    name: str
    path: str
    description: str = ""
    plugin: str = field(default="", compare=False)


@dataclass(frozen=True)
class StructuredOutputBackendSpec(NamedSpec):
    """A grammar backend for structured outputs: `path` names a
    `corectl.structured.backend.StructuredOutputBackend` subclass, chosen by `name` with
    `EngineConfig.structured_outputs_backend`."""


@dataclass(frozen=True)
class QuantizationMethodSpec(NamedSpec):
    """A quantization method: `path` names a `corectl.quantization.base.QuantizationConfig`
    subclass, chosen by `name` with `--quantization` or by a checkpoint whose
    `quantization_config.quant_method` is `name`."""


@dataclass(frozen=True)
class ToolParserSpec(NamedSpec):
    """A tool parser for the API server: `path` names a `corectl.server.http.tool_parsers.base.ToolParser`
    subclass, chosen by `name` with `corectl serve --tool-call-parser NAME`."""


@dataclass(frozen=True)
class ReasoningParserSpec(NamedSpec):
    """A reasoning parser for the API server: `path` names a
    `corectl.server.http.reasoning.base.ReasoningParser` subclass, chosen by `name` with
    `corectl serve --reasoning-parser NAME`."""


@dataclass(frozen=True)
class LoRAResolverSpec(NamedSpec):
    """A LoRA resolver: `path` names a `corectl.lora.resolvers.LoRAResolver` subclass, enabled by
    `name` with `corectl serve --lora-resolver NAME`."""


@dataclass(frozen=True)
class KVConnectorSpec(NamedSpec):
    """A KV connector (disaggregated prefill/decode, KV offloading): `path` names a
    `corectl.kv_transfer.base.KVConnector` subclass, chosen by `name` with
    `corectl serve --kv-transfer-config '{"kv_connector": NAME, ...}'`."""


def import_dotted(path: str) -> Any:
    """Import `package.module:attr` or `package.module.attr` and return the attribute."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"not a dotted path to an attribute: {path!r}")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ImportError(f"{module_name!r} has no attribute {attr!r} (from {path!r})") from exc
