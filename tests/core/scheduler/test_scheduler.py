"""Scheduler: token budget, chunked prefill, preemption, prefix sharing, stops, aborts.

Unit tests feed hand-built ModelRunnerOutputs, as vLLM's tests/v1/core/test_scheduler.py does.
End-to-end checks run the scheduler against `PagedOracle` (tests/support/scheduling.py): the
worker's real request-state bookkeeping over a paged cache in which a wrong block, a block reused
too early, a bad prefix hit or a lost token changes the output.
"""
import time

import pytest
from corectl.errors import ConfigError, QueueFullError
from corectl.request import Request, RequestStatus
from corectl.sampling_params import SamplingParams
from corectl.step_messages import LogprobsLists, ModelRunnerOutput
from support.scheduling import (
    TOKEN,
    PagedOracle,
    assert_all_blocks_free,
    make_req,
    make_scheduler,
    random_requests,
    run,
    sample_all,
    step,
)


# -- token budget --------------------------------------------------------------------------------

def test_long_prompt_is_prefilled_in_chunks_under_the_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_req("a", range(40)))
    out, results = step(sched)
    assert out.num_scheduled_tokens == {"a": 16} and results == []
    new = out.new_requests[0]
    assert (new.num_computed_tokens, len(new.block_ids), new.token_ids) == (0, 2, list(range(40)))
    out, results = step(sched)
    assert out.num_scheduled_tokens == {"a": 16} and results == []
    assert out.cached_requests.num_computed_tokens == [16] and len(out.cached_requests.new_block_ids[0]) == 2
    out, results = step(sched)
    assert out.num_scheduled_tokens == {"a": 8}
    assert [r.new_token_ids for r in results] == [[TOKEN]]
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1} and out.cached_requests.num_computed_tokens == [40]


def test_running_decodes_come_before_waiting_prefills():
    sched = make_scheduler(max_num_batched_tokens=20)
    sched.add_request(make_req("a", range(10)))
    step(sched)
    sched.add_request(make_req("b", range(100, 130)))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 19)]
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 11)]
    assert out.total_num_scheduled_tokens == 12


def test_max_num_seqs_bounds_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for rid, max_tokens in (("a", 1), ("b", 3), ("c", 3)):
        sched.add_request(make_req(rid, range(5), max_tokens=max_tokens))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["a", "b"] and sched.num_waiting == 1
    out, _ = step(sched)  # a finished last step, c takes its place
    assert list(out.num_scheduled_tokens) == ["b", "c"] and out.finished_req_ids == ["a"]


# -- preemption ----------------------------------------------------------------------------------

