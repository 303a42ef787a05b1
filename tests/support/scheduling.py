"""The scheduler driven without a model: hand-built requests and `SchedulerOutput`s, and `PagedOracle`,
the worker's real request-state bookkeeping over a paged cache whose entry at each position chains
the previous position's entry with the token (like real K/V, it depends on the whole prefix), so a
wrong block, a block reused too early, a bad prefix hit or a lost token changes the sampled token."""
from __future__ import annotations

import random
from collections import defaultdict

import torch
from corectl.config import EngineConfig
from corectl.kv import NULL_BLOCK_ID
from corectl.request import Request
from corectl.sampling_params import SamplingParams
from corectl.scheduler import Scheduler
from corectl.step_messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from corectl.worker.request_states import RequestStates

BS = 8
VOCAB = 1000
TOKEN = 7


def make_scheduler(num_blocks=64, max_model_len=64, **options):
    return Scheduler(EngineConfig(block_size=BS, **options), max_model_len, num_blocks)


def make_req(rid, prompt, *, max_tokens=16, eos=None, priority=0, arrival=None, group=None, **params):
    return Request(rid, list(prompt), SamplingParams(**params), eos_token_id=eos, max_tokens=max_tokens,
                   priority=priority, arrival_time=arrival, group_id=group)


def sample_all(sched, out, tokens=None, prompt_logprobs=None):
    """The worker's answer: one token for each request scheduled up to its last token."""
    tokens = tokens or {}
    ids = [rid for rid in out.num_scheduled_tokens
           if sched.get_request(rid).num_computed_tokens == sched.get_request(rid).num_tokens]
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[tokens.get(r, TOKEN) for r in ids],
                             prompt_logprobs=prompt_logprobs or {})


def step(sched, tokens=None):
    out = sched.schedule()
    return out, sched.update(out, sample_all(sched, out, tokens))


def assert_all_blocks_free(sched):
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    assert sched.kv.usage == 0.0


class PagedOracle:
    def __init__(self):
        self.states = RequestStates(torch.device("cpu"))
        self.cache: dict[int, int] = {}

    def execute(self, out) -> ModelRunnerOutput:
        self.states.apply(out)
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            token = self.compute(state, state.token_ids, n)
            if token is not None:
                state.token_ids.append(token)
                req_ids.append(req_id)
                sampled.append(token)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def compute(self, state, token_ids, n) -> int | None:
        """Write the entries of `n` tokens from the state's computed count; the sampled token
        when they reach the end of `token_ids`."""
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        assert end <= len(token_ids)
        assert len(state.block_ids) * BS >= end and NULL_BLOCK_ID not in state.block_ids
        for pos in range(start, end):
            prev = self.cache[self._slot(state, pos - 1)] if pos else 0
            self.cache[self._slot(state, pos)] = hash((prev, token_ids[pos]))
        return self.cache[self._slot(state, end - 1)] % VOCAB if end == len(token_ids) else None

    @staticmethod
    def _slot(state, pos):
        return state.block_ids[pos // BS] * BS + pos % BS


def run(sched, requests, abort_at=None, oracle=None):
    """Drive scheduler + oracle until done; `abort_at` maps a step number to request ids to abort.
    Pass the `oracle` of an earlier run on the same scheduler to keep its cache contents."""
    oracle, tokens, outs = oracle or PagedOracle(), defaultdict(list), []
    for req in requests:
        sched.add_request(req)
    for number in range(500):
        if not sched.has_unfinished_requests():
            break
        sched.abort_requests((abort_at or {}).get(number, []))
        out = sched.schedule()
        outs.append(out)
        for result in sched.update(out, oracle.execute(out)):
            tokens[result.req_id] += result.new_token_ids
    assert not sched.has_unfinished_requests()
    return dict(tokens), outs


def random_requests(seed, count):
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(12)]
    requests = []
    for i in range(count):
        prefix = shared[: rng.choice([0, 8, 12])]
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 18 - len(prefix)))]
        requests.append(make_req(f"r{i}", prompt, max_tokens=rng.randint(4, 12), priority=rng.randint(0, 3),
                                 arrival=float(i)))
    return requests


def new_request_data(req_id, tokens, blocks, computed=0, prompt=None):
    return NewRequestData(req_id=req_id, token_ids=list(tokens), num_prompt_tokens=prompt or len(tokens),
                          sampling_params=SamplingParams(temperature=0.0), block_ids=list(blocks),
                          num_computed_tokens=computed)


def scheduler_output(new=(), scheduled=None, cached=None, finished=()):
    scheduled = scheduled or {}
    return SchedulerOutput(list(new), cached or CachedRequestData(), scheduled, sum(scheduled.values()), list(finished))
