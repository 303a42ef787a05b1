"""What an engine client saw lately, for live views (the server's ops dashboard).

`RecentActivity` keeps the last `window_s` seconds in `bucket_s` buckets: output tokens, time to
first token and inter-token latency, and the scheduler's cumulative counters at each bucket's start
and end, so rates (prefix-cache hit rate, preemptions) come out per bucket. TTFT and ITL follow the
Prometheus histograms' definitions (arrival to first token; gaps between a request's token
arrivals) but are observed as tokens arrive, not when requests finish. Latencies go into
log-spaced bins about 12% wide, so memory stays bounded at any token rate.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from ..outputs import EmbeddingRequestOutput, RequestOutput
from .messages import EngineSnapshot, SchedulerStats
from .output_processor import OutputProcessor

_BIN_BASE_S = 1e-4
_BIN_RATIO = 2 ** (1 / 6)
_INV_LOG_RATIO = 1 / math.log(_BIN_RATIO)


def _bin(seconds: float) -> int:
    return int(math.log(seconds / _BIN_BASE_S) * _INV_LOG_RATIO) if seconds > _BIN_BASE_S else 0


def _percentile(bins: dict[int, int], q: float) -> float | None:
    """The q-quantile (0..1, nearest rank) of binned samples, as the geometric middle of its bin."""
    if not bins:
        return None
    rank, seen = math.ceil(q * sum(bins.values())), 0
    for index in sorted(bins):
        seen += bins[index]
        if seen >= rank:
            break
    return _BIN_BASE_S * _BIN_RATIO ** (index + 0.5)


def _add(into: dict[int, int], bins: dict[int, int]) -> None:
    for index, count in bins.items():
        into[index] = into.get(index, 0) + count


@dataclass
class _Bucket:
    start: float
    start_stats: SchedulerStats
    stats: SchedulerStats
    output_tokens: int = 0
    ttft: dict[int, int] = field(default_factory=dict)
    itl: dict[int, int] = field(default_factory=dict)


class ActivityPoint(msgspec.Struct, gc=False):
    """One bucket: `age_s` is how long ago it started; latencies in seconds (None: no sample);
    `prefix_hit_rate` is None when no prompt token was looked up in it."""

    age_s: float
    output_tokens_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    prefix_hit_rate: float | None
    preemptions: int


class ActivitySummary(msgspec.Struct, gc=False):
    """The whole window at a glance; `output_tokens_per_s` over its last `rate_window_s` seconds."""

    window_s: float
    bucket_s: float
    output_tokens_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    prefix_hit_rate: float | None
    preemptions: int
    points: list[ActivityPoint]


class RecentActivity:
    def __init__(self, window_s: float = 300.0, bucket_s: float = 2.0, rate_window_s: float = 10.0):
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.rate_window_s = rate_window_s
        self._buckets: deque[_Bucket] = deque()

    def observe(self, outputs: Iterable[RequestOutput], stats: SchedulerStats, now: float | None = None) -> None:
        """One engine step as the client delivered it: its (delta) outputs and the stats after it.

        Each output's `metrics.delta_token_times` says how many token times it brought."""
        bucket = self._bucket(time.monotonic() if now is None else now)
        bucket.stats = stats
        ttft, itl = bucket.ttft, bucket.itl
        for out in outputs:
            if isinstance(out, EmbeddingRequestOutput):
                continue  # no tokens: an embedding has no TTFT or ITL
            metrics = out.metrics
            if metrics is None or not metrics.delta_token_times:
                continue
            bucket.output_tokens += out.num_tokens
            times = metrics.token_times
            end = len(times)
            start = end - metrics.delta_token_times
            if start == 0:
                first = _bin(times[0] - metrics.arrival_time)
                ttft[first] = ttft.get(first, 0) + 1
            for i in range(max(start, 1), end):
                gap = _bin(times[i] - times[i - 1])
                itl[gap] = itl.get(gap, 0) + 1

    def _bucket(self, now: float) -> _Bucket:
        start = now - now % self.bucket_s
        buckets = self._buckets
        if buckets and buckets[-1].start == start:
            return buckets[-1]
        # The counters only change in steps, and every step is observed: the last bucket's end is this one's start.
        stats = buckets[-1].stats if buckets else SchedulerStats()
        buckets.append(_Bucket(start, stats, stats))
        while buckets[0].start < now - self.window_s:
            buckets.popleft()
        return buckets[-1]

    def summary(self, now: float | None = None) -> ActivitySummary:
        now = time.monotonic() if now is None else now
        buckets = [b for b in self._buckets if b.start >= now - self.window_s]
        points, ttft, itl = [], {}, {}
        for bucket in buckets:
            points.append(self._point(bucket, now))
            _add(ttft, bucket.ttft)
            _add(itl, bucket.itl)
        recent_start = now - self.rate_window_s
        recent_start -= recent_start % self.bucket_s
        recent = sum(b.output_tokens for b in buckets if b.start >= recent_start)
        first, last = (buckets[0].start_stats, buckets[-1].stats) if buckets else (SchedulerStats(),) * 2
        return ActivitySummary(
            window_s=self.window_s, bucket_s=self.bucket_s,
            output_tokens_per_s=recent / max(now - recent_start, self.bucket_s),
            ttft_p50=_percentile(ttft, 0.5), ttft_p99=_percentile(ttft, 0.99),
            itl_p50=_percentile(itl, 0.5), itl_p99=_percentile(itl, 0.99),
            prefix_hit_rate=_hit_rate(first, last), preemptions=last.num_preemptions - first.num_preemptions,
            points=points,
        )

    def _point(self, bucket: _Bucket, now: float) -> ActivityPoint:
        before = bucket.start_stats
        span = min(self.bucket_s, max(now - bucket.start, 1e-3))
        return ActivityPoint(
            age_s=now - bucket.start, output_tokens_per_s=bucket.output_tokens / span,
            ttft_p50=_percentile(bucket.ttft, 0.5), ttft_p99=_percentile(bucket.ttft, 0.99),
            itl_p50=_percentile(bucket.itl, 0.5), itl_p99=_percentile(bucket.itl, 0.99),
            prefix_hit_rate=_hit_rate(before, bucket.stats),
            preemptions=bucket.stats.num_preemptions - before.num_preemptions,
        )


