"""LoRA adapters over HTTP: which adapter a request's `model` names, and run-time loading.

`LoRARegistry` owns the names this server serves as adapters (`--lora-modules`, loads through
`POST /v1/load_lora_adapter`, names a resolver found at request time). Each name gets its own
`lora_int_id`, never reused, so an adapter unloaded and loaded again from another folder can never
meet the old one's KV blocks or device slot. Unloading removes the name only: requests already
running with the adapter keep it to the end (they carry their `LoRARequest`).

Run-time loading is off unless `--allow-runtime-lora-updating` (or CORECTL_ALLOW_RUNTIME_LORA_UPDATING=1,
or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) turns it on; it then takes folders inside the allowed
roots only (`--lora-allowed-roots`, default the folders holding the `--lora-modules` adapters), after
resolving links and `..`, so a client cannot make the server read arbitrary paths.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import anyio
from corectl.discovery import resolve_lora_resolver
from corectl.engine.client import EngineClient
from corectl.errors import ConfigError
from corectl.lora.request import LoRARequest
from corectl.lora.resolvers import LoRAResolver, ResolverOptions

from .errors import APIError

logger = logging.getLogger("corectl.server")
RUNTIME_UPDATING_ENVS = ("CORECTL_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON `{"name", "path", "base_model_name"}`."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        if text.lstrip().startswith("{"):
            try:
                fields = json.loads(text)
                module = cls(str(fields["name"]), str(fields["path"]), fields.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError("lora_modules", f"{text!r} is not a JSON object with \"name\" and \"path\" "
                                  f"({exc})") from None
            unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
            if unknown:
                raise ConfigError("lora_modules", f"{text!r} has keys this server does not know: {', '.join(unknown)} "
                                  "(an entry takes \"name\", \"path\" and \"base_model_name\")")
            return module
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ConfigError("lora_modules", f"{text!r} is not NAME=PATH or a JSON object")
        return cls(name, path)


@dataclass(frozen=True)
class LoRASettings:
    """`corectl serve`'s LoRA options beyond the engine's."""

    modules: tuple[LoRAModule, ...] = ()
    allowed_roots: tuple[str, ...] | None = None
    runtime_updating: bool = False
    resolvers: tuple[str, ...] = ()
    resolver_root: str | None = None

    @property
    def updating_allowed(self) -> bool:
        return self.runtime_updating or any(os.environ.get(env, "").lower() in ("1", "true")
                                            for env in RUNTIME_UPDATING_ENVS)


class LoRARegistry:
    def __init__(self, settings: LoRASettings, served_model_names: list[str], download_dir: str | None):
        """`served_model_names`: the base model's names; the first is the adapters' parent."""
        self.settings = settings
        self.served_model_names = served_model_names
        self.base_model_name = served_model_names[0]
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        roots = settings.allowed_roots
        if roots is None:
            roots = tuple(str(Path(m.path).expanduser().parent) for m in settings.modules if Path(m.path).exists())
        self.allowed_roots = [Path(root).expanduser().resolve() for root in roots]
        options = ResolverOptions(settings.resolver_root, download_dir)
        self.resolvers: list[LoRAResolver] = [resolve_lora_resolver(name)(options) for name in settings.resolvers]

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    async def add(self, client: EngineClient, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check and register an adapter under `name` (a new id); raises naming the problem."""
        self.check_name(name, base_model_name)
        lora = LoRARequest(name, next(self._ids), path, base_model_name or self.base_model_name)
        await client.check_lora(lora)
        self._adapters[name] = lora
        logger.info("LoRA adapter %r (id %d) registered from %s", name, lora.lora_int_id, path)
        return lora

    def check_name(self, name: str, base_model_name: str | None = None) -> None:
        """An adapter's name is new and not blank, and its parent is a name this server serves the base
        model under (a router groups adapters by `/v1/models`' parent)."""
        if not name.strip():
            raise APIError(400, "lora_name must not be empty", "lora_name")
        if name in self._adapters or name in self.served_model_names:
            raise APIError(400, f"the name {name!r} is already served; unload it first or choose another",
                           "lora_name")
        if base_model_name is not None and base_model_name not in self.served_model_names:
            raise APIError(400, f"base_model_name {base_model_name!r} is not a model this server serves "
                           f"({', '.join(self.served_model_names)})", "base_model_name")

    def remove(self, name: str) -> LoRARequest:
        lora = self._adapters.pop(name, None)
        if lora is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", "lora_name", "model_not_found")
        logger.info("LoRA adapter %r (id %d) unloaded; requests running with it finish first", name, lora.lora_int_id)
        return lora

    async def resolve(self, client: EngineClient, name: str) -> LoRARequest | None:
        """An unknown name through the enabled resolvers, registered on the first hit; None if none knows it."""
        for resolver in self.resolvers:
            path = await anyio.to_thread.run_sync(resolver.resolve, self.base_model_name, name)
            if path is not None:
                if name in self._adapters:  # another request resolved it meanwhile
                    return self._adapters[name]
                return await self.add(client, name, path)
        return None

    def check_runtime_path(self, path: str) -> None:
        """A run-time load may read only folders inside the allowed roots (links and `..` resolved)."""
        if not self.allowed_roots:
            raise APIError(400, f"lora_path {path!r} is not allowed: no --lora-allowed-roots are set", "lora_path")
        target = Path(path).expanduser()
        if not target.is_absolute():
            raise APIError(400, f"lora_path {path!r} is not allowed: give an absolute path", "lora_path")
        real = target.resolve()
        if not any(real == root or root in real.parents for root in self.allowed_roots):
            raise APIError(400, f"lora_path {path!r} is outside the allowed roots "
                           f"({', '.join(map(str, self.allowed_roots))}); see --lora-allowed-roots", "lora_path")
