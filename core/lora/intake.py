"""The adapter check of request intake (client side, before the engine sees a request)."""
from __future__ import annotations

from ..errors import InvalidRequestError
from .request import LoRARequest
from .shapes import BaseModelShape


def check_lora_request(lora: LoRARequest | None, shape: BaseModelShape | None, known: dict[int, LoRARequest],
                       cache_dir: str | None = None) -> None:
    """Refuse an adapter the engine cannot serve, reading its checkpoint the first time its id is
    seen (`known`: the ids checked so far, kept by the caller); an id names one adapter for good."""
    if lora is None:
        return
    if not isinstance(lora, LoRARequest):
        raise InvalidRequestError(f"lora_request must be a LoRARequest, not {type(lora).__name__}",
                                  param="lora_request")
    if shape is None:
        raise InvalidRequestError(f"adapter {lora.lora_name!r} asked for, but this engine runs without LoRA: start it "
                                  "with enable_lora=True (--enable-lora)", param="lora_request")
    seen = known.get(lora.lora_int_id)
    if seen is not None:
        if (seen.lora_name, seen.lora_path) != (lora.lora_name, lora.lora_path):
            raise InvalidRequestError(
                f"lora_int_id {lora.lora_int_id} already names adapter {seen.lora_name!r} ({seen.lora_path}); "
                f"give {lora.lora_name!r} ({lora.lora_path}) its own id", param="lora_request")
        return
    from .checkpoint import load_adapter

    load_adapter(lora, shape, cache_dir)
    known[lora.lora_int_id] = lora
