"""Plugin discovery for corectl: hook specifications, spec records and the plugin manager.

Only this package knows about entry points. Everything it hands out is a frozen record of dotted
paths, so discovering plugins never imports torch.cuda, triton or any backend module.
"""
from .hookspecs import hookimpl, hookspec
from .manager import (
    PluginConflictError,
    PluginManager,
    get_plugin_manager,
    reset_plugin_manager,
)
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
    import_dotted,
)

__all__ = [
    "AttentionBackendSpec",
    "KVConnectorSpec",
    "LoRAResolverSpec",
    "ModelSpec",
    "PlatformSpec",
    "PluginConflictError",
    "PluginManager",
    "QuantizationMethodSpec",
    "ReasoningParserSpec",
    "StructuredOutputBackendSpec",
    "ToolParserSpec",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "import_dotted",
    "reset_plugin_manager",
]