def test_preemption_frees_the_newest_and_resends_all_its_tokens():
    sched = make_scheduler(num_blocks=5, max_model_len=32, enable_prefix_caching=False)
    sched.add_request(make_req("a", range(12), max_tokens=10))
    sched.add_request(make_req("b", range(50, 62), max_tokens=10))
    for _ in range(5):
        step(sched)
    assert sched.kv.num_free_blocks == 0
    out, _ = step(sched)  # a needs a third block for position 16
    b = sched.get_request("b")
    assert out.num_scheduled_tokens == {"a": 1} and out.finished_req_ids == ["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert sched.num_waiting == 1 and sched.make_stats().num_preemptions == 1
    while sched.get_request("a") is not None:
        out, _ = step(sched)
        assert "b" not in out.num_scheduled_tokens
    out, _ = step(sched)
    resumed = out.new_requests[0]
    assert resumed.req_id == "b" and resumed.num_prompt_tokens == 12 and resumed.num_computed_tokens == 0
    assert resumed.token_ids == list(range(50, 62)) + [TOKEN] * 5
    assert out.num_scheduled_tokens == {"b": 17} and out.finished_req_ids == ["a"]
    while sched.has_unfinished_requests():
        step(sched)
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_runs_produce_the_same_tokens(policy, prefix_caching):
    options = dict(scheduling_policy=policy, enable_prefix_caching=prefix_caching, max_num_batched_tokens=16)
    expected, _ = run(make_scheduler(num_blocks=200, max_model_len=32, **options), random_requests(1, 10))
    tiny = make_scheduler(num_blocks=6, max_model_len=32, **options)
    tokens, outs = run(tiny, random_requests(1, 10))
    assert tokens == expected
    assert tiny.num_preemptions > 0
    assert any(new.token_ids[new.num_prompt_tokens:] for out in outs for new in out.new_requests)
    assert_all_blocks_free(tiny)


def test_prefix_cache_hits_do_not_change_tokens_and_aborts_free_everything():
    expected, _ = run(make_scheduler(enable_prefix_caching=False), random_requests(2, 12))
    sched = make_scheduler(num_blocks=7, max_model_len=32, max_num_batched_tokens=24)
    aborted = {"r1", "r5", "r9", "r2"}
    tokens, _ = run(sched, random_requests(2, 12), abort_at={3: ["r1", "r5"], 6: ["r9", "r2"]})
    for rid in expected.keys() - aborted:
        assert tokens[rid] == expected[rid]
    for rid in aborted:
        assert tokens.get(rid, []) == expected[rid][: len(tokens.get(rid, []))]
    assert sched.make_stats().prefix_cache_hits > 0
    assert_all_blocks_free(sched)


def test_priority_policy_preempts_the_largest_priority_value():
    sched = make_scheduler(num_blocks=5, max_model_len=32, scheduling_policy="priority",
                           enable_prefix_caching=False)
    sched.add_request(make_req("a", range(8), priority=0, arrival=3.0))
    sched.add_request(make_req("b", range(8), priority=5, arrival=1.0))
    sched.add_request(make_req("c", range(8), priority=1, arrival=2.0))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["a", "c", "b"]
    sched.add_request(make_req("d", range(8), priority=9))
    out, _ = step(sched)  # each now needs a second block; one is free
    assert out.finished_req_ids == ["b"] and sched.get_request("b").status == RequestStatus.PREEMPTED
    assert list(out.num_scheduled_tokens) == ["a", "c"] and "d" not in out.num_scheduled_tokens


def test_priority_victim_ahead_in_the_running_list_skips_nobody_and_blocks_admission():
    sched = make_scheduler(num_blocks=5, max_model_len=32, scheduling_policy="priority",
                           enable_prefix_caching=False)
    sched.add_request(make_req("x", range(8), priority=5))
    step(sched)
    sched.add_request(make_req("y", range(10, 18), priority=0))
    sched.add_request(make_req("z", range(20, 27), priority=0))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["x", "y", "z"] and sched.kv.num_free_blocks == 0
    sched.add_request(make_req("w", range(4), priority=1))
    out, _ = step(sched)  # y needs a block: x goes, though it sits ahead of y in the running list
    assert out.finished_req_ids == ["x"]
    assert out.num_scheduled_tokens == {"y": 1, "z": 1}
    # A block is free again, enough for w, but nothing is admitted in a step that preempted.
    assert sched.kv.num_free_blocks == 1 and sched.get_request("w").status == RequestStatus.WAITING


def test_preemption_drops_partial_prompt_logprobs():
    sched = make_scheduler(num_blocks=5, max_model_len=32, max_num_batched_tokens=9, enable_prefix_caching=False)
    sched.add_request(make_req("a", range(8), max_tokens=4))
    step(sched)
    sched.add_request(make_req("b", range(100, 124), max_tokens=1, prompt_logprobs=0))
    prompt_rows = []
    for _ in range(20):
        if sched.get_request("b") is None:
            break
        out = sched.schedule()
        rows = {}
        if "b" in out.num_scheduled_tokens:
            b = sched.get_request("b")
            end = b.num_computed_tokens
            start = end - out.num_scheduled_tokens["b"]
            positions = range(start, min(end, b.num_prompt_tokens - 1))
            rows["b"] = LogprobsLists(token_ids=[[p] for p in positions], logprobs=[[-1.0] for _ in positions],
                                      ranks=[1 for _ in positions])
        for result in sched.update(out, sample_all(sched, out, prompt_logprobs=rows)):
            if result.prompt_logprobs is not None:
                prompt_rows.append(result.prompt_logprobs.token_ids)
    assert sched.num_preemptions == 1
    assert prompt_rows == [[[p] for p in range(23)]]


def test_outputs_carry_when_the_request_was_first_scheduled():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_req("a", range(4), max_tokens=2))
    sched.add_request(make_req("b", range(4), max_tokens=1))
    before = time.monotonic()
    _, (first,) = step(sched)
    assert before <= first.first_scheduled_time <= time.monotonic()
    _, (second,) = step(sched)  # "a" takes the only seat: "b" still waits
    assert (second.req_id, second.first_scheduled_time) == ("a", first.first_scheduled_time)
    _, (third,) = step(sched)
    assert third.req_id == "b" and third.first_scheduled_time >= second.first_scheduled_time


