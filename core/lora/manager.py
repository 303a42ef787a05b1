"""The worker's adapter manager: the one owner of every adapter a worker holds.

Two LRU tiers: a host cache of loaded checkpoints (`max_cpu_loras`) and the device slots the
LoRA layers read (`max_loras`). Before each forward pass `prepare` makes the step's adapters
resident (the scheduler never puts more than `max_loras` distinct adapters in one step, so the
least recently used slot outside the step can always be taken), then writes the step's layout
into the shared `LoRABatch`: each token row's slot and, for the kernels, the rows sorted by slot
in tiles (longer ones in a prefill or mixed step), the segment form for a prefill or mixed step,
and the per-slot row groups of the torch path.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from ..models.pipeline import held_by_other_stage
from ..step_messages import SchedulerOutput
from ..worker.request_states import HostStep
from .checkpoint import BaseModelShape, LoRAAdapter, LoRAAdapterError, load_adapter
from .experts import ExpertLoRA, attach_expert_lora
from .layers import LoRABatch, LoRALinear, attach_lora
from .punica import LoRASegments, SlotGroup
from .request import LoRARequest

logger = logging.getLogger("corectl.lora")


class AdapterManager:
    def __init__(self, model: torch.nn.Module, base: BaseModelShape, *, max_loras: int, max_cpu_loras: int,
                 max_tokens: int, dtype: torch.dtype, device: torch.device, download_dir: str | None = None,
                 stack_a: bool = False):
        self.base = base
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.download_dir = download_dir
        self.batch = LoRABatch(max_loras, max_tokens, device)
        self.modules: dict[str, tuple[LoRALinear | ExpertLoRA, str]] = attach_lora(
            model, self.batch, max_loras, base.max_lora_rank, dtype, device, stack_a)
        if base.experts is not None:
            self.modules.update(attach_expert_lora(model, self.batch, max_loras, base.max_lora_rank, dtype, device))
        self.layers = list(dict.fromkeys(wrapper for wrapper, _ in self.modules.values()))
        # Pipeline stages: an adapter's modules in another stage's layers are that stage's to load.
        self._other_stage = lambda module: held_by_other_stage(model, f"{module}.weight")
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._requests: dict[str, LoRARequest] = {}

    @property
    def resident(self) -> list[int]:
        """Adapter ids in device slots, least recently used first."""
        return list(self._slots)

    def apply(self, sched: SchedulerOutput) -> None:
        """Follow the step's diff: which request uses which adapter."""
        for req_id in sched.finished_req_ids:
            self._requests.pop(req_id, None)
        for new in sched.new_requests:
            if new.lora_request is None:
                self._requests.pop(new.req_id, None)
            else:
                self._requests[new.req_id] = new.lora_request

    def prepare(self, host: HostStep, to_device: Callable[[list[np.ndarray]], list[torch.Tensor]]) -> None:
        """Make the step's adapters resident and write its layout into the batch."""
        loras = [self._requests.get(req_id) for req_id in host.req_ids]
        slot_of = self._make_resident({lora.lora_int_id: lora for lora in loras if lora is not None})
        req_slots = np.array([-1 if lora is None else slot_of[lora.lora_int_id] for lora in loras], dtype=np.int32)
        batch = self.batch
        batch.active = bool((req_slots >= 0).any())
        if not batch.active:
            batch.clear_slots()
            return
        lens = np.array(host.query_lens, dtype=np.int32)
        starts = np.asarray(host.query_start_loc[:-1], dtype=np.int32)
        torch_path = self._torch_path()
        # A verify step may replay a graph captured with the decode tiles: it keeps their rows.
        prefill = host.max_query_len > 1 and not host.verifies
        batch.write_slots(np.repeat(req_slots, lens), tiles=not torch_path, prefill=prefill)
        keep = req_slots >= 0
        if host.max_query_len > 1:
            (segments,) = to_device([np.stack([starts[keep], lens[keep], req_slots[keep]])])
            batch.segments = LoRASegments(segments[0], segments[1], segments[2], int(lens[keep].max()))
        if torch_path:
            batch.groups = slot_groups(starts[keep], lens[keep], req_slots[keep], batch.token_slots.device)

    def _torch_path(self) -> bool:
        """Whether the layers add LoRA in torch (no platform kernels), which reads host-side groups."""
        kernels = next((layer.kernels for layer in self.layers if isinstance(layer, LoRALinear)), None)
        return kernels is None or kernels.lora_shrink is None

    def finish_step(self) -> None:
        self.batch.reset()

    def _make_resident(self, loras: dict[int, LoRARequest]) -> dict[int, int]:
        if len(loras) > self.max_loras:
            raise RuntimeError(f"a step uses {len(loras)} adapters, more than max_loras={self.max_loras} slots")
        for lora_id in loras:
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
        for lora_id, lora in loras.items():
            if lora_id not in self._slots:
                self._load_into_slot(lora, self._free_slot(loras))
        return {lora_id: self._slots[lora_id] for lora_id in loras}

    def _free_slot(self, in_step: dict[int, LoRARequest]) -> int:
        taken = set(self._slots.values())
        free = next((s for s in range(self.max_loras) if s not in taken), None)
        if free is not None:
            return free
        victim = next(lora_id for lora_id in self._slots if lora_id not in in_step)
        slot = self._slots.pop(victim)
        logger.info("LoRA adapter %d evicted from device slot %d", victim, slot)
        return slot

    def _load_into_slot(self, lora: LoRARequest, slot: int) -> None:
        adapter = self._host_adapter(lora)
        by_layer: dict[LoRALinear | ExpertLoRA, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, pair in adapter.weights.items():
            if module not in self.modules and self._other_stage(module):
                continue
            if module not in self.modules:
                raise LoRAAdapterError(f"adapter {lora.lora_name!r} targets module {module!r}, which this model "
                                       "does not have (a dense MLP of a mixture-of-experts layer, or experts of a "
                                       "dense one?)")
            wrapper, projection = self.modules[module]
            by_layer.setdefault(wrapper, {})[projection] = pair
        for wrapper in self.layers:
            wrapper.load_slot(slot, by_layer.get(wrapper, {}))
        self.batch.scales[slot] = adapter.scaling
        self.batch.scale_list[slot] = adapter.scaling
        self.batch.ranks[slot] = adapter.rank
        self._slots[lora.lora_int_id] = slot
        logger.info("LoRA adapter %r (id %d, rank %d) loaded into device slot %d", lora.lora_name,
                    lora.lora_int_id, adapter.rank, slot)

    def _host_adapter(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(lora.lora_int_id)
        if adapter is not None:
            self._host.move_to_end(lora.lora_int_id)
            return adapter
        adapter = load_adapter(lora, self.base, self.download_dir)
        self._host[lora.lora_int_id] = adapter
        if len(self._host) > self.max_cpu_loras:
            evicted, _ = self._host.popitem(last=False)
            logger.info("LoRA adapter %d evicted from the host cache", evicted)
        return adapter


def slot_groups(starts: np.ndarray, lens: np.ndarray, slots: np.ndarray, device: torch.device) -> list[SlotGroup]:
    """Each adapter slot's token rows: one slice when its requests are adjacent, else an index."""
    groups = []
    for slot in dict.fromkeys(slots.tolist()):
        mine = slots == slot
        first, count = starts[mine], lens[mine]
        if len(first) == 1 or (first[1:] == first[:-1] + count[:-1]).all():
            groups.append(SlotGroup(slot, slice(int(first[0]), int(first[-1] + count[-1]))))
            continue
        rows = np.concatenate([np.arange(s, s + n) for s, n in zip(first.tolist(), count.tolist())])
        groups.append(SlotGroup(slot, torch.from_numpy(rows).to(device)))
    return groups
