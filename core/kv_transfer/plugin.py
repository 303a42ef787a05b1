"""The built-in KV connectors, registered through the `corectl` entry-point group like any other."""
from __future__ import annotations

from corectl.plugins import KVConnectorSpec, hookimpl


@hookimpl
def corectl_kv_connectors():
    yield KVConnectorSpec("SharedMemoryConnector", "corectl.kv_transfer.shared_memory:SharedMemoryConnector",
                          description="prefill and decode instances on one machine, blocks through /dev/shm")
    yield KVConnectorSpec("TorchDistributedConnector",
                          "corectl.kv_transfer.torch_distributed:TorchDistributedConnector",
                          description="a producer and a consumer instance, torch.distributed point-to-point "
                                      "(gloo on CPUs, NCCL on GPUs)")
    yield KVConnectorSpec("OffloadingConnector", "corectl.kv_transfer.host_tier:OffloadingConnector",
                          description="host-memory tier for evicted prefix-cache blocks (--kv-offload-bytes)")
