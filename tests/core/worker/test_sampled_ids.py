"""`RecentSampledIds`: each request's newest sampled id among the steps kept, whichever step and
row it came from, waiting once for ids that are still arriving; and a pipeline stage before the
last keeping its count of unread tokens when the ids it took on the device become known."""
import numpy as np
import pytest
import torch
from corectl.sampling_params import SamplingParams
from corectl.step_messages import CachedRequestData, NewRequestData, SchedulerOutput
from corectl.worker.request_states import DEVICE_FED_ID, RequestStates
from corectl.worker.sampled_ids import RecentSampledIds


def to_device(arrays):
    return [torch.from_numpy(a) for a in arrays]


def test_the_newest_step_in_order_is_a_slice_of_its_ids():
    store = RecentSampledIds(depth=1)
    ids = torch.tensor([11, 12, 13])
    store.record(ids, ["a", "b", "c"])
    gathered = store.gather(["a", "b"], to_device)
    assert gathered.tolist() == [11, 12] and gathered.data_ptr() == ids.data_ptr()
    assert store.gather(["c", "a"], to_device).tolist() == [13, 11]


def test_requests_of_several_steps_take_each_ones_newest_id():
    store = RecentSampledIds(depth=2)
    store.record(torch.tensor([1, 2]), ["a", "b"])
    store.record(torch.tensor([3, 4]), ["c", "a"])
    assert store.gather(["b", "c", "a"], to_device).tolist() == [2, 3, 4]
    assert store.gather(["b"], to_device).tolist() == [2]


def test_a_step_past_the_depth_is_forgotten_once_its_ids_arrived():
    waits = []
    store = RecentSampledIds(depth=2)
    for step, req in enumerate("abc"):
        store.record(torch.tensor([step]), [req], arrival=lambda req=req: waits.append(req))
    assert waits == ["a"]  # no step read a's ids, but their receive completed before it went
    assert store.gather(["b", "c"], to_device).tolist() == [1, 2]
    with pytest.raises(KeyError, match="'a' has no sampled id"):
        store.gather(["a"], to_device)


def test_ids_still_arriving_are_waited_for_once_and_only_when_read():
    waits = []
    store = RecentSampledIds(depth=2)
    store.record(torch.tensor([7, 8]), ["a", "b"], arrival=lambda: waits.append("first"))
    store.record(torch.tensor([9]), ["c"], arrival=lambda: waits.append("second"))
    assert store.gather(["c"], to_device).tolist() == [9] and waits == ["second"]
    assert store.gather(["b", "c"], to_device).tolist() == [8, 9]
    assert store.gather(["a"], to_device).tolist() == [7]
    assert waits == ["second", "first"]


def _step(new=(), cached=CachedRequestData(), scheduled=None):
    scheduled = scheduled or {}
    return SchedulerOutput(list(new), cached, scheduled, sum(scheduled.values()), [])


def test_a_stage_before_the_last_counts_the_ids_it_took_on_the_device():
    """The scheduler sends a stage the tokens the host knows; a position whose id the stage took on
    the device and the host learnt later leaves a placeholder, and the count of tokens holds."""
    states = RequestStates(torch.device("cpu"))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    new = NewRequestData(req_id="r", token_ids=[5, 6, 7], num_prompt_tokens=3, sampling_params=params,
                         block_ids=[1], num_computed_tokens=0)
    prefill = _step([new], scheduled={"r": 3})
    states.apply(prefill)
    host = states.build_step(prefill, block_size=16)
    assert host.sample_req_ids == ["r"]
    states.expect_sampled([states["r"]])  # the last stage samples position 3; its id stays there
    # The next step computes position 3 before the host knows its id: fed on the device.
    decode = _step(cached=CachedRequestData(["r"], [[]], [3], [[]]), scheduled={"r": 1})
    states.apply(decode)
    host = states.build_step(decode, block_size=16)
    assert host.device_fed_req_ids == ["r"] and host.sample_req_ids == ["r"]
    states.expect_sampled([states["r"]])
    # Position 4's id (41) is known by the next step, position 3's (40) only ever reached the device.
    later = _step(cached=CachedRequestData(["r"], [[]], [4], [[41]]), scheduled={"r": 1})
    states.apply(later)
    assert states["r"].token_ids == [5, 6, 7, DEVICE_FED_ID, 41] and states["r"].num_unread_tokens == 0
    host = states.build_step(later, block_size=16)
    assert host.input_ids.tolist() == [41] and not host.device_fed_rows and host.sample_req_ids == ["r"]
    assert np.array_equal(host.positions, [4])