# -- finish, abort, blocks -----------------------------------------------------------------------

def test_finished_requests_free_blocks_and_are_reported_next_step():
    sched = make_scheduler()
    sched.add_request(make_req("a", range(20), max_tokens=2))
    sched.add_request(make_req("b", range(30, 50), max_tokens=3))
    step(sched)
    _, results = step(sched)
    assert [(r.req_id, r.finish_reason) for r in results] == [("a", "length"), ("b", None)]
    assert sched.get_request("a") is None and sched.num_running == 1
    out, results = step(sched)
    assert out.finished_req_ids == ["a"] and results[0].finish_reason == "length"
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)
    assert sched.schedule().finished_req_ids == ["b"]


def test_abort_waiting_and_running_requests():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_req("run", range(20)))
    sched.add_request(make_req("wait", range(20)))
    step(sched)
    aborted = sched.abort_requests(["wait", "run", "run", "unknown"])
    assert [r.request_id for r in aborted] == ["wait", "run"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert (sched.num_running, sched.num_waiting, sched.has_unfinished_requests()) == (0, 0, False)
    assert_all_blocks_free(sched)
    out = sched.schedule()
    assert out.finished_req_ids == ["run"] and out.is_empty


def test_tokens_of_requests_aborted_during_the_step_are_dropped():
    sched = make_scheduler()
    sched.add_request(make_req("a", range(5)))
    sched.add_request(make_req("b", range(5)))
    out = sched.schedule()
    runner_out = sample_all(sched, out)
    sched.abort_requests(["a"])
    assert [r.req_id for r in sched.update(out, runner_out)] == ["b"]
    with pytest.raises(RuntimeError, match="did not schedule"):
        sched.update(sched.schedule(), ModelRunnerOutput(req_ids=["zzz"], sampled_token_ids=[1]))


# -- prefix caching and n samples ----------------------------------------------------------------

def test_later_request_hits_committed_prompt_blocks():
    sched = make_scheduler()
    sched.add_request(make_req("a", range(20), max_tokens=1))
    step(sched)
    sched.add_request(make_req("b", list(range(17)) + [99, 98], max_tokens=1))
    out, results = step(sched)
    assert out.new_requests[0].num_computed_tokens == 16 and out.num_scheduled_tokens == {"b": 3}
    assert results[0].num_cached_tokens == 16
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20 + 19, 16)


def test_n_samples_wait_for_the_first_to_fill_shared_prompt_blocks():
    sched = make_scheduler()
    for i in range(3):
        sched.add_request(Request(f"g-{i}", list(range(20)), SamplingParams(n=3), max_tokens=4,
                                  group_id="g", sample_index=i))
    sched.add_request(make_req("other", range(100, 110)))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["g-0", "other"]
    assert sched.num_waiting == 2
    out, _ = step(sched)
    first_blocks = out.new_requests[0].block_ids
    assert [n.req_id for n in out.new_requests] == ["g-1", "g-2"]
    assert all(n.num_computed_tokens == 16 and n.block_ids[:2] == sched.kv.block_ids(sched.get_request("g-0"))[:2]
               for n in out.new_requests)
    assert first_blocks[2] != out.new_requests[1].block_ids[2]
    assert out.num_scheduled_tokens["g-1"] == 4


