"""vLLM's run-time LoRA routes: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Off unless run-time updating is allowed (see `lora.py`); with `--api-key` they need a key like every
API route. Loading checks the adapter (and that its folder lies inside the allowed roots) before the
name is served; unloading lets requests already running with the adapter finish.
"""
from __future__ import annotations

import msgspec
from corectl.lora.errors import LoRAAdapterError
from litestar import Controller, post

from .auth import require_api_key
from .errors import APIError
from .lora import LoRARegistry
from .state import ServerState


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None


class LoRAAdapterController(Controller):
    """vLLM's run-time adapter routes (off unless run-time updating is allowed)."""

    path = "/v1"
    guards = [require_api_key]
    tags = ["LoRA"]

    @post("/load_lora_adapter", status_code=200)
    async def load(self, data: LoadLoRAAdapterRequest, server: ServerState) -> str:
        registry = _updatable(server)
        registry.check_runtime_path(data.lora_path)
        try:
            await registry.add(server.engine, data.lora_name, data.lora_path, data.base_model_name)
        except LoRAAdapterError as exc:
            # The engine names the adapter's fault for the Python API's argument; here the folder is the field.
            raise APIError(400, str(exc), "lora_path", exc.code) from exc
        return f"Success: LoRA adapter '{data.lora_name}' added successfully."

    @post("/unload_lora_adapter", status_code=200)
    async def unload(self, data: UnloadLoRAAdapterRequest, server: ServerState) -> str:
        _updatable(server).remove(data.lora_name)
        return f"Success: LoRA adapter '{data.lora_name}' removed successfully."


def _updatable(server) -> LoRARegistry:
    registry = server.loras
    if registry is None:
        raise APIError(400, "this server runs without LoRA: start it with --enable-lora")
    if not registry.settings.updating_allowed:
        raise APIError(403, "run-time LoRA loading is off: start the server with --allow-runtime-lora-updating "
                       "(or CORECTL_ALLOW_RUNTIME_LORA_UPDATING=1)")
    return registry
