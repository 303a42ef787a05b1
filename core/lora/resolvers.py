"""LoRA resolvers: turn an adapter name no one registered into a checkpoint path at request time
(vLLM's LoRA resolvers). A server enables them by name (`corectl serve --lora-resolver NAME`);
third-party packages add their own through the `corectl_lora_resolvers` hook.

A resolver class is built once as `cls(options)` and asked `resolve(base_model_name, lora_name)`
in a worker thread (it may download): a local folder holding the adapter, or None when it does not
know the name. The server then checks the adapter like any other.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .request import CONFIG_FILE

# A hub repo id: "org/name", the characters the hub allows.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ResolverOptions:
    """What the built-in resolvers read: `root` (the filesystem resolver's folder of adapters) and
    `download_dir` (the hub cache)."""

    root: str | None = None
    download_dir: str | None = None


class LoRAResolver:
    """The contract: `resolve` returns a local adapter folder for `lora_name`, or None."""

    def __init__(self, options: ResolverOptions):
        self.options = options

    def resolve(self, base_model_name: str, lora_name: str) -> str | None:
        raise NotImplementedError


class FilesystemResolver(LoRAResolver):
    """`<root>/<lora_name>` when that folder holds an adapter config. A name is one path part:
    no separators, no `..`, so a request cannot reach outside the root."""

    def __init__(self, options: ResolverOptions):
        super().__init__(options)
        if not options.root or not Path(options.root).is_dir():
            raise ConfigError("lora_resolver_root", f"the filesystem LoRA resolver needs an existing folder of "
                              f"adapters (--lora-resolver-root), got {options.root!r}")
        self.root = Path(options.root).resolve()

    def resolve(self, base_model_name: str, lora_name: str) -> str | None:
        if not lora_name or lora_name in (".", "..") or "/" in lora_name or "\\" in lora_name:
            return None
        folder = self.root / lora_name
        return str(folder) if (folder / CONFIG_FILE).is_file() else None


class HubResolver(LoRAResolver):
    """A name shaped like a hub id (`org/name`) is downloaded (adapter files only) into the hub cache."""

    def resolve(self, base_model_name: str, lora_name: str) -> str | None:
        if not _HUB_ID.match(lora_name):
            return None
        from ..loaders.hub import download_adapter

        try:
            return str(download_adapter(lora_name, self.options.download_dir))
        except Exception:  # not on the hub (or unreachable): not this resolver's name
            return None
