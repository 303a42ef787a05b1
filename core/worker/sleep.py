"""Sleep mode on a worker (`--enable-sleep-mode`): give the device memory back between uses, as RLHF
frameworks do between rollouts, without restarting the engine.

Level 1 copies the model's tensors to host memory and frees the KV cache; waking copies them back.
Level 2 drops the weights outright; waking rebuilds the model from its source. Either way the KV
cache is allocated anew on waking and warm-up runs again (tensors live at new addresses, so
captured graphs are recaptured). On a CPU the weights already are in host memory: level 1 frees
the KV cache only. `wake_up(tags)` may bring back "weights" and "kv_cache" one at a time.
"""
from __future__ import annotations

import gc

import torch

from ..errors import ConfigError

TAGS = ("weights", "kv_cache")


class OffloadedTensors:
    """Every tensor a model holds on its device (parameters, buffers, and tensors kept as plain
    attributes, such as prepacked weights), copied to host memory; the device copies are released."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self._slots: list[tuple[object, str, torch.Tensor]] = []
        if device.type == "cpu":
            return  # already in host memory
        pin = torch.cuda.is_available() and device.type == "cuda"
        seen: set[int] = set()
        for module in model.modules():
            for name, tensor in _device_tensors(module):
                if id(tensor) in seen:
                    continue  # tied weights: one copy
                seen.add(id(tensor))
                host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
                host.copy_(tensor.detach())
                self._slots.append((tensor, name, host))
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def restore(self) -> None:
        for tensor, _, host in self._slots:
            tensor.data = host.to(tensor.device, non_blocking=True)
        self._slots.clear()


def _device_tensors(module: torch.nn.Module):
    for name, tensor in [*module._parameters.items(), *module._buffers.items(), *vars(module).items()]:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu":
            yield name, tensor


class SleepState:
    """What of a worker is asleep: its weights (at which level) and its KV cache."""

    def __init__(self):
        self.weights_level = 0
        self.kv_asleep = False
        self.offloaded: OffloadedTensors | None = None

    @property
    def asleep(self) -> bool:
        return self.weights_level > 0 or self.kv_asleep

    def check_sleep(self, level: int, lora: bool) -> None:
        if level not in (1, 2):
            raise ConfigError("level", f"sleep level must be 1 (weights to host memory) or 2 (weights dropped), "
                              f"got {level}")
        if self.asleep:
            raise ConfigError("level", "the engine is already asleep; wake it up first")
        if level == 2 and lora:
            raise ConfigError("level", "level 2 rebuilds the model on waking, which would lose the loaded LoRA "
                              "adapters; use level 1")

    @staticmethod
    def wake_tags(tags: list[str] | None) -> tuple[str, ...]:
        if not tags:
            return TAGS
        unknown = sorted(set(tags) - set(TAGS))
        if unknown:
            raise ConfigError("tags", f"unknown wake-up tags {unknown}; the tags are {', '.join(TAGS)}")
        return tuple(tags)


def release_device_memory(device: torch.device) -> None:
    """Hand freed blocks back to the device, not only to torch's caching allocator."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
