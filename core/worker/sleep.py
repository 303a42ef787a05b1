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
    attributes, such as prepacked weights), copied to host memory; the device copies are released.
    Tensors that are views of one storage (a LoRA layer's base weight and adapters' A rows in one
    stacked weight, corectl.lora.layers) come back as views of one storage again."""

    def __init__(self, model: torch.nn.Module):
        # (tensor, its storage's key, offset, shape, strides), and each storage's bytes on the host.
        self._slots: list[tuple[torch.Tensor, int, int, torch.Size, tuple[int, ...]]] = []
        self._host: dict[int, torch.Tensor] = {}
        seen: set[int] = set()
        for module in model.modules():
            for tensor in _device_tensors(module):
                if id(tensor) in seen:
                    continue  # tied weights: one copy
                seen.add(id(tensor))
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key not in self._host:
                    self._host[key] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage).cpu()
                self._slots.append((tensor, key, tensor.storage_offset(), tensor.shape, tensor.stride()))
        for tensor, *_ in self._slots:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def restore(self) -> None:
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor, key, offset, shape, stride in self._slots:
            if key not in storages:
                storages[key] = self._host[key].to(tensor.device).untyped_storage()
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storages[key], offset, shape,
                                                                                          stride)
        self._slots.clear()
        self._host.clear()


def _device_tensors(module: torch.nn.Module):
    """The module's own tensors that are not in host memory already."""
    for tensor in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
        if isinstance(tensor, torch.Tensor) and not tensor.is_cpu:
            yield tensor


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


def release_device_memory() -> None:
    """Hand freed blocks back to the device, not only to torch's caching allocator."""
    gc.collect()
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()
