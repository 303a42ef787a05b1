"""`SharedMemoryConnector`: prefill and decode instances on one machine, blocks through host shared memory.

The producer writes each saved prompt's blocks to a file in a tmpfs folder (`/dev/shm/corectl-kv`
by default; `kv_connector_extra_config.path` names another, the same for both instances): a
header line (dtype and shape as JSON), then the raw bytes, written under a temporary name and
renamed, so a reader never sees half a file. The consumer waits for its transfer's file up to
`load_timeout_s` (default 30), reads the blocks it needs, and removes the file. A file nobody
read is removed by its producer after `ttl_s` (default 300) or when the producer stops.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

from ..step_messages import KVBlockTransfer
from .base import KVCacheAccess
from .config import KVTransferConfig
from .disaggregated import DisaggregatedConnector
from .staged import StagedTransferWorker

_SHM = Path("/dev/shm")
_POLL_S = 0.01


def _default_folder() -> Path:
    return (_SHM if _SHM.is_dir() else Path(tempfile.gettempdir())) / "corectl-kv"


class SharedMemoryWorker(StagedTransferWorker):
    def __init__(self, config: KVTransferConfig, access: KVCacheAccess):
        super().__init__(config, access)
        self.folder = Path(config.extra("path", _default_folder()))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.load_timeout_s = float(config.extra("load_timeout_s", 30.0))
        self.ttl_s = float(config.extra("ttl_s", 300.0))
        # Files this producer wrote, by path, with when: removed once stale.
        self._written: dict[Path, float] = {}

    def _path(self, transfer_id: str) -> Path:
        return self.folder / f"{transfer_id}.kv"

    def publish(self, transfer_id: str, blocks: torch.Tensor) -> None:
        self._remove_stale()
        blocks = blocks.contiguous()
        header = json.dumps({"dtype": str(blocks.dtype).removeprefix("torch."), "shape": list(blocks.shape)})
        with tempfile.NamedTemporaryFile("wb", dir=self.folder, suffix=".tmp", delete=False) as f:
            f.write(header.encode() + b"\n")
            f.write(memoryview(blocks.view(torch.uint8).numpy()))
        path = self._path(transfer_id)
        os.replace(f.name, path)
        self._written[path] = time.monotonic()

    def _remove_stale(self) -> None:
        now = time.monotonic()
        for path in [p for p, written in self._written.items() if now - written > self.ttl_s]:
            del self._written[path]
            path.unlink(missing_ok=True)

    def fetch(self, transfer: KVBlockTransfer) -> torch.Tensor:
        path = self._path(transfer.transfer_id)
        deadline = time.monotonic() + self.load_timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no blocks saved under {transfer.transfer_id!r} within {self.load_timeout_s} s")
            time.sleep(_POLL_S)
        data = path.read_bytes()
        path.unlink(missing_ok=True)
        header, _, payload = data.partition(b"\n")
        meta = json.loads(header)
        saved = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(getattr(torch, meta["dtype"]))
        saved = saved.view(meta["shape"])
        end = transfer.first_block + len(transfer.block_ids)
        if saved.shape[2] < end:
            raise ValueError(f"{saved.shape[2]} blocks were saved, blocks up to {end} are needed")
        return saved[:, :, transfer.first_block:end]

    def close(self) -> None:
        super().close()
        for path in self._written:
            path.unlink(missing_ok=True)


class SharedMemoryConnector(DisaggregatedConnector):
    name = "SharedMemoryConnector"
    worker_cls = SharedMemoryWorker

