"""Metrics counted in bulk (a request's inter-token gaps, a step's new tokens) must read exactly as
the same values observed one by one through prometheus_client's public API."""
from __future__ import annotations

import random

from corectl.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from corectl.server.http.metrics import _ITL_BUCKETS, ServerMetrics, observe_all
from prometheus_client import CollectorRegistry, Histogram


def _samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
            for s in family.samples if not s.name.endswith("_created")}


def _histograms(count: int) -> tuple[CollectorRegistry, list]:
    registry = CollectorRegistry()
    return registry, [Histogram(f"h{i}", "gaps", ["model_name"], buckets=_ITL_BUCKETS,
                                registry=registry).labels("m") for i in range(count)]


def test_observe_all_reads_as_observe_one_by_one():
    rng = random.Random(7)
    values = [rng.expovariate(20) for _ in range(2000)] + list(_ITL_BUCKETS) + [0.0, 1e3]
    one_by_one, (first, second) = _histograms(2)
    in_bulk, histograms = _histograms(2)
    for value in values:
        first.observe(value)
        second.observe(value)
    observe_all(histograms, values[:1000])
    observe_all(histograms, values[1000:])
    observe_all(histograms, [])
    expected, got = _samples(one_by_one), _samples(in_bulk)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if key[0].endswith("_sum"):
            assert abs(got[key] - value) <= 1e-9 * value  # one sum of the values against running adds
        else:
            assert got[key] == value, key


def test_generated_tokens_are_counted_per_step():
    metrics = ServerMetrics("m", 512, lambda: [])
    step = [RequestOutput("a", None, [1], [CompletionOutput(0, "x", [5, 6])], False),
            RequestOutput("b", None, [1], [CompletionOutput(0, "", []), CompletionOutput(1, "y", [7])], False),
            EmbeddingRequestOutput("c", EmbeddingOutput([0.5]), [1, 2])]
    metrics.count_generated(step)
    metrics.count_generated([])
    assert metrics.registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "m"}) == 3
