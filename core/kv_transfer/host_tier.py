"""`OffloadingConnector`: a host-memory tier under the device's prefix cache (`--kv-offload-bytes`).

When the device pool hands a cached prefix block to a new owner (`block_evicted`), the block is
copied to a slot of a host buffer (pinned where the platform pins) instead of being lost: the
copy is gathered at the next step's launch, before anything overwrites the block, and lands in
the slot on a background thread, off the step's path. A waiting request whose prefix continues
past its device hit into blocks the host tier holds gets them back (`get_num_new_matched_tokens`,
synchronous): the worker copies the slots into the request's new blocks before the step's forward
pass, so the request starts as if the device cache had hit. Slots are slot-major and pinned, so a
load is one asynchronous host-to-device copy per run of consecutive slots and the scatter runs
on the device (an H100 measured the earlier CPU-side gather, unpinned, at 1.7x the recompute
time). Slots are keyed by the prefix cache's own chained block hashes and evicted least recently
used first; the scheduler side owns that index, the worker side only the bytes, so any
tensor-parallel rank holds its own slice of each slot.

Sizing: `kv_connector_extra_config.offload_bytes` (what `--kv-offload-bytes` sets), or vLLM's
`num_cpu_blocks`. The tier needs prefix caching (it is keyed by the cache's hashes).
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from ..config import EngineConfig
from ..errors import ConfigError
from ..request import Request
from ..step_messages import KVBlockTransfer, KVTransferMetadata, KVTransferReport
from .base import KVCacheAccess, KVConnector, KVConnectorScheduler, KVConnectorWorker
from .config import KVTransferConfig
from .staged import _Lane


def num_host_slots(config: KVTransferConfig, kv_bytes_per_block: int) -> int:
    blocks = config.extra("num_cpu_blocks", None)
    if blocks is None:
        blocks = int(config.extra("offload_bytes", 0)) // kv_bytes_per_block
    if blocks < 1:
        raise ConfigError("kv_offload_bytes", f"the host tier must hold at least one KV block of {kv_bytes_per_block} "
                          "bytes")
    return int(blocks)


class HostTierScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, kv_bytes_per_block: int):
        super().__init__(config, block_size, kv_bytes_per_block)
        capacity = num_host_slots(config, kv_bytes_per_block)
        # Block hash -> slot, least recently used first.
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._free_slots = list(range(capacity - 1, -1, -1))
        self._save_blocks: list[int] = []
        self._save_slots: list[int] = []
        self._loads: list[KVBlockTransfer] = []
        # The slots a request's hit found, until its blocks are allocated.
        self._planned: dict[str, list[int]] = {}
        self._hit_tokens = 0
        self._blocks_saved = 0
        self._blocks_loaded = 0

    def block_evicted(self, block_id: int, block_hash: int) -> None:
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        slot = self._free_slots.pop() if self._free_slots else self._slots.popitem(last=False)[1]
        self._slots[block_hash] = slot
        self._save_blocks.append(block_id)
        self._save_slots.append(slot)

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        # Full blocks only, and never the last token; the hashes are those the prefix lookup computed.
        hashes = req.block_hashes[num_computed_tokens // self.block_size:(req.num_tokens - 1) // self.block_size]
        slots = []
        for block_hash in hashes:
            slot = self._slots.get(block_hash)
            if slot is None:
                break
            # Most recently used now: the evictions this step's allocation makes take other slots first.
            self._slots.move_to_end(block_hash)
            slots.append(slot)
        if not slots:
            return 0, False
        self._planned[req.request_id] = slots
        return len(slots) * self.block_size, False

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        slots = self._planned.pop(req.request_id)
        first = num_computed_tokens // self.block_size
        self._loads.append(KVBlockTransfer(req.request_id, block_ids[first:first + len(slots)], keys=slots))
        self._hit_tokens += num_external_tokens
        self._blocks_loaded += len(slots)

    def request_released(self, req: Request) -> None:
        self._planned.pop(req.request_id, None)

    def has_work(self) -> bool:
        return bool(self._save_blocks or self._loads)

    def build_metadata(self) -> KVTransferMetadata | None:
        if not self.has_work():
            return None
        saves = [KVBlockTransfer("", self._save_blocks, keys=self._save_slots)] if self._save_blocks else []
        self._blocks_saved += len(self._save_blocks)
        metadata = KVTransferMetadata(saves=saves, loads=self._loads)
        self._save_blocks, self._save_slots, self._loads = [], [], []
        return metadata

    def counters(self) -> dict[str, int]:
        return {"kv_offload_hit_tokens": self._hit_tokens,
                "kv_transfer_bytes_loaded": self._blocks_loaded * self.kv_bytes_per_block,
                "kv_transfer_bytes_saved": self._blocks_saved * self.kv_bytes_per_block}


class HostTierWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, access: KVCacheAccess):
        super().__init__(config, access)
        shape = access.block_shape()
        dtype = access.kv_caches()[0].dtype
        bytes_per_block = math.prod(shape) * dtype.itemsize
        self._slots = torch.empty((num_host_slots(config, bytes_per_block), *shape), dtype=dtype,
                                  pin_memory=access.pinned_memory)
        self._lane = _Lane("corectl-kv-offload")
        # The copy still landing in each slot: a load from the slot waits for it.
        self._landing: dict[int, threading.Event] = {}
        # The last load read from each slot (asynchronously): a copy landing in the slot waits for it.
        self._reading: dict[int, object] = {}

    def cancel(self, req_ids: list[str]) -> None:
        """Loads are synchronous: nothing is ever under way for a request."""

    def load(self, loads: list[KVBlockTransfer]) -> None:
        for transfer in loads:
            for slot in transfer.keys:
                landing = self._landing.get(slot)
                if landing is not None:
                    landing.wait()
            self.access.scatter(transfer.block_ids, self._to_device(transfer.keys).movedim(0, 2))
            # An empty fetch marks where the copies out of the slots end in the device's order.
            read = self.access.fetch_to_host([])
            for slot in transfer.keys:
                self._reading[slot] = read

    def _to_device(self, slots: list[int]) -> torch.Tensor:
        """The slots' blocks on the device, `[n, layers, 2, block_size, heads, dim]`: one copy per run
        of consecutive slots, each straight from the (pinned) buffer, queued on the device's order."""
        staged = torch.empty((len(slots), *self._slots.shape[1:]), dtype=self._slots.dtype,
                             device=self.access.kv_caches()[0].device)
        start = 0
        for end in range(1, len(slots) + 1):
            if end == len(slots) or slots[end] != slots[end - 1] + 1:
                first = slots[start]
                staged[start:end].copy_(self._slots[first:first + end - start], non_blocking=True)
                start = end
        return staged

    def save(self, saves: list[KVBlockTransfer]) -> None:
        for transfer in saves:
            # Slot-major on the device, so each slot lands as one contiguous copy on the host.
            blocks = self.access.gather(transfer.block_ids).movedim(2, 0).contiguous()
            fetch = self.access.fetch_to_host([blocks])
            landed = threading.Event()
            for slot in transfer.keys:
                self._landing[slot] = landed
            self._lane.put(lambda fetch=fetch, slots=transfer.keys, landed=landed: self._land(fetch, slots, landed))

    def _land(self, fetch, slots: list[int], landed: threading.Event) -> None:
        fetch.wait()
        for slot in slots:
            read = self._reading.pop(slot, None)
            if read is not None:
                read.wait()
        self._slots.index_copy_(0, torch.tensor(slots, dtype=torch.int64), fetch.tensors[0])
        landed.set()

    def finished(self, idle: bool) -> KVTransferReport:
        return KVTransferReport()

    def close(self) -> None:
        self._lane.close()


class OffloadingConnector(KVConnector):
    name = "OffloadingConnector"
    scheduler_cls = HostTierScheduler
    worker_cls = HostTierWorker

    @classmethod
    def check_config(cls, config: KVTransferConfig, engine: EngineConfig) -> None:
        if engine.pipeline_parallel_size > 1:
            # Slots are counted from the first stage's block size; a later stage's may be larger.
            raise ConfigError("kv_offload_bytes", "the host tier runs without pipeline stages for now")
        if not engine.enable_prefix_caching:
            raise ConfigError("kv_offload_bytes", "the host tier holds evicted prefix-cache blocks: it needs "
                              "prefix caching (drop --no-enable-prefix-caching)")
