"""Choosing a platform, an attention backend and a structured-output backend through the plugin manager."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from corectl.plugins import PlatformSpec, get_plugin_manager, import_dotted

from .errors import ConfigError
from .platform import Platform, PlatformCaps

if TYPE_CHECKING:  # attention.py imports torch, which the API process does not need
    from .attention import AttentionBackend


def platform_class(spec: PlatformSpec) -> type[Platform]:
    return import_dotted(spec.path)


def spec_available(spec: PlatformSpec) -> bool:
    try:
        return bool(platform_class(spec).is_available())
    except ImportError:
        return False


def resolve_platform(name: str) -> Platform:
    """`auto` picks the available platform with the highest plugin priority (CPU is the floor)."""
    specs = get_plugin_manager().platforms()
    if name == "auto":
        ranked = sorted(specs.values(), key=lambda s: s.priority, reverse=True)
        for spec in ranked:
            if spec_available(spec):
                return platform_class(spec)()
        raise ConfigError("platform", f"no available platform among {', '.join(specs) or '(none registered)'}")
    if name not in specs:
        raise ConfigError("platform", f"unknown platform {name!r}; registered: auto, {', '.join(sorted(specs))}")
    cls = platform_class(specs[name])
    if not cls.is_available():
        raise ConfigError("platform", cls().unavailable_reason())
    return cls()


def host_platform() -> Platform:
    """The available platform of highest priority whose device is the host's CPU
    (`Platform.on_host`): what `corectl plan --device cpu` sizes for."""
    ranked = sorted(get_plugin_manager().platforms().values(), key=lambda s: s.priority, reverse=True)
    for spec in ranked:
        try:
            cls = platform_class(spec)
        except ImportError:
            continue
        if cls.on_host and cls.is_available():
            return cls()
    raise ConfigError("device", "no available platform computes on this machine's CPU")


def planned_platform(name: str, compute_capability: tuple[int, int]) -> tuple[Platform, PlatformCaps]:
    """A platform whose device this machine need not have, and what one of `compute_capability`
    can do (`Platform.planned_capabilities`): the one named, or for `auto` the highest-priority
    one that can tell (`corectl plan` for a GPU that is elsewhere)."""
    specs = get_plugin_manager().platforms()
    if name != "auto" and name not in specs:
        raise ConfigError("platform", f"unknown platform {name!r}; registered: auto, {', '.join(sorted(specs))}")
    ranked = sorted(specs.values(), key=lambda s: s.priority, reverse=True) if name == "auto" else [specs[name]]
    for spec in ranked:
        try:
            platform = platform_class(spec)()
        except ImportError:
            continue
        caps = platform.planned_capabilities(compute_capability)
        if caps is not None:
            return platform, caps
    raise ConfigError("platform", f"platform {name!r} cannot describe a device it does not see; plan on a "
                                  "machine that has one")


def resolve_attention_backend(platform: Platform, requested: str | None, model_config) -> type[AttentionBackend]:
    specs = get_plugin_manager().attention_backends()
    name = requested or platform.default_attention_backend(model_config)
    spec = specs.get(name)
    if spec is None:
        raise ConfigError("attention_backend", f"unknown attention backend {name!r}; registered: {', '.join(sorted(specs))}")
    if spec.platforms and platform.name not in spec.platforms:
        raise ConfigError(
            "attention_backend",
            f"backend {name!r} runs on {', '.join(spec.platforms)}, not on platform {platform.name!r}",
        )
    return import_dotted(spec.path)


def import_registered(specs: dict, name: str, option: str, kind: str, also: str = "") -> type:
    """Import the class a plugin registered under `name` in `specs` (records with a dotted `path`);
    an unknown name is a ConfigError on `option` that lists what is registered (then `also`)."""
    spec = specs.get(name)
    if spec is None:
        raise ConfigError(option, f"unknown {kind} {name!r}; registered: {', '.join(sorted(specs)) or '(none)'}{also}")
    return import_dotted(spec.path)


def resolve_structured_output_backend(name: str) -> type:
    """The `corectl.structured.backend.StructuredOutputBackend` class registered under `name`."""
    return import_registered(get_plugin_manager().structured_output_backends(), name,
                             "structured_outputs_backend", "structured-output backend")


def resolve_quantization_method(name: str) -> type:
    """The `corectl.quantization.base.QuantizationConfig` class registered under `name`."""
    return import_registered(get_plugin_manager().quantization_methods(), name, "quantization",
                             "quantization method", ", or 'none' for dense weights")


def resolve_text_parser(kind: str, name: str, option: str) -> type:
    """The class registered under `name` as an API-server "tool parser" or "reasoning parser"
    (`corectl_tool_parsers`, `corectl_reasoning_parsers`); the server checks its contract."""
    pm = get_plugin_manager()
    return import_registered(pm.tool_parsers() if kind == "tool parser" else pm.reasoning_parsers(), name,
                             option, kind)


def resolve_lora_resolver(name: str) -> type:
    """The `corectl.lora.resolvers.LoRAResolver` class registered under `name` (`corectl_lora_resolvers`)."""
    return import_registered(get_plugin_manager().lora_resolvers(), name, "lora_resolver", "LoRA resolver")


def resolve_kv_connector(name: str) -> type:
    """The `corectl.kv_transfer.base.KVConnector` class registered under `name` (`corectl_kv_connectors`)."""
    return import_registered(get_plugin_manager().kv_connectors(), name, "kv_transfer_config", "KV connector")


@dataclass(frozen=True)
class InventoryRow:
    # "platform", "model", "attention", "structured", "quantization", "tool_parser", "reasoning", "lora_resolver",
    # "kv_connector", or "plugin" for an entry point that failed to load
    kind: str
    name: str
    plugin: str
    package: str
    priority: str = ""
    detail: str = ""


def plugin_inventory() -> list[InventoryRow]:
    """Everything the installed plugins provide, with the package behind each entry: platforms by
    priority (with whether this machine can run them), then architectures, attention backends,
    structured-output backends, quantization methods, and the API server's tool and reasoning parsers."""
    pm = get_plugin_manager()
    rows = [InventoryRow("platform", s.name, s.plugin, pm.provider(s.plugin), str(s.priority),
                         "yes" if spec_available(s) else "no")
            for s in sorted(pm.platforms().values(), key=lambda s: -s.priority)]
    rows += [InventoryRow("model", s.architecture, s.plugin, pm.provider(s.plugin))
             for s in sorted(pm.model_architectures().values(), key=lambda s: s.architecture)]
    rows += [InventoryRow("attention", s.name, s.plugin, pm.provider(s.plugin), "",
                          "platforms: " + ",".join(s.platforms))
             for s in sorted(pm.attention_backends().values(), key=lambda s: s.name)]
    rows += [InventoryRow("structured", s.name, s.plugin, pm.provider(s.plugin), "", s.description)
             for s in sorted(pm.structured_output_backends().values(), key=lambda s: s.name)]
    rows += [InventoryRow("quantization", s.name, s.plugin, pm.provider(s.plugin), "", s.description)
             for s in sorted(pm.quantization_methods().values(), key=lambda s: s.name)]
    for kind, specs in (("tool_parser", pm.tool_parsers()), ("reasoning", pm.reasoning_parsers()),
                        ("lora_resolver", pm.lora_resolvers()), ("kv_connector", pm.kv_connectors())):
        rows += [InventoryRow(kind, s.name, s.plugin, pm.provider(s.plugin), "", s.description)
                 for s in sorted(specs.values(), key=lambda s: s.name)]
    rows += [InventoryRow("plugin", name, name, package, "", f"no: failed to load ({error})")
             for name, (package, error) in sorted(pm.failed.items())]
    return rows
