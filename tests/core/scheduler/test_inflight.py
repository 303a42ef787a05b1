"""The scheduler's books on steps in flight (async scheduling): the real scheduler schedules ahead of
results fed by hand, and `StepsInFlight` must say what those steps still owe each request."""
from corectl.step_messages import ModelRunnerOutput
from support.scheduling import assert_all_blocks_free, make_req, make_scheduler


def _sampled(req_ids, token_ids):
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=token_ids)


def test_tokens_in_flight_let_the_next_step_decode_before_they_arrive():
    sched = make_scheduler()
    req = make_req("r", [1, 2, 3], max_tokens=8)
    sched.add_request(req)
    first = sched.schedule()
    assert sched.in_flight.num_tokens(req) == 1 and sched.in_flight.holds(req)
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"r": 1} and sched.in_flight.num_tokens(req) == 2
    sched.update(first, _sampled(["r"], [5]))
    assert sched.in_flight.num_tokens(req) == 1 and sched.in_flight.holds(req)
    sched.update(second, _sampled(["r"], [6]))
    assert sched.in_flight.num_tokens(req) == 0 and not sched.in_flight.holds(req)
    assert req.output_token_ids == [5, 6] and req.num_computed_tokens == 4


def test_a_prefill_chunk_holds_its_request_without_a_token_in_flight():
    sched = make_scheduler(max_num_batched_tokens=8)
    req = make_req("long", range(1, 13), max_tokens=2)
    sched.add_request(req)
    chunk = sched.schedule()
    assert chunk.num_scheduled_tokens == {"long": 8}
    assert sched.in_flight.holds(req) and sched.in_flight.num_tokens(req) == 0
    last = sched.schedule()
    assert last.num_scheduled_tokens == {"long": 4} and sched.in_flight.num_tokens(req) == 1
    assert sched.update(chunk, _sampled([], [])) == []
    [output] = sched.update(last, _sampled(["long"], [7]))
    assert output.new_token_ids == [7] and not sched.in_flight.holds(req)


def test_a_request_released_with_steps_in_flight_leaves_them_to_its_id():
    sched = make_scheduler()
    req = make_req("r", [1, 2, 3], max_tokens=1)
    sched.add_request(req)
    first = sched.schedule()
    sched.abort_requests(["r"])
    assert not sched.in_flight.holds(req) and sched.in_flight.num_tokens(req) == 0
    assert sched.update(first, _sampled(["r"], [5])) == [] and req.output_token_ids == []
    assert_all_blocks_free(sched)
