"""The scheduler's counters as `SchedulerStats` reports them: the histogram of tokens per step
(vLLM's `iteration_tokens_total`), the adapters of the requests it holds, speculation's counts."""
from __future__ import annotations

import bisect

from ..engine.messages import ITERATION_TOKENS_BUCKETS
from ..lora.admission import AdapterAdmission, adapter_names
from ..request import Request
from ..spec_decode.scheduling import DraftPlanner


class IterationCounts:
    def __init__(self):
        self.counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.total = 0

    def count(self, num_tokens: int) -> None:
        if num_tokens:
            self.counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
            self.total += num_tokens


def lora_stats(adapters: AdapterAdmission | None, requests: dict[str, Request]) -> dict:
    if adapters is None:
        return {}
    running, waiting = adapter_names(requests)
    return dict(running_lora_adapters=running, waiting_lora_adapters=waiting)


def spec_decode_stats(drafts: DraftPlanner | None) -> dict:
    if drafts is None:
        return {}
    counters = drafts.counters
    return dict(spec_decode_num_drafts=counters.num_drafts, spec_decode_num_draft_tokens=counters.num_draft_tokens,
                spec_decode_num_accepted_tokens=counters.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=list(counters.accepted_per_position))
