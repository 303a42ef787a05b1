"""Async scheduling: step N+1 is scheduled and launched before step N's sampled ids are read.

The scheduler runs against `LaggedOracle`, the paged oracle of test_scheduler.py reading its
results one step late as the real worker does; the engine runs the real model on the CPU with
async scheduling forced on. Either way the tokens must equal those of the synchronous loop.
"""
from collections import defaultdict

import pytest
from corectl import LLM, SamplingParams
from corectl.request import RequestStatus
from corectl.step_messages import LogprobsLists, ModelRunnerOutput
from support.engines import TINY
from support.scheduling import (
    PagedOracle,
    assert_all_blocks_free,
    make_req,
    make_scheduler,
    random_requests,
    run,
)


class LaggedOracle(PagedOracle):
    """The worker under async scheduling: a launched step takes the ids of the step before it from
    that step's results (the device, in the real runner); they reach the request states only when
    read."""

    def __init__(self):
        super().__init__()
        self.unread: dict[str, int] = {}

    def launch(self, out):
        self.states.apply(out)
        if not out.num_scheduled_tokens:
            return [], {}
        states, sampled = [], {}
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            token_ids = state.token_ids + ([self.unread[req_id]] if state.num_unread_tokens else [])
            token = self.compute(state, token_ids, n)
            if token is not None:
                states.append(state)
                sampled[req_id] = token
        self.states.expect_sampled(states)
        self.unread = sampled
        return states, sampled

    def read(self, launched) -> ModelRunnerOutput:
        states, sampled = launched
        self.states.receive_sampled(states, list(sampled.values()))
        return ModelRunnerOutput(req_ids=list(sampled), sampled_token_ids=list(sampled.values()))


def run_lagged(sched, requests, abort_at=None, oracle=None):
    """`run` with each step's results applied after the next step is launched. Also returns how
    many tokens arrived for requests preempted while their step ran."""
    oracle, tokens, outs, late_for_preempted = oracle or LaggedOracle(), defaultdict(list), [], 0
    for req in requests:
        sched.add_request(req)
    in_flight = None
    for number in range(500):
        if not sched.has_unfinished_requests() and in_flight is None:
            break
        sched.abort_requests((abort_at or {}).get(number, []))
        out = sched.schedule()
        outs.append(out)
        launched = oracle.launch(out)
        if in_flight is not None:
            previous, previous_launch = in_flight
            late_for_preempted += sum(
                1 for rid in previous_launch[1]
                if (req := sched.get_request(rid)) is not None and req.status == RequestStatus.PREEMPTED
            )
            for result in sched.update(previous, oracle.read(previous_launch)):
                tokens[result.req_id] += result.new_token_ids
        in_flight = (out, launched) if out.num_scheduled_tokens else None
    assert not sched.has_unfinished_requests()
    return dict(tokens), outs, late_for_preempted


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_lagged_results_give_the_same_tokens_through_preemption(policy, prefix_caching):
    options = dict(scheduling_policy=policy, enable_prefix_caching=prefix_caching, max_num_batched_tokens=16)
    late_for_preempted = 0
    for seed in range(4):
        expected, _ = run(make_scheduler(num_blocks=200, max_model_len=32, **options), random_requests(seed, 10))
        tiny = make_scheduler(num_blocks=6, max_model_len=32, **options)
        tokens, _, late = run_lagged(tiny, random_requests(seed, 10))
        assert tokens == expected
        assert tiny.num_preemptions > 0
        assert_all_blocks_free(tiny)
        late_for_preempted += late
    # The path where a token arrives for a request preempted meanwhile must have run.
    assert late_for_preempted > 0


def test_lagged_aborts_free_everything_and_spare_the_others():
    expected, _ = run(make_scheduler(), random_requests(2, 12))
    sched = make_scheduler(num_blocks=7, max_model_len=32, max_num_batched_tokens=24)
    aborted = {"r1", "r5", "r9", "r2"}
    tokens, _, _ = run_lagged(sched, random_requests(2, 12), abort_at={2: ["r1", "r5"], 5: ["r9", "r2"]})
    assert {rid: t for rid, t in tokens.items() if rid not in aborted} == {
        rid: t for rid, t in expected.items() if rid not in aborted}
    assert_all_blocks_free(sched)


