"""The engine loop's seams on a small preset (random weights, token-id prompts): one intake rule on
every path, refusals reported by `EngineCore.step`, and a client whose queue count survives requests
that never reach the engine."""
from __future__ import annotations

import time

import anyio
import pytest
from corectl import LLM, EngineConfig, SamplingParams
from corectl.engine.client import EngineClient
from corectl.engine.messages import EngineCoreRequest
from corectl.engine.output_processor import OutputProcessor
from corectl.engine.remote import RemoteEngine
from corectl.errors import InvalidRequestError, QueueFullError
from support.engines import TINY

TWO = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("isolated_env")


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(**TINY, max_queued_requests=1)


def _refusal(call) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        call()
    return err.value


def test_the_context_rule_is_exact_and_the_same_offline_and_in_the_client(tiny_llm):
    room = tiny_llm.engine.info.max_model_len
    prompt = [5] * (room - 4)
    over = SamplingParams(max_tokens=5)
    offline = _refusal(lambda: tiny_llm.generate([prompt], over, use_tqdm=False))
    assert (offline.param, offline.code) == ("max_tokens", "context_length_exceeded")
    whole = _refusal(lambda: tiny_llm.generate([[5] * room], SamplingParams(max_tokens=None), use_tqdm=False))
    assert (whole.param, whole.code) == ("prompt", "context_length_exceeded")
    # The largest request that fits runs to its last token.
    fits = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(tiny_llm.generate([prompt], fits, use_tqdm=False)[0].outputs[0].token_ids) == 4

    async def main():
        async with EngineClient.in_process(EngineConfig(**TINY)) as client:
            assert str(await _refusal_async(client.generate(prompt, over))) == str(offline)
            outs = [o async for o in client.generate(prompt, fits)]
            assert sum(len(o.outputs[0].token_ids) for o in outs) == 4

    anyio.run(main)


async def _refusal_async(outputs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        await anext(outputs)
    return err.value


def test_an_id_is_taken_by_a_request_or_by_any_of_its_samples(tiny_llm):
    processor = OutputProcessor(tiny_llm.engine.info, None, stream_deltas=True)
    assert [r.request_id for r in processor.add_request("a", None, [1, 2], SamplingParams(n=2))] == ["a#0", "a#1"]
    for request_id, n in [("a", 1), ("a#1", 1), ("a#1", 3), ("a", 2)]:
        with pytest.raises(InvalidRequestError, match="already in use") as err:
            processor.add_request(request_id, None, [1, 2], SamplingParams(n=n))
        assert err.value.param == "request_id"
    # A refused request registered nothing; once "a" is gone its sample's id is free.
    assert processor.child_ids("a#1") == []
    processor.abort_request("a")
    assert [r.request_id for r in processor.add_request("a#1", None, [1, 2], TWO)] == ["a#1"]


def test_a_refusal_is_work_and_the_next_step_reports_it_first(tiny_llm):
    core = tiny_llm.engine
    now, received = time.monotonic(), core.num_requests_received
    core.add_requests([EngineCoreRequest("kept", [1, 2, 3], TWO, now), EngineCoreRequest("over", [4, 5], TWO, now)])
    core.abort_requests(["kept"])
    # Nothing is queued any more, but the refusal is still owed to the client.
    assert core.has_unfinished_requests()
    step = core.step()
    assert [(o.req_id, o.finish_reason) for o in step.outputs] == [("over", "abort")]
    assert step.num_requests_received == received + 2 and not core.has_unfinished_requests()
    # The offline path gets the same: past the queue bound a prompt finishes as "abort", the batch runs.
    outs = tiny_llm.generate([[1, 2, 3], [4, 5]], TWO, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort"]


def test_requests_the_wire_cannot_carry_are_400s_and_take_no_queue_slot(tiny_llm):
    """Issue 8: with a queue bound, requests whose numbers msgpack cannot hold (2**70) were counted as
    sent but never reached the engine, so the client answered every later request "queue full"."""
    config = EngineConfig(**TINY, max_queued_requests=2)
    too_long = [5] * (tiny_llm.engine.info.max_model_len - 4)
    offline = _refusal(lambda: tiny_llm.generate([too_long], SamplingParams(max_tokens=5), use_tqdm=False))

    async def main():
        async with anyio.create_task_group() as tg:
            transport = await RemoteEngine.start(config, tg, hang_timeout=120.0)
            async with EngineClient.serving(transport, config, tg) as client:
                for field in ["seed", "top_k", "seed", "top_k"]:
                    err = await _refusal_async(client.generate([1, 2, 3], SamplingParams(**{field: 2**70})))
                    assert "cannot be sent to the engine" in str(err)
                try:
                    outs = [o async for o in client.generate([1, 2, 3], TWO)]
                except QueueFullError as exc:
                    raise AssertionError("a refused request still holds a queue slot") from exc
                assert outs[-1].outputs[0].finish_reason == "length" and client.is_alive
                # The socket path refuses a too-long request as the offline path does.
                over = await _refusal_async(client.generate(too_long, SamplingParams(max_tokens=5)))
                assert str(over) == str(offline)

    anyio.run(main)
