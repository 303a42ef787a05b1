"""The worker side of the built-in disaggregated connectors: blocks staged through host memory, or
kept on the device where the transport moves device memory itself.

A save gathers the request's blocks at the step's launch (in stream order, so later steps may
reuse them at once), starts the platform's asynchronous copy to the host, and hands the rest to
a background thread: wait for the copy, then `publish` the bytes under the transfer id. A worker
whose `publishes_device_blocks` is set (NCCL) publishes the gathered copy itself once the device
has made it: a host round trip would only add two copies of every block. A load
runs `fetch` on another background thread (it may wait for the producer, or for the network);
the bytes that arrived are written into the request's blocks at a later step's launch, on the
engine's own thread, before that step's forward pass, and reported loaded. A fetch that raises
(nothing published in time, a dead producer, a shape that does not match) reports every block of
the load as failed: the decode instance recomputes the prompt.
"""
from __future__ import annotations

import abc
import logging
import queue
import threading
from collections.abc import Callable

import torch

from ..step_messages import KVBlockTransfer, KVTransferReport
from .base import KVCacheAccess, KVConnectorWorker
from .config import KVTransferConfig
from .timing import PhaseTimes, TransferStamps

logger = logging.getLogger("corectl.kv_transfer")
# How long an idle step waits for a load under way to arrive before it reports (no busy loop).
_IDLE_WAIT_S = 0.005


class _Lane:
    """One daemon thread running jobs in order."""

    def __init__(self, name: str):
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def drain(self, timeout: float) -> bool:
        """Whether the jobs queued so far ran within `timeout` seconds."""
        done = threading.Event()
        self._jobs.put(done.set)
        return done.wait(timeout)

    def close(self) -> None:
        self._jobs.put(None)


class StagedTransferWorker(KVConnectorWorker):
    # `publish` takes the gathered blocks on the device rather than a host copy.
    publishes_device_blocks = False

    def __init__(self, config: KVTransferConfig, access: KVCacheAccess):
        super().__init__(config, access)
        self._loads_lane = _Lane("corectl-kv-load")
        self._saves_lane = _Lane("corectl-kv-save")
        self._arrived: queue.Queue[tuple[KVBlockTransfer, torch.Tensor | None, TransferStamps]] = queue.Queue()
        # Loads under way by request id; a cancelled one is dropped here, so what it fetches is thrown away.
        self._pending: dict[str, KVBlockTransfer] = {}
        self.load_times = PhaseTimes("load", ("queued", "fetch", "to step", "write"), moving="fetch")
        self.save_times = PhaseTimes("save", ("queued", "gather", "publish"), moving="publish")

    @abc.abstractmethod
    def publish(self, transfer_id: str, blocks: torch.Tensor) -> None:
        """Make `blocks` (`[layers, 2, n, block_size, heads, dim]`, on the host, or on the device
        with `publishes_device_blocks`) fetchable under `transfer_id` (background thread)."""

    @abc.abstractmethod
    def fetch(self, transfer: KVBlockTransfer) -> torch.Tensor:
        """The blocks `transfer.first_block` to `transfer.first_block + len(transfer.block_ids)` saved
        under `transfer.transfer_id`, shaped as `publish` took them (background thread); raises
        when they cannot be had."""

    def cancel(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._pending.pop(req_id, None)

    def load(self, loads: list[KVBlockTransfer]) -> None:
        for transfer in loads:
            self._pending[transfer.req_id] = transfer
            stamps = TransferStamps(transfer.transfer_id)
            self._loads_lane.put(lambda transfer=transfer, stamps=stamps: self._fetch_one(transfer, stamps))

    def save(self, saves: list[KVBlockTransfer]) -> None:
        for transfer in saves:
            stamps = TransferStamps(transfer.transfer_id)
            blocks = self.access.gather(transfer.block_ids)
            # An empty fetch marks where the gather ends in the device's order.
            fetch = self.access.fetch_to_host([] if self.publishes_device_blocks else [blocks])
            self._saves_lane.put(lambda transfer=transfer, fetch=fetch, blocks=blocks, stamps=stamps:
                                 self._publish_one(transfer, fetch, blocks, stamps))

    def saves_published(self, timeout: float) -> bool:
        """Whether every save handed over so far is fetchable (published on the save thread) within
        `timeout` seconds: a producer's saves trail its requests' ends."""
        return self._saves_lane.drain(timeout)

    def _fetch_one(self, transfer: KVBlockTransfer, stamps: TransferStamps) -> None:
        stamps.stamp()
        try:
            blocks = self.fetch(transfer)
            expected = (*self.access.block_shape()[:2], len(transfer.block_ids), *self.access.block_shape()[2:])
            if tuple(blocks.shape) != expected:
                raise ValueError(f"the saved blocks are shaped {tuple(blocks.shape)}, this instance's {expected} "
                                 "(another model, block size or tensor-parallel layout)")
        except Exception as exc:  # any failure means the same thing: recompute
            logger.warning("KV load of request %s (transfer %s) failed, recomputing its prompt: %s",
                           transfer.req_id, transfer.transfer_id, exc)
            blocks = None
        stamps.stamp()
        self._arrived.put((transfer, blocks, stamps))

    def _publish_one(self, transfer: KVBlockTransfer, fetch, device_blocks: torch.Tensor,
                     stamps: TransferStamps) -> None:
        stamps.stamp()
        fetch.wait()
        stamps.stamp()
        blocks = device_blocks if self.publishes_device_blocks else fetch.tensors[0]
        try:
            self.publish(transfer.transfer_id, blocks)
        except Exception as exc:  # the decode instance then fails its load and recomputes
            logger.warning("KV save of request %s (transfer %s) failed: %s", transfer.req_id, transfer.transfer_id, exc)
            return
        stamps.num_bytes = blocks.numel() * blocks.element_size()
        self.save_times.finish(stamps)

    def finished(self, idle: bool) -> KVTransferReport:
        report = KVTransferReport(loaded=[], failed={})
        arrived = []
        if idle and self._pending and self._arrived.empty():
            try:
                arrived.append(self._arrived.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                pass
        while not self._arrived.empty():
            arrived.append(self._arrived.get_nowait())
        for transfer, blocks, stamps in arrived:
            if self._pending.get(transfer.req_id) is not transfer:
                continue  # cancelled: its blocks may already belong to another request
            del self._pending[transfer.req_id]
            if blocks is None:
                report.failed[transfer.req_id] = list(transfer.block_ids)
                continue
            stamps.stamp()
            self.access.scatter(transfer.block_ids, blocks)
            report.loaded.append(transfer.req_id)
            stamps.num_bytes = blocks.numel() * blocks.element_size()
            report.bytes_loaded += stamps.num_bytes
            self.load_times.finish(stamps)
        return report

    def close(self) -> None:
        self._loads_lane.close()
        self._saves_lane.close()
