"""Which all-reduce a message takes: the platform's communicator for what it `takes`, the group's
collective for the rest, and the collective alone where the platform gives none or
CORECTL_CUSTOM_ALLREDUCE=0 says so.

NVLink cannot run here, so the two-rank test runs real gloo ranks (forked processes) whose platform
hands the parallel state `GatherSumCommunicator`: a one-shot all-reduce over gloo (every rank
gathers every rank's copy and adds them in rank order), the CUDA communicator's algorithm on
another transport. It counts the messages it took, which is what the dispatch is judged by; the
sums are checked bit for bit against the expected totals either way. The rules the CUDA
communicator takes messages by (size, dtype, alignment) are checked on its real class.
"""
from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist
from corectl.backends.cpu.platform import CPUPlatform
from corectl.backends.cuda.custom_allreduce import ALIGNMENT, DTYPES, MAX_BYTES_BY_WORLD_SIZE, SymmetricMemoryAllReduce
from corectl.distributed import (
    DeviceCommunicator,
    all_reduce,
    attach_device_communicator,
    destroy_parallel_state,
    init_parallel_state,
    parallel_state,
)

WORLD_SIZE = 2
LIMIT = 256  # bytes: 64 fp32 values


class GatherSumCommunicator(DeviceCommunicator):
    def __init__(self):
        super().__init__(LIMIT, (torch.float32,), ALIGNMENT)
        self.taken = 0

    def all_reduce_(self, x: torch.Tensor) -> None:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        x.copy_(total)
        self.taken += 1


class OneShotCPUPlatform(CPUPlatform):
    def device_communicator(self, tp):
        return GatherSumCommunicator()


def _sums(rank: int) -> dict[str, bool]:
    """Each message shape summed over the ranks against its expected total (rank r holds r + 1 + i)."""
    results = {}
    for name, numel in (("small", 64), ("large", 65), ("unaligned", 63)):
        x = torch.arange(numel, dtype=torch.float32) + rank + 1
        expected = 2 * torch.arange(numel, dtype=torch.float32) + 3
        results[name] = torch.equal(all_reduce(x), expected)
    return results


def _rank(rank: int, init_file: str, queue) -> None:
    torch.set_num_threads(1)
    report = {}
    init_parallel_state(rank, WORLD_SIZE, 1, "gloo", f"file://{init_file}")
    try:
        attach_device_communicator(CPUPlatform())
        report["cpu_gives_none"] = parallel_state._communicator is None
        report["cpu_sums"] = _sums(rank)
        os.environ["CORECTL_CUSTOM_ALLREDUCE"] = "0"
        attach_device_communicator(OneShotCPUPlatform())
        report["switch_off_gives_none"] = parallel_state._communicator is None
        os.environ["CORECTL_CUSTOM_ALLREDUCE"] = "1"
        attach_device_communicator(OneShotCPUPlatform(), enabled=False)  # --disable-custom-all-reduce
        report["flag_off_gives_none"] = parallel_state._communicator is None
        attach_device_communicator(OneShotCPUPlatform())
        report["one_shot_sums"] = _sums(rank)
        report["one_shot_taken"] = parallel_state._communicator.taken
    finally:
        destroy_parallel_state()
    report["destroyed"] = parallel_state._communicator is None
    queue.put((rank, report))


def test_messages_take_the_communicator_up_to_its_limit_and_the_collective_otherwise(tmp_path):
    # fork: the ranks need nothing but torch and this module, and a spawned interpreter costs seconds.
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, str(tmp_path / "init"), queue)) for r in range(WORLD_SIZE)]
    for process in ranks:
        process.start()
    reports = dict(queue.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=30)
    every_sum = {"small": True, "large": True, "unaligned": True}
    for report in reports.values():
        assert report["cpu_gives_none"] and report["switch_off_gives_none"] and report["flag_off_gives_none"]
        assert report["destroyed"]
        assert report["cpu_sums"] == every_sum and report["one_shot_sums"] == every_sum
        # 64 fp32 values (256 bytes) fit; 65 exceed the limit and 63 (252 bytes) are not 16-byte whole.
        assert report["one_shot_taken"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cuda_one_shot_takes_aligned_contiguous_messages_within_its_buffer(dtype):
    limit = MAX_BYTES_BY_WORLD_SIZE[2]
    communicator = SymmetricMemoryAllReduce(torch.empty(limit, dtype=torch.uint8), "0")
    itemsize = torch.empty((), dtype=dtype).element_size()
    whole = torch.empty(limit // itemsize, dtype=dtype)
    assert communicator.takes(whole) and communicator.takes(whole[:ALIGNMENT // itemsize])
    assert not communicator.takes(torch.empty(limit // itemsize + ALIGNMENT // itemsize, dtype=dtype))
    assert not communicator.takes(whole[1:ALIGNMENT // itemsize + 1])  # offset off the 16-byte grid
    assert not communicator.takes(whole[:ALIGNMENT // itemsize - 1])  # size off it
    assert not communicator.takes(whole.view(2, -1)[:, :ALIGNMENT])  # not contiguous
    assert not communicator.takes(whole[:0])
    # fp16 goes to NCCL: torch's one-shot kernel dispatches bf16 and fp32 only.
    assert not communicator.takes(torch.empty(ALIGNMENT, dtype=torch.float16))