def test_n_samples_prefill_separately_without_prefix_caching():
    sched = make_scheduler(enable_prefix_caching=False)
    for i in range(3):
        sched.add_request(Request(f"g-{i}", list(range(20)), SamplingParams(n=3), max_tokens=4, group_id="g"))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"g-0": 20, "g-1": 20, "g-2": 20}


# -- queue policies --------------------------------------------------------------------------------

@pytest.mark.parametrize("policy, order", [("priority", ["z", "y", "x"]), ("fcfs", ["x", "y", "z"])])
def test_waiting_order_follows_the_policy(policy, order):
    sched = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    sched.add_request(make_req("x", range(4), max_tokens=1, priority=2, arrival=0.0))
    sched.add_request(make_req("y", range(4), max_tokens=1, priority=0, arrival=2.0))
    sched.add_request(make_req("z", range(4), max_tokens=1, priority=0, arrival=1.0))
    started = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        started += [n.req_id for n in out.new_requests]
    assert started == order


# -- stop conditions and outputs -------------------------------------------------------------------

@pytest.mark.parametrize("params, tokens, reason, stop_reason", [
    (dict(eos=2), [5, 2], "stop", None),
    (dict(eos=2, stop_token_ids=[9]), [5, 9], "stop", 9),
    (dict(max_tokens=3), [5, 5, 5], "length", None),
    (dict(eos=2, min_tokens=3), [2, 2, 2], "stop", None),
    (dict(eos=2, ignore_eos=True, max_tokens=4), [2, 2, 2, 2], "length", None),
    (dict(eos=2, max_tokens=30), [5] * 8, "length", None),  # max_model_len 32 - 24 prompt tokens
])
def test_stop_conditions(params, tokens, reason, stop_reason):
    sched = make_scheduler(max_model_len=32)
    sched.add_request(make_req("a", range(24), **params))
    produced, results = [], []
    for token in tokens:
        _, results = step(sched, {"a": token})
        produced += results[0].new_token_ids
        if results[0].finish_reason is None:
            assert sched.get_request("a").status == RequestStatus.RUNNING
    assert produced == tokens
    assert (results[0].finish_reason, results[0].stop_reason) == (reason, stop_reason)
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


def test_logprob_rows_are_split_per_request():
    sched = make_scheduler()
    sched.add_request(make_req("a", range(4), logprobs=1))
    sched.add_request(make_req("b", range(4), logprobs=1))
    out = sched.schedule()
    lists = LogprobsLists(token_ids=[[3, 4], [5, 6]], logprobs=[[-0.1, -2.0], [-0.2, -3.0]], ranks=[1, 2])
    results = sched.update(out, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[3, 5], logprobs=lists))
    assert [(r.logprobs.token_ids, r.logprobs.ranks) for r in results] == [([[3, 4]], [1]), ([[5, 6]], [2])]


# -- admission -------------------------------------------------------------------------------------

def test_admission_errors():
    # Validity (context length, unique ids) is intake's, before the engine: tests/core/engine/test_intake.py.
    sched = make_scheduler(max_model_len=32, max_queued_requests=2)
    sched.add_request(make_req("a", range(4)))
    sched.add_request(Request("g-0", [1], SamplingParams(n=2), max_tokens=1, group_id="g"))
    with pytest.raises(QueueFullError):
        sched.add_request(make_req("c", range(4)))
    sched.add_request(Request("g-1", [1], SamplingParams(n=2), max_tokens=1, group_id="g"))
    assert sched.num_waiting == 3


def test_cache_too_small_for_max_model_len_is_refused():
    with pytest.raises(ConfigError, match="max_model_len"):
        make_scheduler(num_blocks=4, max_model_len=32)
