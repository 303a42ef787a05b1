"""Prometheus metrics (vLLM V1's set under the `corectl:` prefix, label `model_name`).

Gauges and the engine's cumulative counters are read from each engine core's latest
`SchedulerStats` at scrape time, one sample per engine labelled `engine` ("0", "1", ... with
`--data-parallel-size`; always "0" without); per-request counters and histograms are updated by the
request tracker as outputs arrive and cover the whole server.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from corectl.engine.messages import SchedulerStats
from corectl.outputs import RequestMetrics
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
_LABELS = ["model_name"]
_ENGINE_LABELS = ["model_name", "engine"]


def token_buckets(max_value: int) -> list[float]:
    """1-2-5 buckets up to `max_value` (vLLM's `build_1_2_5_buckets`)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


class _SchedulerCollector(Collector):
    """Exposes each engine core's latest stats: gauges, and counters the scheduler keeps cumulatively."""

    _GAUGES = (
        ("corectl:num_requests_running", "Sequences in the running batch.", "num_running"),
        ("corectl:num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting"),
        ("corectl:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
    )
    _COUNTERS = (
        ("corectl:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
        ("corectl:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
        ("corectl:num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
         "num_preemptions"),
    )

    def __init__(self, model_name: str, engine_stats: Callable[[], list[SchedulerStats]], max_loras: int | None):
        self._model_name = model_name
        self._engine_stats = engine_stats
        self._max_loras = max_loras

    def collect(self) -> Iterable:
        engines = list(enumerate(self._engine_stats()))
        for family_cls, metrics in ((GaugeMetricFamily, self._GAUGES), (CounterMetricFamily, self._COUNTERS)):
            for name, doc, field in metrics:
                family = family_cls(name, doc, labels=_ENGINE_LABELS)
                for index, stats in engines:
                    family.add_metric([self._model_name, str(index)], getattr(stats, field))
                yield family
        if self._max_loras is not None:
            yield self._lora_info(engines)

    def _lora_info(self, engines: list[tuple[int, SchedulerStats]]) -> GaugeMetricFamily:
        """vLLM's `lora_requests_info`: the adapters of running and waiting requests as labels
        (comma-separated names), the scrape time as the value."""
        family = GaugeMetricFamily("corectl:lora_requests_info", "Running and waiting LoRA adapters.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", "engine"])
        now = time.time()
        for index, stats in engines:
            family.add_metric([str(self._max_loras), ",".join(stats.waiting_lora_adapters),
                               ",".join(stats.running_lora_adapters), str(index)], now)
        return family


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, engine_stats: Callable[[], list[SchedulerStats]],
                 max_loras: int | None = None):
        """`engine_stats` gives each engine core's latest stats, in engine order; `max_loras` is set
        when LoRA is on."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(model_name, engine_stats, max_loras))
        reg, name = self.registry, model_name
        self.prompt_tokens = Counter("corectl:prompt_tokens", "Prompt tokens of admitted requests.",
                                     _LABELS, registry=reg).labels(name)
        self.generation_tokens = Counter("corectl:generation_tokens", "Generated tokens.",
                                         _LABELS, registry=reg).labels(name)
        self._success = Counter("corectl:request_success", "Finished sequences by finish reason.",
                                _LABELS + ["finished_reason"], registry=reg)
        self._success_labels = {reason: self._success.labels(name, reason) for reason in ("stop", "length", "abort")}
        self.ttft = self._histogram("corectl:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = self._histogram("corectl:inter_token_latency_seconds", "Time between output tokens.",
                                   _ITL_BUCKETS)
        self.e2e = self._histogram("corectl:e2e_request_latency_seconds", "Arrival to last token.",
                                   _LATENCY_BUCKETS)
        self.queue_time = self._histogram("corectl:request_queue_time_seconds",
                                          "Arrival to first scheduled.", _LATENCY_BUCKETS)
        sizes = token_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram("corectl:request_prompt_tokens", "Prompt tokens per request.",
                                                     sizes)
        self.request_generation_tokens = self._histogram("corectl:request_generation_tokens",
                                                         "Generated tokens per request.", sizes)
        self._lora_requests = Counter("corectl:lora_requests", "Requests admitted per LoRA adapter.",
                                      _LABELS + ["lora_name"], registry=reg)

    def count_lora_request(self, lora_name: str) -> None:
        self._lora_requests.labels(self.model_name, lora_name).inc()

    def _histogram(self, metric: str, doc: str, buckets: list[float]):
        return Histogram(metric, doc, _LABELS, buckets=buckets, registry=self.registry).labels(self.model_name)

    def observe_finished(self, metrics: RequestMetrics, finish_reasons: list[str], now: float) -> None:
        """Record a request that ended (finished or aborted); `metrics` are the client's timings."""
        for reason in finish_reasons:
            self._success_labels.setdefault(reason, self._success.labels(self.model_name, reason)).inc()
        self.request_prompt_tokens.observe(metrics.num_prompt_tokens)
        self.request_generation_tokens.observe(metrics.num_generation_tokens)
        if metrics.first_token_time is not None:
            self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
        times = metrics.token_times
        for earlier, later in zip(times, times[1:]):
            self.itl.observe(later - earlier)
        self.e2e.observe((metrics.finished_time or now) - metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
