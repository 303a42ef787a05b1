"""The worker's per-request state: applying scheduler diffs, the persistent block table, the
flat host arrays of one step, and the tokens of launched steps until the host reads them."""
from __future__ import annotations

import torch
from corectl.sampling_params import SamplingParams
from corectl.step_messages import CachedRequestData, NewRequestData
from corectl.worker.inflight import InflightStep, SampledRows, fetch_now
from corectl.worker.request_states import BlockTable, RequestStates
from support.scheduling import new_request_data, scheduler_output

BS = 4


def _reference_slots(blocks, start, end):
    return [blocks[p // BS] * BS + p % BS for p in range(start, end)]


def test_step_arrays_of_a_mixed_step():
    """A cold prefill, a chunk after a prefix hit and a decode, checked against per-token Python."""
    states = RequestStates(torch.device("cpu"))
    sched = scheduler_output(
        new=[new_request_data("cold", range(100, 106), [3, 9]), new_request_data("hit", range(200, 211), [5, 6, 7], computed=8),
             new_request_data("dec", range(300, 310), [2, 8, 11], computed=9, prompt=7)],
        scheduled={"cold": 6, "hit": 2, "dec": 1},
    )
    states.apply(sched)
    host = states.build_step(sched, BS)
    assert host.input_ids.tolist() == list(range(100, 106)) + [208, 209] + [309]
    assert host.positions.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 9]
    expected_slots = (_reference_slots([3, 9], 0, 6) + _reference_slots([5, 6, 7], 8, 10)
                      + _reference_slots([2, 8, 11], 9, 10))
    assert host.slot_mapping.tolist() == expected_slots
    assert host.query_start_loc.tolist() == [0, 6, 8, 9] and host.query_starts == [0, 6, 8]
    assert host.seq_lens.tolist() == host.seq_lens_list == [6, 10, 10]
    assert host.block_tables.tolist() == [[3, 9, 0], [5, 6, 7], [2, 8, 11]]
    assert (host.max_query_len, host.max_seq_len) == (6, 10)
    assert host.sample_req_ids == ["cold", "dec"] and host.sample_rows == [5, 8]
    assert not host.samples_every_row


def test_block_table_grows_appends_and_zeroes_released_rows():
    table = BlockTable(rows=1, width=2)
    a = table.add([4, 5, 6])
    b = table.add([7])
    table.write(b, 1, [8, 9])
    assert table.gather([b, a], 3).tolist() == [[7, 8, 9], [4, 5, 6]]
    table.release(a, 3)
    c = table.add([1])
    assert c == a and table.gather([c], 3).tolist() == [[1, 0, 0]]
    assert table.gather([b], 5).tolist() == [[7, 8, 9, 0, 0]]


def test_request_states_keep_table_rows_in_step_with_their_blocks():
    states = RequestStates(torch.device("cpu"))
    states.apply(scheduler_output(new=[new_request_data("a", range(8), [1, 2]), new_request_data("b", range(3), [3])]))
    states.apply(scheduler_output(cached=CachedRequestData(["b"], [[4, 5]], [3]), finished=["a"]))
    states.apply(scheduler_output(new=[new_request_data("c", range(5), [6, 7])]))
    for req_id in ("b", "c"):
        state = states[req_id]
        assert states.block_table.gather([state.table_row], 4)[0].tolist() == (state.block_ids + [0] * 4)[:4]


def _launched(states, req_ids, token_ids):
    """A step that sampled `token_ids` for `req_ids`, as the runner launches it."""
    launched = [states[r] for r in req_ids]
    states.expect_sampled(launched)
    return InflightStep(SampledRows(states, launched, fetch_now([torch.tensor(token_ids)]), None), {})


def test_a_token_in_flight_feeds_the_next_step_from_the_device_until_it_is_read():
    states = RequestStates(torch.device("cpu"))
    prefill = scheduler_output(new=[new_request_data("a", range(100, 105), [1, 2]),
                                    new_request_data("b", range(200, 203), [3])], scheduled={"a": 5, "b": 3})
    states.apply(prefill)
    step = _launched(states, ["a", "b"], [42, 43])
    assert states["a"].num_unread_tokens == 1 and states["a"].token_ids == list(range(100, 105))
    # The next step decodes both before the host has read their tokens.
    decode = scheduler_output(cached=CachedRequestData(["b", "a"], [[], []], [3, 5]), scheduled={"b": 1, "a": 1})
    states.apply(decode)
    host = states.build_step(decode, BS)
    assert host.device_fed_req_ids == ["b", "a"] and host.device_fed_rows == [0, 1]
    assert host.input_ids.tolist() == [0, 0] and host.positions.tolist() == [3, 5]
    assert host.sample_req_ids == ["b", "a"]
    out = step.result()
    assert (out.req_ids, out.sampled_token_ids) == (["a", "b"], [42, 43])
    assert states["a"].token_ids[-1] == 42 and states["b"].token_ids[-1] == 43
    assert states["a"].num_unread_tokens == states["b"].num_unread_tokens == 0
    assert step.result() is out


def test_a_token_read_after_its_request_was_forgotten_changes_no_live_state():
    states = RequestStates(torch.device("cpu"))
    states.apply(scheduler_output(new=[new_request_data("r", range(4), [1])], scheduled={"r": 4}))
    forgotten = states["r"]
    step = _launched(states, ["r"], [9])
    # Aborted while the step ran, then the id is taken again by a new request.
    states.apply(scheduler_output(new=[new_request_data("r", [7, 8], [2])], finished=["r"]))
    assert step.result().sampled_token_ids == [9]
    assert states["r"].token_ids == [7, 8] and states["r"].num_unread_tokens == 0
    assert forgotten.token_ids == [0, 1, 2, 3]


def test_prompt_logprobs_are_awaited_until_the_prompt_is_covered():
    def wanting(req_id, tokens, computed=0):
        return NewRequestData(req_id=req_id, token_ids=list(tokens), num_prompt_tokens=5,
                              sampling_params=SamplingParams(prompt_logprobs=1), block_ids=[1, 2],
                              num_computed_tokens=computed)

    states = RequestStates(torch.device("cpu"))
    states.apply(scheduler_output(new=[wanting("p", range(5)), wanting("resumed", range(6), computed=0)]))
    # A request resumed with output tokens reported its prompt logprobs before it was preempted.
    assert states.awaiting_prompt_logprobs == {"p"}
    states.prompt_logprobs_done("p")
    assert not states.awaiting_prompt_logprobs
