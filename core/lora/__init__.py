"""Multi-LoRA serving: PEFT adapters on one base model, mixed in one batch (see docs/lora.md).

`request` is what a request names (`LoRARequest`); `checkpoint` reads and checks a PEFT folder;
`punica` holds the batched shrink/expand arithmetic in torch; `layers` wraps a model's projections;
`experts` adds adapters inside mixture-of-experts experts (`expert_checkpoint` reads their layouts);
`manager` is the worker's one owner of host-cached and device-resident adapters.
"""
from .request import LoRARequest

__all__ = ["LoRARequest"]