def _hit_rate(before: SchedulerStats, after: SchedulerStats) -> float | None:
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    return (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries > 0 else None


class LiveRequest(msgspec.Struct, gc=False):
    """A request the client is serving. `state` is "running" when the engine's latest snapshot
    lists one of its samples as running, else "waiting" (queued, on its way, or preempted).
    Times are `time.monotonic()` seconds."""

    request_id: str
    state: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float
    first_token_time: float | None


def live_requests(processor: OutputProcessor, snapshot: EngineSnapshot | None, limit: int) -> list[LiveRequest]:
    """The `limit` oldest live requests of `processor`.

    A request is running when the snapshot lists it, or when its first token arrived after the
    snapshot was taken (snapshots are up to a few hundred milliseconds old; both clocks are
    `time.monotonic()` of this host)."""
    running = set(snapshot.running_ids) if snapshot is not None else set()
    taken = snapshot.timestamp if snapshot is not None else float("-inf")
    rows = []
    for tracker in processor.trackers.values():
        if len(rows) == limit:
            break
        metrics = tracker.metrics
        started_since = metrics.first_token_time is not None and metrics.first_token_time >= taken
        listed = running.intersection(processor.child_ids(tracker.request_id))
        state = "running" if listed or started_since else "waiting"
        rows.append(LiveRequest(tracker.request_id, state, metrics.num_prompt_tokens,
                                metrics.num_generation_tokens, metrics.arrival_time, metrics.first_token_time))
    return rows