def test_requests_ending_by_length_are_not_scheduled_past_their_last_token():
    def requests():
        return [make_req(f"r{i}", range(1, 4 + 3 * i), max_tokens=2 + i) for i in range(6)]

    def scheduled(outs):
        counts = defaultdict(int)
        for out in outs:
            for rid, n in out.num_scheduled_tokens.items():
                counts[rid] += n
        return dict(counts)

    _, sync_outs = run(make_scheduler(), requests())
    tokens, lagged_outs, _ = run_lagged(make_scheduler(), requests())
    assert {rid: len(t) for rid, t in tokens.items()} == {f"r{i}": 2 + i for i in range(6)}
    assert scheduled(lagged_outs) == scheduled(sync_outs)


def _params():
    greedy = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=i % 2 == 0) for i in range(5)]
    random = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8 + i, logprobs=2) for i in range(4)]
    history = [SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, min_tokens=5),
               SamplingParams(temperature=0.7, seed=3, max_tokens=12, frequency_penalty=0.5)]
    return greedy + random + history + [SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10)]


def _summary(outputs):
    """Tokens, finish, text and logprob ranks exactly; logprob values apart (batches differ, so
    float sums do in the last bits)."""
    exact = [[(o.token_ids, o.finish_reason, o.text,
               o.logprobs and [{t: lp.rank for t, lp in row.items()} for row in o.logprobs]) for o in r.outputs]
             for r in outputs]
    values = [lp.logprob for r in outputs for o in r.outputs for row in o.logprobs or () for lp in row.values()]
    return exact, values


def test_engine_outputs_match_the_synchronous_loop_with_preemption(llm_int4):
    prompts = [f"Story number {i}: once upon a time" + " and then" * i for i in range(12)]
    expected, expected_values = _summary(llm_int4.generate(prompts, _params(), use_tqdm=False))
    llm = LLM(async_scheduling=True, max_model_len=256, kv_cache_memory_gib=0.012, max_num_batched_tokens=64)
    assert llm.engine.async_scheduling
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    stats = llm.engine.scheduler.make_stats()
    exact, values = _summary(outputs)
    assert exact == expected
    assert values == pytest.approx(expected_values, abs=1e-4)
    assert stats.num_preemptions > 0 and stats.kv_cache_usage == 0.0
    assert not llm.engine.has_unfinished_requests()


def test_async_scheduling_defaults_follow_the_platform(llm_int4):
    from corectl.backends.cuda.platform import gpu_caps

    assert not llm_int4.engine.async_scheduling
    assert gpu_caps((9, 0)).async_output


def test_an_id_reused_right_after_an_abort_gets_only_its_own_tokens():
    expected, _ = run(make_scheduler(), [make_req("r", [7, 8, 9, 10], max_tokens=3)])
    sched, oracle = make_scheduler(), LaggedOracle()
    sched.add_request(make_req("r", [1, 2, 3], max_tokens=8))
    first = sched.schedule()
    first_launch = oracle.launch(first)
    second = sched.schedule()
    second_launch = oracle.launch(second)
    sched.update(first, oracle.read(first_launch))
    # The second step is in flight with a token for "r" when it is aborted and the id taken again.
    sched.abort_requests(["r"])
    replacement = make_req("r", [7, 8, 9, 10], max_tokens=3)
    sched.add_request(replacement)
    in_flight = (second, second_launch)
    tokens = []
    while sched.has_unfinished_requests() or in_flight is not None:
        out = sched.schedule()
        launched = oracle.launch(out)
        tokens += [t for result in sched.update(in_flight[0], oracle.read(in_flight[1])) for t in result.new_token_ids]
        in_flight = (out, launched) if out.num_scheduled_tokens else None
    assert tokens == expected["r"] and replacement.output_token_ids == expected["r"]
    assert_all_blocks_free(sched)


