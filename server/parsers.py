"""The tool and reasoning parsers `corectl serve` was started with, found by name through the plugin
manager (`corectl_tool_parsers`, `corectl_reasoning_parsers`)."""
from __future__ import annotations

from corectl.errors import ConfigError
from corectl.plugins import get_plugin_manager, import_dotted

from .reasoning.base import ReasoningParser
from .tool_parsers.base import ToolParser


def _resolve(name: str, kind: str, option: str, specs: dict, base: type) -> type:
    spec = specs.get(name)
    if spec is None:
        raise ConfigError(option, f"unknown {kind} {name!r}; registered: {', '.join(sorted(specs)) or '(none)'}")
    cls = import_dotted(spec.path)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(option, f"{kind} {name!r} ({spec.path}) is not a {base.__module__}.{base.__name__}")
    return cls


def tool_parser_class(name: str) -> type[ToolParser]:
    return _resolve(name, "tool parser", "tool_call_parser", get_plugin_manager().tool_parsers(), ToolParser)


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    return _resolve(name, "reasoning parser", "reasoning_parser", get_plugin_manager().reasoning_parsers(),
                    ReasoningParser)
