"""The worker's per-request state: applying scheduler diffs, the persistent block table, and the
flat host arrays of one step."""
from __future__ import annotations

import torch
from corectl.scheduler.output import CachedRequestData
from corectl.worker.request_states import BlockTable, RequestStates
from helpers import new_request_data, scheduler_output

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