def test_prompt_logprobs_survive_preemption_in_the_middle_of_chunked_prefills():
    """Chunks computed by the step in flight when their request is preempted: recomputed ones must
    not be reported twice, and those travelling with the first token must not be lost."""
    prompts = [[(7 * i + j) % 500 + 10 for j in range(40 + 23 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1) for _ in prompts]
    results = {}
    for overlap in (False, True):
        # The random-weight preset (512 bytes of KV a token): a cache of ~270 tokens thrashes as
        # SmolLM2's 0.012 GiB did, at a hundredth of the compute.
        llm = LLM(**{**TINY, "kv_cache_memory_gib": 0.00013}, dtype="float32", async_scheduling=overlap,
                  max_model_len=256, max_num_batched_tokens=32)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        results[overlap] = [
            ([None if p is None else sorted(p) for p in o.prompt_logprobs], o.outputs[0].token_ids,
             [lp.logprob for p in o.prompt_logprobs[1:] for lp in p.values()]) for o in outputs]
    for prompt, (sync_ids, sync_tokens, sync_values), (ids, tokens, values) in zip(prompts, results[False],
                                                                                   results[True]):
        assert len(ids) == len(prompt)
        assert (ids, tokens) == (sync_ids, sync_tokens)
        assert values == pytest.approx(sync_values, abs=1e-4)


def test_prompt_logprobs_of_an_aborted_request_never_reach_a_request_reusing_its_id():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_req("r", range(1, 21), max_tokens=2, prompt_logprobs=0))
    first = sched.schedule()  # the first 8-token chunk of "r", in flight while "r" is aborted
    sched.abort_requests(["r"])
    sched.add_request(make_req("r", [5, 6, 7], max_tokens=1, prompt_logprobs=0))
    second = sched.schedule()
    stale_rows = LogprobsLists(token_ids=[[p] for p in range(8)], logprobs=[[-9.0]] * 8, ranks=[1] * 8)
    assert sched.update(first, ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                                 prompt_logprobs={"r": stale_rows})) == []
    own_rows = LogprobsLists(token_ids=[[6], [7]], logprobs=[[-1.0], [-2.0]], ranks=[1, 1])
    [result] = sched.update(second, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[3],
                                                      prompt_logprobs={"r": own_rows}))
    assert result.prompt_logprobs == own_rows and result.finish_reason == "length"
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("lagged", [False, True], ids=["sync", "lagged"])
def test_a_finished_requests_blocks_serve_a_follow_up_turn(lagged):
    """The block holding positions 8-15 fills in the request's last step, whose input token is still
    pending under async scheduling; it must still reach the prefix cache for the next turn."""
    sched = make_scheduler()
    oracle = LaggedOracle() if lagged else PagedOracle()
    runner = run_lagged if lagged else run
    tokens = runner(sched, [make_req("a", range(1, 10), max_tokens=8)], oracle=oracle)[0]
    hits_before = sched.kv.prefix_hits
    runner(sched, [make_req("b", list(range(1, 10)) + tokens["a"] + [99], max_tokens=1)], oracle=oracle)
    assert sched.kv.prefix_hits - hits_before == 16


def test_results_of_two_released_holders_of_one_id_never_reach_the_third():
    """Direct scheduler use may keep several steps outstanding: each released holder of an id
    counts its own steps in flight."""
    sched = make_scheduler()
    outs = []
    for prompt in ([1, 2, 3], [4, 5]):
        sched.add_request(make_req("r", prompt, max_tokens=8))
        outs.append(sched.schedule())
        sched.abort_requests(["r"])
    third = make_req("r", [6, 7, 8], max_tokens=8)
    sched.add_request(third)
    outs.append(sched.schedule())
    for out, token in zip(outs[:2], (111, 222)):
        assert sched.update(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[token])) == []
    [result] = sched.update(outs[2], ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[333]))
    assert result.new_token_ids == [333] and third.output_token_ids == [333]
    assert not sched.in_flight.holds(third) and sched.in_flight.num_tokens(third) == 0
