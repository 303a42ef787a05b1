"""The profiling step's synthetic prefills stay within the model's context (its rotary table)."""
from __future__ import annotations

import pytest
from corectl import EngineConfig
from corectl.engine.core import EngineCore
from support.engines import TINY

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORECTL_CACHE_DIR", str(tmp_path_factory.mktemp("corectl-cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        core = EngineCore(EngineConfig(**TINY, max_model_len=MAX_MODEL_LEN))
    return core.executor.worker


def test_dummy_step_splits_tokens_into_sequences_no_longer_than_max_model_len(worker, monkeypatch):
    steps = []
    run = worker.runner.execute_model
    monkeypatch.setattr(worker.runner, "execute_model", lambda sched: steps.append(sched) or run(sched))
    # One sequence of 200 tokens would index positions past the 32-entry rotary table.
    worker.run_dummy_step(num_tokens=200, num_seqs=1)
    prefill = steps[0]
    lengths = [len(new.token_ids) for new in prefill.new_requests]
    assert max(lengths) <= MAX_MODEL_LEN
    assert len(lengths) == 7 and prefill.total_num_scheduled_tokens == sum(lengths) == 7 * 28


def test_dummy_step_keeps_the_requested_sequences_when_they_fit(worker, monkeypatch):
    steps = []
    run = worker.runner.execute_model
    monkeypatch.setattr(worker.runner, "execute_model", lambda sched: steps.append(sched) or run(sched))
    worker.run_dummy_step(num_tokens=64, num_seqs=4)
    assert [len(new.token_ids) for new in steps[0].new_requests] == [16] * 4


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_cuda_warmup_steps_reach_both_prefill_tile_sizes(group):
    from corectl.backends.cuda.worker import warmup_prefill_shapes
    from corectl.backends.triton.attention.prefill_attention import prefill_block_m

    query_lens = [tokens // seqs for tokens, seqs in warmup_prefill_shapes(2048, 8192)]
    assert min(query_lens) > 1  # a one-token query per sequence would take the decode kernel
    assert len({prefill_block_m(group, q) for q in query_lens}) == 2


def test_cuda_warmup_steps_fit_a_small_context_and_budget(worker, monkeypatch):
    from corectl.backends.cuda.worker import warmup_prefill_shapes

    steps = []
    run = worker.runner.execute_model
    monkeypatch.setattr(worker.runner, "execute_model", lambda sched: steps.append(sched) or run(sched))
    for tokens, seqs in warmup_prefill_shapes(24, MAX_MODEL_LEN):
        assert tokens <= 24
        worker.run_dummy_step(tokens, seqs)
    prefills = [s for s in steps if s.new_requests]
    assert [max(len(n.token_ids) for n in s.new_requests) for s in prefills] == [2, 24]
