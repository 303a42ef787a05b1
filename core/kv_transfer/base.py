"""The KV-connector contract: what a connector must do to move KV blocks in and out of an engine.

A connector comes in two halves, as in vLLM's KV connector API, because the scheduler and the
worker may live in different processes:

- **scheduler side** (`KVConnectorScheduler`, in the engine process, beside the scheduler): says
  how many tokens of a waiting request it can load from outside after the local prefix-cache hit
  (`get_num_new_matched_tokens`), and whether that load is asynchronous (the request waits, holding
  its blocks, until the worker reports it) or done by the worker before the step's forward pass;
  learns which blocks were allocated for them (`update_state_after_alloc`); hears of finished
  requests (`request_finished`: a prefill instance saves the prompt's blocks), requests that left
  while their load was under way (`request_released`) and prefix-cache blocks the device pool
  evicts (`block_evicted`: a host tier keeps them); and turns all that into one step's
  `KVTransferMetadata` (`build_metadata`), which travels to every worker in the `SchedulerOutput`.
- **worker side** (`KVConnectorWorker`, one per rank, holding the KV tensors): at each step's
  launch, before the forward pass, `step` applies the metadata (cancel, save, then load) and reports in
  a `KVTransferReport` which asynchronous loads finished or failed (with the blocks that hold no
  valid K/V). Saves read the blocks at once (in stream order, before any
  later step overwrites them) and may ship the bytes out in the background.

The scheduler keeps the accounting: a request whose load is asynchronous waits, holding its blocks,
until the report says it loaded (its `num_computed_tokens` then covers the loaded tokens) or failed
(it recomputes from the first invalid block: vLLM's KV load-failure recovery).

A connector is a `KVConnector` subclass naming its two halves, registered under a name through
the `corectl_kv_connectors` plugin hook (`corectl.plugins.KVConnectorSpec`) and chosen with
`--kv-transfer-config '{"kv_connector": NAME, ...}'`. The KV tensors have the default layout of
`corectl.attention` (`[2, num_blocks, block_size, num_kv_heads, head_dim]` per layer).
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import EngineConfig
from ..request import Request
from ..step_messages import KVBlockTransfer, KVTransferMetadata, KVTransferReport
from .config import KVTransferConfig


class KVConnectorScheduler(abc.ABC):
    """The engine process's half. `kv_bytes_per_block` is one block's K/V over every layer."""

    def __init__(self, config: KVTransferConfig, block_size: int, kv_bytes_per_block: int):
        self.config = config
        self.block_size = block_size
        self.kv_bytes_per_block = kv_bytes_per_block

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the first `num_computed_tokens` (found in the local prefix cache) that this
        connector can load, never reaching the request's last token (it is computed for its
        logits); and whether the load is asynchronous. (0, False): nothing to load."""

    @abc.abstractmethod
    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """The request now holds `block_ids` (all its blocks): the loaded tokens go to positions
        `num_computed_tokens` to `num_computed_tokens + num_external_tokens`."""

    def request_finished(self, req: Request, block_ids: list[int]) -> None:
        """A request finished (not aborted) holding `block_ids`; they are freed right after, and the
        save this step's metadata asks for reads them before anything reuses them."""

    def request_released(self, req: Request) -> None:
        """A request left the engine (finished, aborted, or preempted while waiting for its load)."""

    def block_evicted(self, block_id: int, block_hash: int) -> None:
        """The device pool is handing `block_id`, a cached prefix block, to a new owner this step."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Whether anything is due or under way: the engine keeps stepping (the workers report
        asynchronous loads only when a step reaches them) until it is done."""

    @abc.abstractmethod
    def build_metadata(self) -> KVTransferMetadata | None:
        """The work the next step's workers do; None when nothing is due or under way."""

    def update_report(self, report: KVTransferReport) -> None:
        """The workers' report of a step (already applied to the requests by the scheduler)."""

    def counters(self) -> dict[str, int]:
        """Cumulative counters for `SchedulerStats` (field name -> value)."""
        return {}


