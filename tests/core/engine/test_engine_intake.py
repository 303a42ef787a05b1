"""Request intake on the real model: what is refused before it reaches a step, and what a refusal
leaves behind (nothing: the engine keeps serving). Few tokens per request keep this file quick."""
from __future__ import annotations

import dataclasses
import time

import anyio
import pytest
from corectl import EngineConfig, SamplingParams, StructuredOutputsParams
from corectl.engine.actor import InProcessEngine
from corectl.engine.client import EngineClient
from corectl.engine.intake import check_request
from corectl.engine.messages import EngineCoreRequest
from corectl.errors import InvalidRequestError, QueueFullError

# Small engines: a short context and KV cache start faster, and these tests generate a few tokens.
SMALL = dict(max_model_len=256, kv_cache_memory_gib=0.02)
FEW = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def _split_character_token(tokenizer) -> int:
    """A token that is the first part of a character spread over several tokens."""
    for char in "🙂😀🚀é中":
        ids = tokenizer.encode(char, add_special_tokens=False)
        if len(ids) > 1 and tokenizer.decode(ids[:1]).endswith("\ufffd"):
            return ids[0]
    raise AssertionError("the tokenizer spells every probe character with one token")


def test_last_token_inside_a_character_still_reaches_the_text(llm_int4):
    tok = llm_int4.get_tokenizer()
    token = _split_character_token(tok)
    params = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={token: 100.0})
    out = llm_int4.generate([tok.encode("Smile:")], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [token] and out.finish_reason == "length"
    # The detokenizer holds the partial character back; the finished output must still carry it.
    assert out.text == tok.decode([token]) == "\ufffd"


@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids"])
def test_out_of_vocab_ids_are_refused_before_the_step(llm_int4, field):
    vocab = llm_int4.engine.info.vocab_size
    value = {vocab + 3: 1.0} if field == "logit_bias" else [vocab + 3]
    prompt = llm_int4.get_tokenizer().encode("Hello there")
    bad = SamplingParams(temperature=0.0, max_tokens=2, **{field: value})
    with pytest.raises(InvalidRequestError) as err:
        llm_int4.generate([prompt, prompt], [FEW, bad], use_tqdm=False)
    assert err.value.param == field and str(vocab + 3) in str(err.value)
    # Nothing of the refused batch stays in the engine: the next batch runs as if it never came.
    assert not llm_int4.engine.has_unfinished_requests()
    assert len(llm_int4.generate([prompt], FEW, use_tqdm=False)[0].outputs[0].token_ids) == 2


def _core_request(request_id: str, prompt: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, FEW, time.monotonic())


def test_queue_full_in_the_actor_fails_that_request_only():
    async def main():
        async with anyio.create_task_group() as tg:
            engine = await InProcessEngine.start(EngineConfig(**SMALL, max_queued_requests=1), tg)
            # Sent past any client's bound: the scheduler admits one and refuses the others.
            await engine.add_requests([_core_request(f"r{i}", [1, 2, 3]) for i in range(3)])
            finished = await _finish_reasons(engine, {"r0", "r1", "r2"})
            assert finished == {"r0": "length", "r1": "abort", "r2": "abort"}
            assert engine.is_alive()
            await engine.add_requests([_core_request("after", [4, 5, 6])])
            assert await _finish_reasons(engine, {"after"}) == {"after": "length"}
            await engine.close()

    anyio.run(main)


async def _finish_reasons(engine: InProcessEngine, ids: set[str]) -> dict[str, str]:
    finished: dict[str, str] = {}
    with anyio.fail_after(30):
        async for batch in engine.outputs():
            finished.update({o.req_id: o.finish_reason for o in batch.outputs if o.finish_reason})
            if ids <= finished.keys():
                return finished
    raise AssertionError(f"the engine stopped before finishing {ids - finished.keys()}")


def test_client_bounds_a_burst_exactly_and_refuses_bad_ids_at_intake():
    async def main():
        config = EngineConfig(**SMALL, max_queued_requests=2)
        async with EngineClient.in_process(config) as client:
            outcomes = await _burst(client, 6)
            # The engine had stepped on none of them: exactly the queue bound gets in.
            assert sorted(outcomes) == ["QueueFullError"] * 4 + ["length"] * 2
            vocab = client.info.vocab_size
            for field, value in [("stop_token_ids", [vocab]), ("logit_bias", {vocab + 1: 5.0})]:
                params = SamplingParams(max_tokens=2, **{field: value})
                with pytest.raises(InvalidRequestError) as err:
                    await anext(client.generate([1, 2, 3], params))
                assert err.value.param == field
            outs = [o async for o in client.generate("Hi", FEW)]
            assert client.is_alive and sum(len(o.outputs[0].token_ids) for o in outs) == 2
            metrics = outs[-1].metrics
            assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time

    anyio.run(main)


async def _burst(client: EngineClient, count: int) -> list[str]:
    """Start `count` requests in one go; each ends as its finish reason or the error it raised."""
    outcomes: list[str] = []

    async def one(i: int) -> None:
        try:
            async for out in client.generate([7, 8, 9, i + 10], FEW, f"burst-{i}"):
                if out.finished:
                    outcomes.append(out.outputs[0].finish_reason)
        except QueueFullError as exc:
            outcomes.append(type(exc).__name__)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, i)
    return outcomes


def test_a_grammar_without_a_tokenizer_is_refused_at_intake(llm_int4):
    """Intake is the one check: the scheduler takes every grammar that reaches it."""
    info = dataclasses.replace(llm_int4.engine.info, tokenizer_dir=None, structured_outputs_backend=None)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(InvalidRequestError, match="grammar") as err:
        check_request(["grammar-1"], [5, 6, 7], params, info, lambda request_id: False)
    assert err.value.param == "structured_outputs"
