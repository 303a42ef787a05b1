"""What a request names when it asks for a LoRA adapter (vLLM's `LoRARequest`)."""
from __future__ import annotations

import msgspec

# The adapter folder's config; here, without torch, so that resolvers look for it in the API process.
CONFIG_FILE = "adapter_config.json"


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A PEFT adapter for one request: `LoRARequest("sql", 1, "/adapters/sql")`.

    `lora_int_id` (a positive integer) is the adapter's identity in the engine: device slots, the
    host cache and prefix-cache keys are per id, so two requests with the same id must name the
    same checkpoint. `lora_path` is a local folder or a hub id holding `adapter_config.json` and
    `adapter_model.safetensors`. `base_model_name` is the model the server lists as its parent.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not self.lora_path:
            raise ValueError(f"adapter {self.lora_name!r} needs a lora_path (a folder or a hub id)")
