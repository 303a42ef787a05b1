"""`TorchDistributedConnector`: blocks sent point-to-point between a prefill and a decode instance.

The two instances form two-rank torch.distributed groups of their own (the producer is rank 0 and
hosts the rendezvous, the consumer rank 1): a gloo group carries the asks and answers' headers, and
the blocks travel on the platform's backend: gloo on CPUs, NCCL on GPUs (device to device, sent
from the gathered copy without a host stage, on a stream of their own so they wait for neither
instance's forward passes). The rendezvous is `kv_connector_extra_config.rendezvous`
(`tcp://HOST:PORT`), else vLLM's `kv_ip`:`kv_port`.

The consumer asks for blocks (a transfer id, the first block, how many) and the producer answers
with a header and the blocks, or "not here" when nothing was saved under that id within
`load_timeout_s` (default 30). A producer that dies mid-transfer makes the consumer's receive
fail: that load reports failed (the decode instance recomputes), and the next load joins a new
group, so a restarted producer is found again. A producer serves one consumer.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import threading
import time
from collections import OrderedDict
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..errors import ConfigError
from ..step_messages import KVBlockTransfer
from .base import KVCacheAccess
from .config import MAX_TRANSFER_ID, KVTransferConfig
from .disaggregated import DisaggregatedConnector
from .staged import StagedTransferWorker
from .timing import PhaseTimes, TransferStamps

logger = logging.getLogger("corectl.kv_transfer")
_REQUEST, _HEADER, _PAYLOAD = 1, 2, 3
_ID_WORDS = MAX_TRANSFER_ID // 8
# A header: found (1; 0 never saved; _DROPPED dropped unfetched), the element size, the blocks' six dimensions.
_HEADER_LEN = 8
# Ids of saves dropped unfetched that a producer remembers, so a consumer asking for one learns at once.
_GONE_IDS = 4096
_DROPPED = -1
# How often a consumer looks whether NCCL finished receiving (the thread sleeps between looks).
_POLL_S = 0.0002
# Set at interpreter exit: a producer whose consumer went away then stops instead of waiting again
# (a group still forming while the process exits aborts it).
_exiting = threading.Event()
atexit.register(_exiting.set)


def rendezvous(config: KVTransferConfig) -> tuple[str, int]:
    url = config.extra("rendezvous", None)
    if url is None:
        return config.kv_ip, config.kv_port
    parsed = urlparse(url)
    if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
        raise ConfigError("kv_transfer_config", f"rendezvous must look like tcp://HOST:PORT, got {url!r}")
    return parsed.hostname, parsed.port


def _encode_request(transfer: KVBlockTransfer) -> torch.Tensor:
    raw = transfer.transfer_id.encode().ljust(MAX_TRANSFER_ID, b"\0")
    words = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    return torch.cat([torch.tensor([transfer.first_block, len(transfer.block_ids)]), words])


def _decode_request(request: torch.Tensor) -> tuple[str, int, int]:
    raw = request[2:].numpy().tobytes().rstrip(b"\0")
    return raw.decode(), int(request[0]), int(request[1])


class TorchDistributedWorker(StagedTransferWorker):
    def __init__(self, config: KVTransferConfig, access: KVCacheAccess):
        super().__init__(config, access)
        self.host, self.port = rendezvous(config)
        self.timeout = datetime.timedelta(seconds=float(config.extra("timeout_s", 60.0)))
        self.load_timeout_s = float(config.extra("load_timeout_s", 30.0))
        self.ttl_s = float(config.extra("ttl_s", 300.0))
        # What the producer holds for consumers that have not asked yet (on the GPU with NCCL, outside
        # the KV pool): past it the oldest saves go, and their requests recompute on the decode side.
        self.max_saved_bytes = int(config.extra("max_saved_bytes", 8 << 30))
        cache = access.kv_caches()[0]
        self.dtype = cache.dtype
        # NCCL moves device memory (the gathered blocks are sent from where they are); gloo host memory.
        self.device = cache.device if access.distributed_backend == "nccl" else None
        self.publishes_device_blocks = self.device is not None
        # NCCL sends and receives run on this stream: on the default one they would queue behind the
        # forward passes already launched (the blocks they move are complete when they start).
        self._stream = None if self.device is None else torch.get_device_module(self.device).Stream(self.device)
        self._closed = False
        self._groups = None
        self._store = None
        self.serve_times = PhaseTimes("serve", ("wait for save", "send"), moving="send")
        # Producer: blocks by transfer id, with when they were saved.
        self._saved: dict[str, tuple[torch.Tensor, float]] = {}
        # Producer: ids dropped unfetched (past the cap or the TTL): asked for, they fail at once
        # instead of holding the one serving thread (and every transfer behind it) for load_timeout_s.
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._cond = threading.Condition()
        if config.kv_role == "kv_producer":
            threading.Thread(target=self._serve_forever, name="corectl-kv-serve", daemon=True).start()

    def _join(self, rank: int) -> tuple:
        """Fresh two-rank groups, (asks and headers, blocks); blocks until the peer joins or the
        timeout passes."""
        self._store = dist.TCPStore(self.host, self.port, 2, rank == 0, timeout=self.timeout, wait_for_workers=False)
        control = dist.ProcessGroupGloo(dist.PrefixStore("control", self._store), rank, 2, self.timeout)
        if self.device is None:
            return control, control
        return control, dist.ProcessGroupNCCL(dist.PrefixStore("blocks", self._store), rank, 2,
                                              dist.ProcessGroupNCCL.Options())

    # -- producer ---------------------------------------------------------------------------

    def publish(self, transfer_id: str, blocks: torch.Tensor) -> None:
        blocks = blocks.contiguous() if self.device is None else blocks.to(self.device)
        now = time.monotonic()
        with self._cond:
            for stale in [key for key, (_, saved) in self._saved.items() if now - saved > self.ttl_s]:
                self._forget(stale)
            self._saved[transfer_id] = (blocks, now)
            self._drop_oldest_past_cap()
            self._cond.notify_all()

    def _drop_oldest_past_cap(self) -> None:
        """Saves are kept in the order they came (dict order), so the first are the oldest."""
        held = sum(t.numel() * t.element_size() for t, _ in self._saved.values())
        while held > self.max_saved_bytes and len(self._saved) > 1:
            transfer_id, (dropped, _) = next(iter(self._saved.items()))
            self._forget(transfer_id)
            held -= dropped.numel() * dropped.element_size()
            logger.warning("KV transfer %s dropped unfetched: saves held past max_saved_bytes=%d (the decode "
                           "instance recomputes that prompt)", transfer_id, self.max_saved_bytes)

    def _forget(self, transfer_id: str) -> None:
        """Drop a save unfetched (the caller holds `_cond`), remembering its id."""
        del self._saved[transfer_id]
        self._gone[transfer_id] = None
        if len(self._gone) > _GONE_IDS:
            self._gone.popitem(last=False)

    def _take(self, transfer_id: str) -> torch.Tensor | bool:
        """The blocks saved under `transfer_id`, waiting up to load_timeout_s for them; False if they
        were dropped unfetched, True if they never came."""
        with self._cond:
            self._cond.wait_for(lambda: transfer_id in self._saved or transfer_id in self._gone,
                                timeout=self.load_timeout_s)
            entry = self._saved.pop(transfer_id, None)
            return entry[0] if entry is not None else transfer_id not in self._gone

    def _serve_forever(self) -> None:
        while not (self._closed or _exiting.is_set()):
            try:
                groups = self._join(0)
                while not self._closed:
                    self._serve_one(*groups)
            except Exception as exc:  # the consumer went away: wait for the next one
                if not (self._closed or _exiting.is_set()):
                    logger.warning("KV transfer group with the consumer ended (%s); waiting for it again", exc)
                    time.sleep(1.0)
            finally:
                self._store = None

    def _serve_one(self, control, data) -> None:
        request = torch.zeros(2 + _ID_WORDS, dtype=torch.int64)
        control.recv([request], 1, _REQUEST).wait()
        transfer_id, first, count = _decode_request(request)
        stamps = TransferStamps(transfer_id)
        blocks = self._take(transfer_id)
        if not isinstance(blocks, torch.Tensor) or blocks.shape[2] < first + count:
            missing = torch.zeros(_HEADER_LEN, dtype=torch.int64)
            missing[0] = _DROPPED if blocks is False else 0
            control.send([missing], 1, _HEADER).wait()
            return
        stamps.stamp()
        with self._on_stream(blocks):
            part = blocks[:, :, first:first + count].contiguous()
            control.send([torch.tensor([1, part.element_size(), *part.shape])], 1, _HEADER).wait()
            # NCCL: queued on the stream (the group keeps `part` alive until it is sent); gloo: sent.
            data.send([part.view(-1).view(torch.uint8)], 1, _PAYLOAD).wait()
        stamps.num_bytes = part.numel() * part.element_size()
        self.serve_times.finish(stamps)

    def _on_stream(self, blocks: torch.Tensor | None = None):
        """Run the NCCL work on this connector's stream; `blocks` (made on the default stream) are
        read there, so their memory must not be reused before that stream is done with them."""
        if self._stream is None:
            return contextlib.nullcontext()
        if blocks is not None:
            blocks.record_stream(self._stream)
        return torch.get_device_module(self.device).stream(self._stream)

    # -- consumer ---------------------------------------------------------------------------

    def fetch(self, transfer: KVBlockTransfer) -> torch.Tensor:
        try:
            if self._groups is None:
                self._groups = self._join(1)
            return self._ask(*self._groups, transfer)
        except (RuntimeError, ValueError, dist.DistBackendError) as exc:
            self._groups = self._store = None  # the next load joins new groups
            raise RuntimeError(f"the producer at {self.host}:{self.port} did not answer: {exc}") from exc

    def _ask(self, control, data, transfer: KVBlockTransfer) -> torch.Tensor:
        control.send([_encode_request(transfer)], 0, _REQUEST).wait()
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        control.recv([header], 0, _HEADER).wait()
        found, element_size, *shape = header.tolist()
        if found == _DROPPED:
            raise LookupError(f"the producer dropped the blocks of {transfer.transfer_id!r} unfetched "
                              "(held past max_saved_bytes or ttl_s)")
        if not found:
            raise LookupError(f"the producer holds no blocks under {transfer.transfer_id!r}")
        if element_size != torch.empty((), dtype=self.dtype).element_size():
            raise ValueError(f"the producer's K/V has {element_size}-byte elements, this instance's another size")
        with self._on_stream():
            payload = torch.empty(element_size * int(torch.tensor(shape).prod()), dtype=torch.uint8,
                                  device=self.device)
            work = data.recv([payload], 0, _PAYLOAD)
            if self._stream is not None:
                self._until_done(work)
            work.wait()  # gloo: receives; NCCL: raises what the transport reported
        return payload.view(self.dtype).view(shape)

    def _until_done(self, work) -> None:
        """Block this thread until NCCL's `work` is done: its `wait` only orders streams, and the
        engine's thread reads the blocks next. A producer that stops sending fails the load."""
        deadline = time.monotonic() + self.load_timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the blocks did not arrive within {self.load_timeout_s} s")
            time.sleep(_POLL_S)

    def close(self) -> None:
        self._closed = True
        super().close()


class TorchDistributedConnector(DisaggregatedConnector):
    name = "TorchDistributedConnector"
    worker_cls = TorchDistributedWorker

    @classmethod
    def check_config(cls, config: KVTransferConfig, engine: EngineConfig) -> None:
        super().check_config(config, engine)
        if config.kv_role == "kv_both":
            raise ConfigError("kv_transfer_config", "TorchDistributedConnector joins one producer (kv_producer) "
                              "and one consumer (kv_consumer); kv_both needs SharedMemoryConnector")
        rendezvous(config)
