"""`--kv-transfer-config` (vLLM's JSON form) and a request's `kv_transfer_params`, checked at the edge.

    {"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer"}
    {"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer",
     "kv_connector_extra_config": {"rendezvous": "tcp://10.0.0.1:29600"}}

`EngineConfig.kv_transfer_config` takes a dict, its JSON text or a `KVTransferConfig`;
`resolve_kv_transfer_config` returns one checked record or raises a `ConfigError`. The connector
name is resolved through the `corectl_kv_connectors` plugin hook when the engine starts.

A request takes part in a transfer through `SamplingParams.kv_transfer_params` (vLLM's request
field): `{"do_remote_decode": true, "transfer_id": ID}` on the prefill instance (save the prompt's
blocks under ID once the request finishes) and `{"do_remote_prefill": true, "transfer_id": ID}` on
the decode instance (load them instead of computing the prompt). `corectl proxy` writes both.
"""
from __future__ import annotations

from typing import Any

import msgspec

from ..errors import ConfigError, InvalidRequestError
from ..json_option import decode_json_option

FIELD = "kv_transfer_config"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
MAX_TRANSFER_ID = 128


class KVTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """kv_connector: a connector registered through `corectl_kv_connectors` (built-ins:
    SharedMemoryConnector, TorchDistributedConnector); kv_role: kv_producer (prefill instance:
    saves finished prompts), kv_consumer (decode instance: loads them), kv_both (either, per
    request); kv_connector_extra_config: the connector's own options. engine_id, kv_rank,
    kv_parallel_size, kv_ip, kv_port, kv_buffer_device and kv_buffer_size are vLLM's fields, accepted
    so its configs parse (TorchDistributedConnector reads kv_ip and kv_port when no rendezvous is
    given). kv_load_failure_policy: "recompute" (vLLM's default), what a failed load does here;
    kv_connector_module_path and enable_permute_local_kv are refused when set (`check_vllm_fields`)."""

    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict[str, Any] = {}
    engine_id: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_device: str | None = None
    kv_buffer_size: float | None = None
    kv_load_failure_policy: str = "recompute"
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


def resolve_kv_transfer_config(value: Any) -> KVTransferConfig | None:
    """The checked config, None when `value` is None."""
    if value is None:
        return None
    config = value if isinstance(value, KVTransferConfig) else _parse(value)
    if config.kv_role not in KV_ROLES:
        raise ConfigError(FIELD, f"kv_role must be one of {', '.join(KV_ROLES)}; got {config.kv_role!r}")
    if not config.kv_connector:
        raise ConfigError(FIELD, "kv_connector must name a connector (see `corectl plugins`)")
    check_vllm_fields(config)
    return config


def check_vllm_fields(config: KVTransferConfig) -> None:
    """vLLM's fields whose other values ask for what is not built here, refused by name."""
    if config.kv_load_failure_policy != "recompute":
        raise ConfigError(FIELD, f"kv_load_failure_policy {config.kv_load_failure_policy!r} is not served: a failed "
                                 "load recomputes the prompt (\"recompute\", vLLM's default)")
    if config.kv_connector_module_path is not None:
        raise ConfigError(FIELD, "kv_connector_module_path is not read: connectors come from the "
                                 "corectl_kv_connectors plugin group (install the package that registers "
                                 f"{config.kv_connector!r}; `corectl plugins` lists them)")
    if config.enable_permute_local_kv:
        raise ConfigError(FIELD, "enable_permute_local_kv is not served: the instances' KV layouts must match")


def _parse(value: Any) -> KVTransferConfig:
    value = decode_json_option(FIELD, value)
    if not isinstance(value, dict):
        raise ConfigError(FIELD, "must be a JSON object such as {\"kv_connector\": \"SharedMemoryConnector\", "
                                 f"\"kv_role\": \"kv_producer\"}}, got {value!r}")
    try:
        return msgspec.convert(value, KVTransferConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(FIELD, str(exc).replace("$.", "")) from None


class TransferParams(msgspec.Struct, frozen=True):
    """A request's part in a transfer, read from its `kv_transfer_params`."""

    transfer_id: str
    remote_prefill: bool
    remote_decode: bool


def transfer_params(params: dict[str, Any] | None) -> TransferParams | None:
    """The transfer a request's `kv_transfer_params` asks for; None when it asks for none."""
    if not params or not (params.get("do_remote_prefill") or params.get("do_remote_decode")):
        return None
    return TransferParams(params["transfer_id"], bool(params.get("do_remote_prefill")),
                          bool(params.get("do_remote_decode")))


def check_transfer_params(params: dict[str, Any] | None) -> None:
    """Refuse malformed `kv_transfer_params` (InvalidRequestError naming the field)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise InvalidRequestError("kv_transfer_params must be an object", param="kv_transfer_params")
    for flag in ("do_remote_prefill", "do_remote_decode"):
        if not isinstance(params.get(flag, False), bool):
            raise InvalidRequestError(f"kv_transfer_params.{flag} must be a boolean",
                                      param=f"kv_transfer_params.{flag}")
    if params.get("do_remote_prefill") and params.get("do_remote_decode"):
        raise InvalidRequestError("kv_transfer_params sets both do_remote_prefill and do_remote_decode; a "
                                  "request is either the prefill or the decode half", param="kv_transfer_params")
    transfer_id = params.get("transfer_id")
    if (params.get("do_remote_prefill") or params.get("do_remote_decode")) and not (
            isinstance(transfer_id, str) and 0 < len(transfer_id) <= MAX_TRANSFER_ID
            and transfer_id.replace("-", "").replace("_", "").isalnum()):
        raise InvalidRequestError(f"kv_transfer_params.transfer_id must be 1 to {MAX_TRANSFER_ID} letters, digits, "
                                  "'-' or '_'", param="kv_transfer_params.transfer_id")
