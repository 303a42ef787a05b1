"""The scheduler's LoRA admission: at most max_loras adapters a step, and no request starved by a
stream of requests for resident adapters (real scheduler, no model)."""
from __future__ import annotations

from corectl.lora import LoRARequest
from corectl.lora.admission import PATIENCE_STEPS
from support.scheduling import PagedOracle, make_req, make_scheduler, run

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def with_lora(req, lora):
    req.lora_request = lora
    return req


def adapters_of(sched, out) -> set[int]:
    return {sched.get_request(r).lora_request.lora_int_id for r in out.num_scheduled_tokens
            if sched.get_request(r) is not None and sched.get_request(r).lora_request is not None}


def test_a_step_mixes_at_most_max_loras_adapters():
    sched = make_scheduler(enable_lora=True, max_loras=2, max_num_seqs=16)
    loras = [A, B, C, None, A, C, B, None]
    requests = [with_lora(make_req(f"r{i}", [i + 1] * 5, max_tokens=4), lora) for i, lora in enumerate(loras)]
    steps = []
    for req in requests:
        sched.add_request(req)
    oracle = PagedOracle()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps.append(adapters_of(sched, out))
        stats = sched.make_stats()
        assert len(stats.running_lora_adapters) <= 2
        sched.update(out, oracle.execute(out))
    assert max(len(s) for s in steps) == 2
    assert set().union(*steps) == {1, 2, 3}
    # The first step takes the base requests too: they hold no slot.
    assert steps[0] == {1, 2}


def test_a_passed_over_request_is_not_starved():
    """One slot, adapter A busy, B waiting, and a new A request every step: after PATIENCE_STEPS
    steps new A requests wait, A drains, and B runs."""
    sched = make_scheduler(num_blocks=256, max_model_len=256, enable_lora=True, max_loras=1, max_num_seqs=64)
    oracle = PagedOracle()
    sched.add_request(with_lora(make_req("a0", [1, 2, 3], max_tokens=20), A))
    sched.add_request(with_lora(make_req("b", [4, 5, 6], max_tokens=2), B))
    started_b, started_a = None, []
    for number in range(200):
        sched.add_request(with_lora(make_req(f"a{number + 1}", [7, 8, number % 50 + 9], max_tokens=20), A))
        out = sched.schedule()
        if "b" in {n.req_id for n in out.new_requests}:
            started_b = number
            break
        started_a += [n.req_id for n in out.new_requests]
        sched.update(out, oracle.execute(out))
    assert started_b is not None and started_b > PATIENCE_STEPS
    # A requests kept running meanwhile: B's wait did not stop the others.
    assert len(started_a) >= PATIENCE_STEPS


def test_base_only_engine_is_unbounded_by_adapters():
    sched = make_scheduler(enable_lora=True, max_loras=1)
    tokens, _ = run(sched, [make_req(f"r{i}", [i + 1] * 3, max_tokens=3) for i in range(4)])
    assert len(tokens) == 4
