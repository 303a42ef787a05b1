"""The scheduler side of disaggregated prefill/decode, shared by the built-in connectors.

A prefill instance (`kv_producer`, or `kv_both`) saves the blocks of a request that asked for it
(`do_remote_decode` in its `kv_transfer_params`) when the request finishes: every block holding
its prompt, under the request's `transfer_id`. A decode instance (`kv_consumer`, or `kv_both`)
loads them for a request that asks (`do_remote_prefill`, the same `transfer_id`): every prompt
token after its local prefix-cache hit except the last one, which it computes for its logits.
The load is asynchronous: the request waits, holding its blocks, until the worker reports it.
A request loads at most once: after a failure, or when it is preempted later, it recomputes; of
a request's `n` samples only the first loads. A request asking for its prompt's logprobs computes
its prompt: loaded positions would have none.

Blocks travel under the transfer id joined with a digest of the prompt's tokens
(`transfer_key`): the prompts of one batched request, which share its `kv_transfer_params`, each
get their own, and a decode request can never load the blocks of another prompt (a mismatch finds
nothing and recomputes).
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..config import EngineConfig
from ..errors import ConfigError
from ..request import Request
from ..step_messages import KVBlockTransfer, KVTransferMetadata, KVTransferReport
from .base import KVConnector, KVConnectorScheduler
from .config import MAX_TRANSFER_ID, KVTransferConfig, transfer_params

_DIGEST_CHARS = 16


def transfer_key(transfer_id: str, prompt_token_ids: list[int]) -> str:
    """The key one prompt's blocks travel under (at most MAX_TRANSFER_ID characters)."""
    digest = hashlib.blake2b(transfer_id.encode() + b"\0" + np.asarray(prompt_token_ids, dtype=np.int64).tobytes(),
                             digest_size=_DIGEST_CHARS // 2).hexdigest()
    return f"{transfer_id[:MAX_TRANSFER_ID - _DIGEST_CHARS - 1]}-{digest}"


class DisaggregatedScheduler(KVConnectorScheduler):
    def __init__(self, config, block_size: int, kv_bytes_per_block: int):
        super().__init__(config, block_size, kv_bytes_per_block)
        self._saves: list[KVBlockTransfer] = []
        self._loads: list[KVBlockTransfer] = []
        self._cancelled: list[str] = []
        # Requests whose asynchronous load is under way, and those that already had their one try.
        self._loading: set[str] = set()
        self._tried: set[str] = set()
        self._bytes_loaded = 0
        self._bytes_saved = 0

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = transfer_params(req.sampling_params.kv_transfer_params)
        # One transfer feeds one request: of n samples, the first loads and the others compute.
        if (params is None or not params.remote_prefill or not self.config.is_consumer or req.sample_index
                or req.request_id in self._tried or req.num_output_tokens
                or req.sampling_params.prompt_logprobs is not None):
            return 0, False
        return max(0, req.num_prompt_tokens - 1 - num_computed_tokens), True

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        params = transfer_params(req.sampling_params.kv_transfer_params)
        first = num_computed_tokens // self.block_size
        end = -(-(num_computed_tokens + num_external_tokens) // self.block_size)
        key = transfer_key(params.transfer_id, req.prompt_token_ids)
        self._loads.append(KVBlockTransfer(req.request_id, block_ids[first:end], key, first))
        self._loading.add(req.request_id)
        self._tried.add(req.request_id)

    def request_finished(self, req: Request, block_ids: list[int]) -> None:
        params = transfer_params(req.sampling_params.kv_transfer_params)
        if params is None or not params.remote_decode or not self.config.is_producer:
            return
        num_blocks = -(-req.num_prompt_tokens // self.block_size)
        self._bytes_saved += num_blocks * self.kv_bytes_per_block
        key = transfer_key(params.transfer_id, req.prompt_token_ids)
        self._saves.append(KVBlockTransfer(req.request_id, block_ids[:num_blocks], key))

    def request_released(self, req: Request) -> None:
        self._tried.discard(req.request_id)
        if req.request_id in self._loading:
            self._loading.discard(req.request_id)
            self._cancelled.append(req.request_id)

    def has_work(self) -> bool:
        return bool(self._saves or self._loads or self._cancelled or self._loading)

    def build_metadata(self) -> KVTransferMetadata | None:
        if not self.has_work():
            return None
        metadata = KVTransferMetadata(self._saves, self._loads, self._cancelled)
        self._saves, self._loads, self._cancelled = [], [], []
        return metadata

    def update_report(self, report: KVTransferReport) -> None:
        self._loading.difference_update(report.loaded)
        self._loading.difference_update(report.failed)
        self._bytes_loaded += report.bytes_loaded

    def counters(self) -> dict[str, int]:
        return {"kv_transfer_bytes_loaded": self._bytes_loaded, "kv_transfer_bytes_saved": self._bytes_saved}


class DisaggregatedConnector(KVConnector):
    """What the built-in disaggregated connectors share: this scheduler side, one rank per instance."""

    scheduler_cls = DisaggregatedScheduler

    @classmethod
    def check_config(cls, config: KVTransferConfig, engine: EngineConfig) -> None:
        # A rank's load completes when rank 0 reports it; the other ranks' would go unheard.
        if engine.world_size > 1:
            raise ConfigError("kv_transfer_config", f"{cls.name} moves the blocks of one rank: run the prefill "
                              "and decode instances on one rank each, without tensor or pipeline parallelism "
                              "(or use a plugin connector)")
