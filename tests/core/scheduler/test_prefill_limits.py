"""vLLM's long_prefill_token_threshold, max_num_partial_prefills and max_long_partial_prefills."""
import pytest
from corectl.errors import ConfigError
from support.scheduling import assert_all_blocks_free, make_req, make_scheduler, random_requests, run, step


def test_the_threshold_caps_each_prompts_chunk_and_leaves_room_for_others():
    sched = make_scheduler(max_model_len=128, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    sched.add_request(make_req("long", range(40)))
    sched.add_request(make_req("short", range(100, 110)))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 16, "short": 10}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 16, "short": 1}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 8, "short": 1}


def test_without_a_threshold_one_prompt_takes_the_whole_budget():
    sched = make_scheduler(max_model_len=128, max_num_batched_tokens=64)
    sched.add_request(make_req("long", range(80)))
    sched.add_request(make_req("short", range(100, 110)))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 64}


def test_long_partial_prefills_are_bounded_so_short_prompts_pass_them():
    sched = make_scheduler(max_model_len=128, max_num_batched_tokens=64, long_prefill_token_threshold=16,
                           max_num_partial_prefills=2, max_long_partial_prefills=1)
    for rid, prompt in (("long1", range(48)), ("long2", range(200, 248)), ("short1", range(300, 312)),
                        ("short2", range(400, 410))):
        sched.add_request(make_req(rid, prompt))
    out, _ = step(sched)
    # long2 would be a second long prompt left unfinished: it waits, and the short ones go ahead.
    assert out.num_scheduled_tokens == {"long1": 16, "short1": 12, "short2": 10}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long1": 16, "short1": 1, "short2": 1}
    out, _ = step(sched)
    # long1 finishes its prompt in this step, so long2 may start beside it.
    assert out.num_scheduled_tokens == {"long1": 16, "short1": 1, "short2": 1, "long2": 16}


def test_partial_prefills_are_bounded():
    sched = make_scheduler(max_model_len=128, max_num_batched_tokens=96, long_prefill_token_threshold=16,
                           max_num_partial_prefills=2, max_long_partial_prefills=2)
    for i in range(3):
        sched.add_request(make_req(f"p{i}", range(100 * i, 100 * i + 40)))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"p0": 16, "p1": 16}


def test_concurrent_partial_prefills_default_their_threshold_to_4_percent_of_the_context():
    sched = make_scheduler(max_model_len=1000, num_blocks=200, max_num_batched_tokens=256, max_num_partial_prefills=4,
                           max_long_partial_prefills=4)
    sched.add_request(make_req("a", range(300)))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 40}


@pytest.mark.parametrize("options", [
    dict(long_prefill_token_threshold=8),
    dict(long_prefill_token_threshold=8, max_num_partial_prefills=3, max_long_partial_prefills=1),
])
def test_limited_runs_give_the_same_tokens_and_free_every_block(options):
    expected, _ = run(make_scheduler(num_blocks=200, max_model_len=32, max_num_batched_tokens=32),
                      random_requests(3, 10))
    sched = make_scheduler(num_blocks=12, max_model_len=32, max_num_batched_tokens=32, **options)
    tokens, outs = run(sched, random_requests(3, 10))
    assert tokens == expected
    assert max(n for out in outs for n in out.num_scheduled_tokens.values()) <= 8
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("options, field", [
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills"),
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "max_long_partial_prefills"),
])
def test_bad_limits_are_refused(options, field):
    with pytest.raises(ConfigError, match=field):
        make_scheduler(**options)


def test_a_prompt_another_micro_batch_holds_keeps_its_place():
    """Pipeline parallelism: while L0's chunk is in flight in one micro-batch, the next may not start a
    second long prompt beside it."""
    sched = make_scheduler(max_model_len=128, max_num_batched_tokens=64, long_prefill_token_threshold=16,
                           max_num_partial_prefills=2, max_long_partial_prefills=1, pipeline_parallel_size=2)
    for rid, prompt in (("L0", range(60)), ("L1", range(100, 160)), ("S", range(200, 210))):
        sched.add_request(make_req(rid, prompt))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"L0": 16, "S": 10}
    second = sched.schedule()
    assert "L1" not in second.num_scheduled_tokens
