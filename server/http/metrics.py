"""Prometheus metrics: vLLM V1's set under vLLM's names (`vllm:` prefix, label `model_name`), so
dashboards, autoscalers and routers keyed on them work unchanged; `--metrics-prefix corectl:` serves
the same series under our own prefix instead.

Gauges and the engine's cumulative counters are read from each engine core's latest
`SchedulerStats` at scrape time, one sample per engine labelled `engine` ("0", "1", ... with
`--data-parallel-size`; always "0" without); per-request counters and histograms are updated by the
request tracker as outputs arrive and cover the whole server.
"""
from __future__ import annotations

import bisect
import os
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Sequence

from corectl.engine.messages import ITERATION_TOKENS_BUCKETS, SchedulerStats
from corectl.outputs import EmbeddingRequestOutput, RequestMetrics, RequestOutput
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
_REQUEST_TIME_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                         120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_N_BUCKETS = [1, 2, 5, 10, 20]
DEFAULT_PREFIX = "vllm:"
_LABELS = ["model_name"]
_ENGINE_LABELS = ["model_name", "engine"]


def observe_all(histograms: Sequence[Histogram], values: list[float]) -> None:
    """`observe(v)` in each of `histograms` (children with the same buckets) for every v in `values`,
    with one lock-taking increment per bucket hit and one for the sum where `observe` takes two per
    value: a request's inter-token gaps are one value per token. It adds to the value objects that
    prometheus_client's Histogram keeps per bucket (`_buckets`, not cumulative: a value counts in the
    first bucket whose bound is >= it) and for the sum (`_sum`), the same objects multiprocess mode
    writes to its files; tests/server/test_stream_metrics.py checks the exposition against `observe`."""
    if not values:
        return
    bounds = histograms[0]._upper_bounds
    hits = Tally(bisect.bisect_left(bounds, value) for value in values)
    total = sum(values)
    for histogram in histograms:
        histogram._sum.inc(total)
        for index, count in hits.items():
            histogram._buckets[index].inc(count)


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
        ("num_requests_running", "Sequences in the running batch.", "num_running"),
        ("num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting"),
        ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
    )
    _COUNTERS = (
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
        ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
        ("num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.", "num_preemptions"),
        ("spec_decode_num_drafts", "Speculative drafts verified (one per request and step).",
         "spec_decode_num_drafts"),
        ("spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_decode_num_draft_tokens"),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens"),
        ("kv_offload_hit_tokens", "Prompt tokens whose K/V the host tier gave back (--kv-offload-bytes).",
         "kv_offload_hit_tokens"),
        ("kv_load_failures", "KV loads that failed, their prompts recomputed instead.", "kv_load_failures"),
    )
    # vLLM's prompt_tokens_by_source: where each prompt token's K/V came from.
    _PROMPT_SOURCES = (("local_compute", "prompt_tokens_computed"), ("local_cache_hit", "prefix_cache_hits"),
                       ("external_kv_transfer", "prompt_tokens_transferred"))

    def __init__(self, model_name: str, engine_stats: Callable[[], list[SchedulerStats]], max_loras: int | None,
                 prefix: str, cache_config: dict[str, str] | None):
        self._model_name = model_name
        self._engine_stats = engine_stats
        self._max_loras = max_loras
        self._prefix = prefix
        self._cache_config = cache_config

    def collect(self) -> Iterable:
        engines = list(enumerate(self._engine_stats()))
        for family_cls, metrics in ((GaugeMetricFamily, self._GAUGES), (CounterMetricFamily, self._COUNTERS)):
            for name, doc, field in metrics:
                family = family_cls(self._prefix + name, doc, labels=_ENGINE_LABELS)
                for index, stats in engines:
                    family.add_metric([self._model_name, str(index)], getattr(stats, field))
                yield family
        yield self._accepted_per_position(engines)
        yield self._labelled("prompt_tokens_by_source", "Prompt tokens by where their K/V came from.", "source",
                             self._PROMPT_SOURCES, engines)
        yield self._labelled("kv_transfer_bytes", "Bytes a KV connector moved (disaggregated prefill, host tier).",
                             "direction", (("load", "kv_transfer_bytes_loaded"), ("save", "kv_transfer_bytes_saved")),
                             engines)
        yield self._iteration_tokens(engines)
        if self._cache_config is not None:
            info = GaugeMetricFamily(self._prefix + "cache_config_info", "The KV cache's configuration.",
                                     labels=list(self._cache_config))
            info.add_metric(list(self._cache_config.values()), 1.0)
            yield info
        if self._max_loras is not None:
            yield self._lora_info(engines)

    def _iteration_tokens(self, engines: list[tuple[int, SchedulerStats]]) -> HistogramMetricFamily:
        """vLLM's iteration_tokens_total: tokens scheduled per engine step."""
        family = HistogramMetricFamily(self._prefix + "iteration_tokens_total", "Tokens scheduled per engine step.",
                                       labels=_ENGINE_LABELS)
        bounds = [str(float(b)) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
        for index, stats in engines:
            counts = stats.iteration_tokens_counts or [0] * len(bounds)
            cumulative, running = [], 0
            for bound, count in zip(bounds, counts):
                running += count
                cumulative.append((bound, running))
            family.add_metric([self._model_name, str(index)], cumulative, float(stats.iteration_tokens_sum))
        return family

    def _labelled(self, name: str, doc: str, label: str, fields: tuple[tuple[str, str], ...],
                  engines: list[tuple[int, SchedulerStats]]) -> CounterMetricFamily:
        family = CounterMetricFamily(self._prefix + name, doc, labels=_ENGINE_LABELS + [label])
        for index, stats in engines:
            for value, field in fields:
                family.add_metric([self._model_name, str(index), value], getattr(stats, field))
        return family

    def _accepted_per_position(self, engines: list[tuple[int, SchedulerStats]]) -> CounterMetricFamily:
        family = CounterMetricFamily(self._prefix + "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     labels=_ENGINE_LABELS + ["position"])
        for index, stats in engines:
            for position, accepted in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                family.add_metric([self._model_name, str(index), str(position)], accepted)
        return family

    def _lora_info(self, engines: list[tuple[int, SchedulerStats]]) -> GaugeMetricFamily:
        """vLLM's `lora_requests_info`: the adapters of running and waiting requests as labels
        (comma-separated names), the scrape time as the value."""
        family = GaugeMetricFamily(self._prefix + "lora_requests_info", "Running and waiting LoRA adapters.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", "engine"])
        now = time.time()
        for index, stats in engines:
            family.add_metric([str(self._max_loras), ",".join(stats.waiting_lora_adapters),
                               ",".join(stats.running_lora_adapters), str(index)], now)
        return family


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, engine_stats: Callable[[], list[SchedulerStats]],
                 max_loras: int | None = None, prefix: str = DEFAULT_PREFIX,
                 cache_config: dict[str, str] | None = None):
        """`engine_stats` gives each engine core's latest stats, in engine order; `max_loras` is set
        when LoRA is on; `prefix` starts every series' name; `cache_config` labels `cache_config_info`."""
        self.model_name = model_name
        self.prefix = prefix
        self.registry = CollectorRegistry()
        engines = _SchedulerCollector(model_name, engine_stats, max_loras, prefix, cache_config)
        self.registry.register(engines)
        self._scraped = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Several API processes (--api-server-count): each writes its request counts to the shared
            # folder and a scrape adds up every process's; each sees every engine's stats itself.
            self._scraped = CollectorRegistry()
            MultiProcessCollector(self._scraped)
            self._scraped.register(engines)
        reg, name = self.registry, model_name
        self.prompt_tokens = Counter(prefix + "prompt_tokens", "Prompt tokens of admitted requests.",
                                     _LABELS, registry=reg).labels(name)
        self.generation_tokens = Counter(prefix + "generation_tokens", "Generated tokens.",
                                         _LABELS, registry=reg).labels(name)
        self._success = Counter(prefix + "request_success", "Finished sequences by finish reason.",
                                _LABELS + ["finished_reason"], registry=reg)
        self._success_labels = {reason: self._success.labels(name, reason) for reason in ("stop", "length", "abort")}
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds", "Time per output token (as vLLM V1: each "
                                    "inter-token latency).", _ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                          _LATENCY_BUCKETS)
        self.prefill_time = self._histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                            _REQUEST_TIME_BUCKETS)
        self.decode_time = self._histogram("request_decode_time_seconds", "First token to last token.",
                                           _REQUEST_TIME_BUCKETS)
        self.inference_time = self._histogram("request_inference_time_seconds", "First scheduled to last token.",
                                              _REQUEST_TIME_BUCKETS)
        sizes = token_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram("request_prompt_tokens", "Prompt tokens per request.", sizes)
        self.request_generation_tokens = self._histogram("request_generation_tokens", "Generated tokens per request.",
                                                         sizes)
        self.params_n = self._histogram("request_params_n", "The n of each request.", _N_BUCKETS)
        self.params_max_tokens = self._histogram("request_params_max_tokens", "The max_tokens of each request.",
                                                 sizes)
        self._lora_requests = Counter(prefix + "lora_requests", "Requests admitted per LoRA adapter.",
                                      _LABELS + ["lora_name"], registry=reg)

    def count_generated(self, outputs: list[RequestOutput | EmbeddingRequestOutput]) -> None:
        """One engine step's outputs (deltas): their new tokens in one increment (per step, as vLLM
        counts them, rather than one lock-taking increment per token of every stream)."""
        tokens = sum(out.num_tokens for out in outputs if isinstance(out, RequestOutput))
        if tokens:
            self.generation_tokens.inc(tokens)

    def observe_params(self, n: int, max_tokens: int | None) -> None:
        """An engine request's n and max_tokens (unset: the context's length), once it ended; a
        request refused before it ran is not counted."""
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)

    def count_lora_request(self, lora_name: str) -> None:
        self._lora_requests.labels(self.model_name, lora_name).inc()

    def lora_request_counts(self) -> dict[str, int]:
        """This process's count of admitted requests per adapter name (the dashboard's)."""
        return {sample.labels["lora_name"]: int(sample.value) for family in self._lora_requests.collect()
                for sample in family.samples if sample.name.endswith("_total")}

    def _histogram(self, metric: str, doc: str, buckets: list[float]):
        return Histogram(self.prefix + metric, doc, _LABELS, buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def observe_finished(self, metrics: RequestMetrics | None, finish_reasons: list[str], now: float) -> None:
        """Record a request that ended (finished or aborted); `metrics` are the client's timings, None
        for a request aborted before its first output (cancelled while queued): it counts, untimed."""
        for reason in finish_reasons:
            self._success_labels.setdefault(reason, self._success.labels(self.model_name, reason)).inc()
        if metrics is None:
            return
        self.request_prompt_tokens.observe(metrics.num_prompt_tokens)
        self.request_generation_tokens.observe(metrics.num_generation_tokens)
        if metrics.first_token_time is not None:
            self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
        self._observe_phases(metrics)
        times = metrics.token_times
        observe_all((self.itl, self.tpot), [later - earlier for earlier, later in zip(times, times[1:])])
        self.e2e.observe((metrics.finished_time or now) - metrics.arrival_time)

    def _observe_phases(self, metrics: RequestMetrics) -> None:
        """vLLM's prefill (scheduled to first token), decode (first to last token) and inference
        (scheduled to last token) times of a request that produced tokens."""
        scheduled, first, last = metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time
        if scheduled is None or first is None:
            return
        self.prefill_time.observe(first - scheduled)
        if last is not None:
            self.decode_time.observe(last - first)
            self.inference_time.observe(last - scheduled)

    def render(self) -> bytes:
        return generate_latest(self._scraped)
