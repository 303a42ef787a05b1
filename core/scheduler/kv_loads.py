"""Prompt tokens a KV connector brings in, as the scheduler accounts for them (`corectl.kv_transfer`).

After a waiting request's local prefix-cache hit, the connector may load more of its prompt:
synchronously (the worker copies the blocks before the step's forward pass, so the request
starts at once from the loaded tokens, like a longer hit) or asynchronously (the request is
parked here, holding its blocks, until a step's `KVTransferReport` says the load finished or
failed). A finished load advances the request's computed tokens over the loaded ones; a failed
one leaves them at the first block without valid K/V, so the request recomputes from there
(vLLM's KV load-failure recovery). Either way the request goes back to the front of the queue.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from ..kv import KVCacheManager, PrefixHit
from ..kv_transfer.base import KVConnectorScheduler
from ..request import Request
from ..step_messages import KVTransferReport
from .request_queue import RequestQueue

# Waiting requests looked at, once a step's token budget is spent, for loads to start.
LOOKAHEAD = 64


class KVLoads:
    def __init__(self, connector: KVConnectorScheduler, kv: KVCacheManager, block_size: int):
        self.connector = connector
        self.kv = kv
        self.block_size = block_size
        # Requests waiting for an asynchronous load, each with the computed count it brings them to.
        self._parked: dict[str, tuple[Request, int]] = {}
        self.prompt_tokens_transferred = 0
        self.failures = 0

    def external_tokens(self, req: Request, hit: PrefixHit) -> tuple[int, bool]:
        """Prompt tokens after the local hit that the connector loads, and whether asynchronously."""
        external, load_async = self.connector.get_num_new_matched_tokens(req, hit.num_tokens)
        return external, load_async and external > 0

    def allocated(self, req: Request, hit: PrefixHit, external: int, load_async: bool) -> None:
        """The request's blocks cover its hit and `external` loaded tokens: tell the connector, and
        park the request when the load is asynchronous."""
        self.connector.update_state_after_alloc(req, self.kv.block_ids(req), hit.num_tokens, external)
        if not load_async:
            self.prompt_tokens_transferred += external
            return
        req.num_computed_tokens = hit.num_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self._parked[req.request_id] = (req, hit.num_tokens + external)

    def start_ahead(self, waiting: RequestQueue, eligible: Callable[[Request], bool]) -> list[Request]:
        """Start the asynchronous loads of waiting requests once the step's token budget is spent:
        a load needs blocks, not tokens, and the producer holds a finished prefill's blocks only so
        long (up to its `max_saved_bytes`), so a load queued behind prompts that this instance
        computes itself could find them dropped and recompute its own prompt. Looks at most
        LOOKAHEAD requests ahead and stops at the first whose blocks do not fit; returns those
        passed over, in order, for the caller to put back in front."""
        passed: list[Request] = []
        for _ in range(min(len(waiting), LOOKAHEAD)):
            req = waiting.pop()
            if not eligible(req):
                passed.append(req)
                continue
            hit = self.kv.lookup_prefix(req)
            external, load_async = self.external_tokens(req, hit)
            if not load_async:
                passed.append(req)
                continue
            if self.kv.allocate(req, external, hit) is None:
                passed.append(req)
                break
            self.allocated(req, hit, external, True)
        return passed

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def discard(self, req: Request) -> bool:
        """Forget a parked request (aborted); whether it was parked."""
        return self._parked.pop(req.request_id, None) is not None

    def apply(self, report: KVTransferReport) -> list[Request]:
        """The parked requests whose loads the report settles, their computed tokens set, in order."""
        settled = []
        for req_id in report.loaded:
            req, num_loaded = self._parked.pop(req_id, (None, 0))
            if req is not None:
                self.prompt_tokens_transferred += num_loaded - req.num_computed_tokens
                req.num_computed_tokens = num_loaded
                self.kv.commit(req)
                settled.append(req)
        for req_id, bad_blocks in report.failed.items():
            req, _ = self._parked.pop(req_id, (None, 0))
            if req is not None:
                self.failures += 1
                block_ids = self.kv.block_ids(req)
                first_bad = min((block_ids.index(b) for b in bad_blocks if b in block_ids), default=len(block_ids))
                req.num_computed_tokens = min(req.num_computed_tokens, first_bad * self.block_size)
                settled.append(req)
        self.connector.update_report(report)
        return settled

    def counters(self) -> dict[str, int]:
        return {"prompt_tokens_transferred": self.prompt_tokens_transferred, "kv_load_failures": self.failures,
                **self.connector.counters()}
