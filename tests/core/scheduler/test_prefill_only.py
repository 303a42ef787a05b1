"""A pooling engine's scheduler: prefill-only requests end with their vector, freeing their blocks,
under the synchronous loop and with a step in flight (async scheduling), through preemption."""
from corectl.config import EngineConfig
from corectl.request import Request, RequestStatus
from corectl.sampling_params import SamplingParams
from corectl.scheduler import Scheduler
from corectl.step_messages import ModelRunnerOutput

BS = 8


def make_scheduler(num_blocks=64, budget=16, **options):
    config = EngineConfig(block_size=BS, runner="pooling", max_num_batched_tokens=budget, **options)
    return Scheduler(config, min(64, (num_blocks - 1) * BS), num_blocks)


def make_req(rid, length, priority=0):
    first = 100 * ord(rid[0])  # distinct prompts: no prefix-cache hits between requests
    return Request(rid, list(range(first, first + length)), SamplingParams(temperature=0.0, max_tokens=1), max_tokens=1,
                   priority=priority)


def pooled(sched, out) -> ModelRunnerOutput:
    """The worker's answer: a vector for each request whose last prompt token ran in step `out`."""
    before = {new.req_id: new.num_computed_tokens for new in out.new_requests}
    before.update(zip(out.cached_requests.req_ids, out.cached_requests.num_computed_tokens))
    done = [rid for rid, n in out.num_scheduled_tokens.items()
            if before[rid] + n == sched.get_request(rid).num_prompt_tokens]
    return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], pooled={rid: rid.encode() for rid in done})


def test_prefill_only_requests_finish_after_their_last_chunk():
    sched = make_scheduler()
    sched.add_request(make_req("a", 20))
    sched.add_request(make_req("b", 5))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 16}
    assert sched.update(out, pooled(sched, out)) == []
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 5}
    outputs = sched.update(out, pooled(sched, out))
    assert [(o.req_id, o.new_token_ids, o.finish_reason, o.pooled) for o in outputs] == [
        ("a", [], "stop", b"a"), ("b", [], "stop", b"b")]
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    assert sched.schedule().finished_req_ids == ["a", "b"]  # the worker forgets them next step


def test_a_prompt_scheduled_whole_waits_for_its_vector_with_a_step_in_flight():
    sched = make_scheduler()
    sched.add_request(make_req("a", 12))
    first = sched.schedule()
    second = sched.schedule()  # async scheduling: step 1's vector has not arrived
    assert first.num_scheduled_tokens == {"a": 12} and second.is_empty
    outputs = sched.update(first, pooled(sched, first))
    assert outputs[0].pooled == b"a" and sched.get_request("a") is None
    sched.update(second, pooled(sched, second))
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def test_preempted_after_its_last_chunk_it_still_finishes():
    """Under async scheduling a request whose last chunk is in flight may be chosen as a victim; the
    step computed its whole prompt, so its vector finishes it rather than a recompute."""
    sched = make_scheduler(num_blocks=5, budget=16, scheduling_policy="priority")  # 4 usable blocks
    a, b = make_req("a", 24, priority=1), make_req("b", 24)
    sched.add_request(a)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 16} and sched.update(out, pooled(sched, out)) == []
    sched.add_request(b)
    last_chunk = sched.schedule()
    assert last_chunk.num_scheduled_tokens == {"a": 8, "b": 8}
    # The next step is scheduled before that one's results arrive; b needs two more blocks and
    # a (the lower priority) is preempted with its vector in flight.
    following = sched.schedule()
    assert following.num_scheduled_tokens == {"b": 16} and a.status == RequestStatus.PREEMPTED
    outputs = sched.update(last_chunk, pooled(sched, last_chunk))
    assert [(o.req_id, o.pooled) for o in outputs] == [("a", b"a")] and a.status == RequestStatus.FINISHED_STOPPED
    assert len(sched.waiting) == 0
    assert [o.req_id for o in sched.update(following, pooled(sched, following))] == ["b"]
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
