"""The contract of a platform's own all-reduce for the messages its collectives library serves worst.

A tensor-parallel decode step all-reduces one row of hidden state per token twice a layer: a few
kilobytes, where NCCL's ring pays ~10-15 us of latency whatever the size. A platform whose devices
reach each other's memory (GPUs over NVLink) can sum such a message in one kernel that reads every
peer's copy. `Platform.device_communicator` hands one to the parallel state, which sends it the
messages it `takes` and the rest to the group's collective (`parallel_state.all_reduce`).
"""
from __future__ import annotations

import abc

import torch


class DeviceCommunicator(abc.ABC):
    """Sums a tensor over the tensor-parallel group, in place, for messages of at most `max_bytes`
    of the `dtypes` it reduces. Every rank of the group must get the same bits (add the ranks'
    values in one fixed order), and every rank must make the same `takes` decision for the same
    tensor, since the group's ranks meet in whichever collective they chose."""

    def __init__(self, max_bytes: int, dtypes: tuple[torch.dtype, ...], alignment: int):
        self.max_bytes = max_bytes
        self.dtypes = dtypes
        # The byte multiple that a message's size and offset into its storage must be; a
        # vectorized kernel reads whole words, so an odd size goes through the group's collective.
        self.alignment = alignment

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through this communicator: a contiguous tensor of a reduced dtype, no
        larger than `max_bytes`, aligned in size and offset. A function of the tensor alone, so
        every rank decides alike."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype in self.dtypes and x.is_contiguous() and 0 < nbytes <= self.max_bytes
                and nbytes % self.alignment == 0 and x.storage_offset() * x.element_size() % self.alignment == 0)

    @abc.abstractmethod
    def all_reduce_(self, x: torch.Tensor) -> None:
        """Replace `x` by its sum over the group's ranks; `takes(x)` holds. It may be captured in a
        device graph, so it must not allocate or wait on the host."""
