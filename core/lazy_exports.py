"""Package attributes imported on first use (a PEP 562 module `__getattr__`): importing a package
then costs nothing of what its public names need (torch, transformers' config classes)."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The `__getattr__` of `package`: each name of `exports` (name -> module) is imported from its
    module when first read and kept in `namespace` (the package's globals), so later reads skip it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
