"""Live views of an engine client: rolling TTFT/ITL/throughput windows and the live-request table."""
import time

import pytest
from corectl.engine.live import RecentActivity, live_requests
from corectl.engine.messages import (
    EngineCoreOutput,
    EngineInfo,
    EngineSnapshot,
    SchedulerStats,
)
from corectl.engine.output_processor import OutputProcessor
from corectl.kv.block_map import summarize_block_states
from corectl.outputs import CompletionOutput, RequestMetrics, RequestOutput
from corectl.sampling_params import SamplingParams

BIN = 0.13  # latency bins are 2 ** (1/6) wide: a percentile lies within 6% of its samples


class Stream:
    """One request's deltas as the output processor builds them: a token time a step, and the
    delta says how many steps' times it brings (several where a stream interval held tokens back)."""

    def __init__(self, request_id: str, arrival: float):
        self.metrics = RequestMetrics(arrival_time=arrival, num_prompt_tokens=5)
        self.request_id = request_id

    def delta(self, now: float, num_tokens: int = 1, step_times: tuple[float, ...] = ()) -> RequestOutput:
        self.metrics.token_times.extend((*step_times, now))
        self.metrics.delta_token_times = len(step_times) + 1
        self.metrics.first_token_time = self.metrics.first_token_time or (step_times or (now,))[0]
        self.metrics.num_generation_tokens += num_tokens
        sample = CompletionOutput(0, "", [7] * num_tokens)
        return RequestOutput(self.request_id, None, [1] * 5, [sample], False, metrics=self.metrics)


def stats(queries=0, hits=0, preemptions=0) -> SchedulerStats:
    return SchedulerStats(prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=preemptions)


def test_ttft_itl_and_throughput_follow_the_arrivals():
    activity = RecentActivity(window_s=60, bucket_s=2, rate_window_s=10)
    fast, slow = Stream("fast", 100.0), Stream("slow", 100.0)
    activity.observe([fast.delta(100.5)], stats(), now=100.5)
    activity.observe([slow.delta(102.0)], stats(), now=102.0)
    for tick in range(1, 41):  # every 1/8 s until 107.0 (exact in binary), fast gets 2 tokens a delta
        t = 102.0 + tick / 8
        activity.observe([fast.delta(t, 2), slow.delta(t)], stats(), now=t)
    summary = activity.summary(now=108.0)
    assert summary.ttft_p50 == pytest.approx(0.5, rel=BIN) and summary.ttft_p99 == pytest.approx(2.0, rel=BIN)
    assert summary.itl_p50 == pytest.approx(0.125, rel=BIN)
    assert summary.itl_p99 == pytest.approx(1.625, rel=BIN)  # fast's wait from 100.5 to the first tick
    assert summary.output_tokens_per_s == pytest.approx((1 + 1 + 40 * 3) / 10)
    assert [p.output_tokens_per_s for p in summary.points] == [1 / 2, 46 / 2, 48 / 2, 27 / 2]
    assert [p.ttft_p50 is not None for p in summary.points] == [True, True, False, False]


def test_a_delta_of_several_steps_counts_each_gap():
    """With a stream interval a delta brings several steps' tokens: TTFT from its first step's
    time, and one ITL gap per step."""
    activity = RecentActivity(window_s=60, bucket_s=2, rate_window_s=10)
    held = Stream("held", 100.0)
    activity.observe([held.delta(100.5)], stats(), now=100.5)
    activity.observe([held.delta(101.0, 3, step_times=(100.75, 100.875))], stats(), now=101.0)
    summary = activity.summary(now=102.0)
    assert summary.ttft_p50 == pytest.approx(0.5, rel=BIN)
    # Gaps 0.25, 0.125 and 0.125: one per step, none lost to the delta that carried three.
    assert summary.itl_p50 == pytest.approx(0.125, rel=BIN) and summary.itl_p99 == pytest.approx(0.25, rel=BIN)
    assert [p.output_tokens_per_s for p in summary.points] == [4 / 2]  # every token, in its 2 s bucket


def test_rates_come_from_counter_deltas_and_old_buckets_leave_the_window():
    activity = RecentActivity(window_s=10, bucket_s=2)
    activity.observe([], stats(queries=100, hits=10, preemptions=1), now=0.5)
    activity.observe([], stats(queries=200, hits=70, preemptions=3), now=4.5)
    early = activity.summary(now=5.0)
    assert [p.prefix_hit_rate for p in early.points] == [pytest.approx(0.1), pytest.approx(0.6)]
    assert [p.preemptions for p in early.points] == [1, 2]
    assert (early.prefix_hit_rate, early.preemptions) == (pytest.approx(0.35), 3)
    activity.observe([], stats(queries=200, hits=70, preemptions=3), now=14.5)
    late = activity.summary(now=14.5)
    assert [p.age_s for p in late.points] == [0.5] and late.points[0].preemptions == 0
    assert late.prefix_hit_rate is None and late.output_tokens_per_s == 0


def test_live_requests_take_their_state_from_the_snapshot():
    info = EngineInfo(model="m", model_dir="m", tokenizer_dir=None, platform="cpu", device="cpu", dtype="float32",
                      max_model_len=64, num_kv_blocks=8, block_size=16, vocab_size=100, architecture="Llama")
    processor = OutputProcessor(info, None, stream_deltas=True)
    processor.add_request("a", None, [1, 2, 3], SamplingParams(max_tokens=4))
    processor.add_request("b", None, [1, 2], SamplingParams(n=2, max_tokens=4))
    processor.add_request("c", None, [4], SamplingParams(max_tokens=4))
    processor.process_outputs([EngineCoreOutput("b#1", [9])])
    snapshot = EngineSnapshot(0.0, 1, [2], [3], 16, 4, ["b#1", "c"], summarize_block_states(bytearray(3)))
    rows = live_requests(processor, snapshot, limit=2)
    assert [(r.request_id, r.state, r.num_prompt_tokens, r.num_output_tokens) for r in rows] == [
        ("a", "waiting", 3, 0), ("b", "running", 2, 1)]
    assert rows[1].first_token_time is not None and rows[0].first_token_time is None
    # Without a snapshot, or with one taken before its first token came, a request that has
    # streamed a token is running.
    assert [r.state for r in live_requests(processor, None, limit=10)] == ["waiting", "running", "waiting"]
    stale = EngineSnapshot(time.monotonic(), 1, [2], [3], 16, 4, ["c"], summarize_block_states(bytearray(3)))
    assert [r.state for r in live_requests(processor, stale, limit=10)] == ["waiting", "waiting", "running"]
    time.sleep(0.001)
    processor.process_outputs([EngineCoreOutput("a", [7])])
    assert [r.state for r in live_requests(processor, stale, limit=10)] == ["running", "waiting", "running"]
