"""The plugin manager: loads entry points, collects spec records, and rejects name clashes."""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import replace
from importlib import metadata
from typing import Any

import pluggy

from . import hookspecs
from .specs import (
    AttentionBackendSpec,
    KVConnectorSpec,
    LoRAResolverSpec,
    ModelSpec,
    PlatformSpec,
    QuantizationMethodSpec,
    ReasoningParserSpec,
    StructuredOutputBackendSpec,
    ToolParserSpec,
)

logger = logging.getLogger("corectl.plugins")
ENTRY_POINT_GROUP = "corectl"
DISABLE_ENV = "CORECTL_DISABLE_PLUGINS"


class PluginConflictError(RuntimeError):
    """Two plugins registered the same name."""


def _disabled_from_env() -> frozenset[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


class PluginManager:
    """Discovers plugins from entry points and answers with spec records keyed by name.

    `disabled` names entry points (plugin names) that are not loaded; it defaults to the
    comma-separated list in ``CORECTL_DISABLE_PLUGINS``.
    """

    def __init__(self, disabled: Iterable[str] | None = None, load_entry_points: bool = True):
        self.disabled = frozenset(disabled) if disabled is not None else _disabled_from_env()
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._dists: dict[str, str] = {}
        # Entry points whose import failed: name -> (package, the error), for `corectl plugins`.
        self.failed: dict[str, tuple[str, str]] = {}
        if load_entry_points:
            self._load_entry_points()

    def _load_entry_points(self) -> None:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in self.disabled or self._pm.has_plugin(ep.name):
                continue
            dist = ep.dist.name if ep.dist is not None else "unknown"
            try:
                plugin = ep.load()
            except Exception as exc:  # any error of a third party's import: it must not stop the others
                self.failed[ep.name] = (dist, f"{type(exc).__name__}: {exc}")
                logger.warning("plugin %r of package %s failed to load and is skipped (%s: %s); set %s=%s to leave "
                               "it out", ep.name, dist, type(exc).__name__, exc, DISABLE_ENV, ep.name)
                continue
            self.register(plugin, name=ep.name, dist=dist)

    def register(self, plugin: Any, name: str, dist: str = "local") -> None:
        """Register a plugin object directly (tests, embedding applications)."""
        if name in self.disabled:
            return
        self._pm.register(plugin, name=name)
        self._dists[name] = dist

    def plugin_names(self) -> list[str]:
        return sorted(self._dists)

    def provider(self, plugin_name: str) -> str:
        """The distribution (package) that installed a plugin."""
        return self._dists.get(plugin_name, "unknown")

    def _collect(self, hook_name: str, key: str) -> dict[str, Any]:
        hook = getattr(self._pm.hook, hook_name)
        found: dict[str, Any] = {}
        for impl in hook.get_hookimpls():
            plugin_name = impl.plugin_name
            for spec in impl.function() or ():
                spec = replace(spec, plugin=plugin_name)
                name = getattr(spec, key)
                if name in found:
                    first = found[name].plugin
                    raise PluginConflictError(
                        f"{key} {name!r} is registered by two plugins: {first!r} (package "
                        f"{self.provider(first)!r}) and {plugin_name!r} (package "
                        f"{self.provider(plugin_name)!r}); uninstall one or disable it with "
                        f"{DISABLE_ENV}={plugin_name}"
                    )
                found[name] = spec
        return found

    def platforms(self) -> dict[str, PlatformSpec]:
        return self._collect("corectl_platforms", "name")

    def model_architectures(self) -> dict[str, ModelSpec]:
        return self._collect("corectl_model_architectures", "architecture")

    def attention_backends(self) -> dict[str, AttentionBackendSpec]:
        return self._collect("corectl_attention_backends", "name")

    def structured_output_backends(self) -> dict[str, StructuredOutputBackendSpec]:
        return self._collect("corectl_structured_output_backends", "name")

    def quantization_methods(self) -> dict[str, QuantizationMethodSpec]:
        return self._collect("corectl_quantization_methods", "name")

    def tool_parsers(self) -> dict[str, ToolParserSpec]:
        return self._collect("corectl_tool_parsers", "name")

    def reasoning_parsers(self) -> dict[str, ReasoningParserSpec]:
        return self._collect("corectl_reasoning_parsers", "name")

    def lora_resolvers(self) -> dict[str, LoRAResolverSpec]:
        return self._collect("corectl_lora_resolvers", "name")

    def kv_connectors(self) -> dict[str, KVConnectorSpec]:
        return self._collect("corectl_kv_connectors", "name")


_MANAGER: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, created on first use."""
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = PluginManager()
    return _MANAGER


def reset_plugin_manager(manager: PluginManager | None = None) -> None:
    """Replace the process-wide manager (after installing a plugin, or in tests)."""
    global _MANAGER
    _MANAGER = manager