@dataclass
class KVCacheAccess:
    """What a worker-side connector may touch: the KV tensors (read through `kv_caches`, since
    sleep mode replaces them), the block size, the platform's asynchronous device-to-host copy
    (`fetch_to_host(tensors)` returns an object whose `wait()` makes its `tensors` readable),
    whether host buffers should be pinned, and the platform's torch.distributed backend."""

    kv_caches: Callable[[], list[torch.Tensor]]
    block_size: int
    fetch_to_host: Callable[[list[torch.Tensor]], Any]
    pinned_memory: bool
    distributed_backend: str

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' K/V over every layer: `[layers, parts, len(block_ids), block_size, heads, dim]`
        (parts: 2, keys and values, or 1, a latent cache's one row: `corectl.attention`)."""
        caches = self.kv_caches()
        index = self._index(block_ids, caches[0].device)
        return torch.stack([cache.index_select(1, index) for cache in caches])

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write `blocks` (as `gather` returns them, on any device) into the given blocks."""
        caches = self.kv_caches()
        device = caches[0].device
        index = self._index(block_ids, device)
        accelerator = torch.accelerator.current_accelerator()
        if blocks.device == device and accelerator is not None and device.type == accelerator.type:
            # Received on a transfer's own stream: its memory waits for these copies before reuse.
            blocks.record_stream(torch.get_device_module(device).current_stream(device))
        blocks = blocks.to(device, non_blocking=True)
        for layer, cache in enumerate(caches):
            cache.index_copy_(1, index, blocks[layer].to(cache.dtype))

    def _index(self, block_ids: list[int], device: torch.device) -> torch.Tensor:
        """`block_ids` on `device`. From pinned memory the copy does not wait for the step in flight
        (a pageable one synchronizes the stream, and the engine's thread would idle until it ends)."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        return (index.pin_memory() if self.pinned_memory else index).to(device, non_blocking=True)

    def block_shape(self) -> tuple[int, ...]:
        """One gathered block's shape over every layer (`gather` of one block, without its count)."""
        cache = self.kv_caches()[0]
        return (len(self.kv_caches()), cache.shape[0], *cache.shape[2:])


class KVConnectorWorker(abc.ABC):
    """A rank's half: it moves blocks between its KV tensors and the outside."""

    def __init__(self, config: KVTransferConfig, access: KVCacheAccess):
        self.config = config
        self.access = access

    def step(self, metadata: KVTransferMetadata, idle: bool) -> KVTransferReport:
        """Apply one step's metadata before its forward pass and report what finished; `idle`: the
        step computes nothing, so a short wait for a finishing transfer costs no work."""
        self.cancel(metadata.cancelled)
        # Saves first: a block evicted this step may be the target of a load this step.
        self.save(metadata.saves)
        self.load(metadata.loads)
        return self.finished(idle)

    @abc.abstractmethod
    def cancel(self, req_ids: list[str]) -> None:
        """Forget these requests' asynchronous loads: their blocks may be reused from this step on."""

    @abc.abstractmethod
    def load(self, loads: list[KVBlockTransfer]) -> None:
        """Start these loads (a synchronous one must be in the blocks before this step's forward pass)."""

    @abc.abstractmethod
    def save(self, saves: list[KVBlockTransfer]) -> None:
        """Read these blocks now and send them on (in the background if it takes time)."""

    @abc.abstractmethod
    def finished(self, idle: bool) -> KVTransferReport:
        """What finished since the last call; asynchronous loads that arrived are written into
        their blocks here, before this step's forward pass."""

    def close(self) -> None:
        """Stop background work and release what the connector holds outside the process."""


class KVConnector:
    """A connector: `scheduler_cls` and `worker_cls` are its two halves (`name` is what
    `kv_connector` says). Registered through the `corectl_kv_connectors` plugin hook."""

    name: ClassVar[str]
    scheduler_cls: ClassVar[type[KVConnectorScheduler]]
    worker_cls: ClassVar[type[KVConnectorWorker]]

    @classmethod
    def check_config(cls, config: KVTransferConfig, engine: EngineConfig) -> None:
        """Refuse a configuration this connector cannot serve (`ConfigError`); the default takes any."""
