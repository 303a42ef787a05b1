"""Building an engine's KV connector from its config: the scheduler half in the engine process,
the worker half on each rank. The connector class comes from the plugin hook
(`corectl.discovery.resolve_kv_connector`); `--kv-offload-bytes` is the built-in
`OffloadingConnector` under another name."""
from __future__ import annotations

from ..config import EngineConfig
from ..discovery import resolve_kv_connector
from .base import KVCacheAccess, KVConnector, KVConnectorScheduler, KVConnectorWorker
from .config import KVTransferConfig


def transfer_config(engine: EngineConfig) -> KVTransferConfig | None:
    """The connector config the engine runs with: `kv_transfer_config`, or the host tier's."""
    if engine.kv_offload_bytes is not None:
        return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config={"offload_bytes": engine.kv_offload_bytes})
    return engine.kv_transfer_config


def _connector(engine: EngineConfig) -> tuple[KVTransferConfig, type[KVConnector]] | None:
    config = transfer_config(engine)
    if config is None:
        return None
    connector = resolve_kv_connector(config.kv_connector)
    connector.check_config(config, engine)
    return config, connector


def check_kv_connector(engine: EngineConfig) -> None:
    """Resolve and check the configured connector before anything loads (ConfigError when it is
    unknown or cannot serve this engine)."""
    _connector(engine)


def scheduler_connector(engine: EngineConfig, kv_bytes_per_block: int) -> KVConnectorScheduler | None:
    """The scheduler half (None without a connector); raises ConfigError for one it cannot run."""
    found = _connector(engine)
    if found is None:
        return None
    config, connector = found
    return connector.scheduler_cls(config, engine.block_size, kv_bytes_per_block)


def worker_connector(engine: EngineConfig, access: KVCacheAccess) -> KVConnectorWorker | None:
    """A rank's worker half (None without a connector)."""
    found = _connector(engine)
    if found is None:
        return None
    config, connector = found
    return connector.worker_cls(config, access)
