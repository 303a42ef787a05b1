"""`corectl bench serve` arithmetic against numpy and vLLM's definitions (no server needed)."""
from __future__ import annotations

import numpy as np
import pytest
from corectl.server.bench.report import (
    RequestResult,
    format_report,
    percentile,
    summarize,
)
from corectl.server.http.metrics import token_buckets


@pytest.mark.parametrize("p", [0, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(p):
    values = list(np.random.default_rng(0).exponential(size=37))
    assert percentile(values, p) == pytest.approx(np.percentile(values, p))


def test_summary_uses_vllm_definitions():
    fast = RequestResult(prompt_len=10, success=True, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4)
    slow = RequestResult(prompt_len=10, success=True, output_tokens=3, ttft=0.2, latency=1.2, itl=[0.5, 0.5])
    failed = [RequestResult(prompt_len=10, error="HTTP 429: queue full") for _ in range(2)]
    summary = summarize([fast, slow, *failed], duration=2.0, percentiles=[99], client_cpu=[0.95, 0.4])
    assert (summary["completed"], summary["failed"]) == (2, 2)
    assert summary["total_input_tokens"] == 20 and summary["total_output_tokens"] == 8
    assert summary["output_throughput"] == 4.0 and summary["total_token_throughput"] == 14.0
    assert summary["tpot_ms"]["mean"] == pytest.approx((100 + 500) / 2)  # (E2EL - TTFT) / (tokens - 1)
    assert summary["itl_ms"]["mean"] == pytest.approx(1000 * (0.4 + 1.0) / 6)  # over all gaps
    assert summary["ttft_ms"]["median"] == pytest.approx(150)
    assert summary["errors"] == {"HTTP 429: queue full": 2}
    report = format_report(summary, [99])
    assert "Failed requests:                        2" in report and "P99 E2EL (ms):" in report
    assert "error (2 requests): HTTP 429: queue full" in report
    assert "client CPU, share of one core: 95%, 40%" in report and "warning: a client was busy 95%" in report
    calm = format_report(summarize([fast], duration=2.0, percentiles=[99], client_cpu=[0.5]), [99])
    assert "client CPU, share of one core: 50%" in calm and "warning" not in calm
    # The data-parallel run on 2 x H200 had one client at 84% that held two engines to one's throughput.
    assert "warning" in format_report(summarize([fast], duration=2.0, percentiles=[99], client_cpu=[0.84]), [99])


def test_token_buckets_are_1_2_5_up_to_the_limit():
    assert token_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
