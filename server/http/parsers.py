"""The tool and reasoning parsers `corectl serve` was started with, found by name through core's
plugin discovery (`corectl_tool_parsers`, `corectl_reasoning_parsers`)."""
from __future__ import annotations

from corectl.discovery import resolve_text_parser
from corectl.errors import ConfigError

from .reasoning.base import ReasoningParser
from .tool_parsers.base import ToolParser


def _resolve(name: str, kind: str, option: str, base: type) -> type:
    cls = resolve_text_parser(kind, name, option)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(option, f"{kind} {name!r} ({cls!r}) is not a {base.__module__}.{base.__name__}")
    return cls


def tool_parser_class(name: str) -> type[ToolParser]:
    return _resolve(name, "tool parser", "tool_call_parser", ToolParser)


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    return _resolve(name, "reasoning parser", "reasoning_parser", ReasoningParser)
