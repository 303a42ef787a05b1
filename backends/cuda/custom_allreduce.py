"""A one-shot all-reduce over peer memory for the small messages of tensor-parallel ranks on one host.

Each rank keeps one persistent buffer in torch's symmetric memory (`torch.distributed._symmetric_memory`:
mapped into every rank of the group over NVLink). `torch.ops.symm_mem.one_shot_all_reduce_copy_out`
runs the whole collective as one kernel: each block copies its slice of the rank's input into the
rank's buffer, meets the same block of every peer at a barrier (signal pads), reads every rank's
slice over NVLink, adds them in rank order and writes the sum back over the input, then meets them
again so no rank refills its buffer while a peer still reads it. No host work and no allocation per
call, so the decode graphs capture it like any kernel. Every rank adds in the same order (rank 0
first), so every rank gets the same bits; with two ranks the sum is one rounding, as NCCL's.

NVLink multicast (`multimem_*` ops) is never used: rendezvous is asked not to create it.

Fallback: ROCm, a torch without the op, ranks on other hosts or devices without peer access
(PCIe-only boxes, Ray actors each confined to its own device), and a first sum at start that fails
or comes out wrong keep NCCL for every size; one log line says why. The ranks agree after every
step of the set-up, so they always choose alike.
"""
from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist
from corectl.distributed import DeviceCommunicator, TensorParallel

logger = logging.getLogger(__name__)

KIB = 1024
# The one-shot reads (W - 1) x S bytes per rank over NVLink; NCCL's ring moves 2 (W - 1) / W x S but
# pays a ~10-15 us floor. With two ranks both move S, so the one-shot (one step, 24 blocks at most)
# leads until NCCL's wider grid wins on bandwidth: an estimate, placed at 512 KiB (a decode step of
# 64 tokens at hidden 4096). At four ranks the one-shot reads 1.5x the ring's bytes (1.75x at eight),
# so the limit halves. benchmarks/allreduce_bench.py measures where the crossover really is.
MAX_BYTES_BY_WORLD_SIZE = {2: 512 * KIB}
MAX_BYTES_OTHERWISE = 256 * KIB
# The op dispatches bf16 and fp32 (torch's AT_DISPATCH_FLOAT_AND_BFLOAT16); fp16 takes NCCL.
DTYPES = (torch.bfloat16, torch.float32)
# Its 16-byte vector loads: a size or offset of another multiple would read across rows.
ALIGNMENT = 16


class SymmetricMemoryAllReduce(DeviceCommunicator):
    """The one-shot all-reduce of one group, through its rank's persistent symmetric buffer."""

    def __init__(self, buffer: torch.Tensor, group_name: str):
        super().__init__(buffer.numel(), DTYPES, ALIGNMENT)
        self._buffer = buffer
        self._group_name = group_name
        # Resolved once: eager steps call it dozens of times each.
        self._one_shot = torch.ops.symm_mem.one_shot_all_reduce_copy_out.default

    def all_reduce_(self, x: torch.Tensor) -> None:
        flat = x.view(-1)
        # The buffer is raw bytes viewed as the message's dtype at offset 0: one buffer serves bf16
        # and fp32 messages, and the op finds its peers' copies from the buffer's allocation.
        staged = self._buffer[:flat.numel() * flat.element_size()].view(flat.dtype)
        self._one_shot(staged, flat, "sum", self._group_name, flat)


def create_communicator(tp: TensorParallel, max_bytes: int | None = None) -> SymmetricMemoryAllReduce | None:
    """The one-shot all-reduce for `tp`'s group, or None (NCCL for every size) where it cannot run.
    Every rank of the group calls it together. `max_bytes` (the buffer, and the largest message it
    takes) defaults to the limit for the group's size."""
    group = tp.group if tp.group is not None else dist.group.WORLD
    if max_bytes is None:
        max_bytes = MAX_BYTES_BY_WORLD_SIZE.get(tp.world_size, MAX_BYTES_OTHERWISE)
    communicator, reason = None, _unsupported_reason()  # the same on every rank: no collective needed to agree
    if reason is None and not _agree(_peers_reachable(group), group):
        reason = "a rank cannot map every peer's memory (other host, no P2P access, or devices it cannot see)"
    if reason is None:
        communicator, reason = _rendezvous(group, max_bytes)
    if communicator is not None:
        reason = _probe(communicator, tp.rank, group)
        if not _agree(reason is None, group):
            communicator, reason = None, reason or "the one-shot's first sum went wrong on another rank"
    if tp.rank == 0 and communicator is not None:
        logger.info("tensor-parallel all-reduce: one-shot over peer memory up to %d KiB (%d ranks), NCCL above",
                    max_bytes // KIB, tp.world_size)
    elif tp.rank == 0:
        logger.warning("tensor-parallel all-reduce: NCCL for every size (%s)", reason)
    return communicator


def _unsupported_reason() -> str | None:
    if torch.version.hip is not None:
        return "ROCm: torch's one-shot kernel is CUDA's"
    try:
        torch.ops.symm_mem.one_shot_all_reduce_copy_out
    except (AttributeError, RuntimeError):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy_out"
    return None


def _peers_reachable(group) -> bool:
    """Whether this rank's device can map every peer's: same host, the peer's device visible here,
    and peer access between the two (what rendezvous needs; checked before it so no rank is left
    waiting in it)."""
    device = torch.cuda.current_device()
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    peers: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(peers, mine, group=group)
    local = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    for host, uuid in peers:
        index = local.get(uuid)
        if host != mine[0] or index is None:
            return False
        if index != device and not torch.cuda.can_device_access_peer(device, index):
            return False
    return True


def _agree(ok: bool, group) -> bool:
    """True when `ok` holds on every rank of the group."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=torch.cuda.current_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _probe(communicator: SymmetricMemoryAllReduce, rank: int, group) -> str | None:
    """One sum of each dtype through the new communicator, against the known total: a torch whose op
    refuses the buffer's views, or sums wrongly, leaves the ranks on NCCL instead of failing mid-step.
    The op's checks run on the host before its kernel, alike on every rank, so none is left waiting."""
    ranks = dist.get_world_size(group)
    try:
        for dtype in DTYPES:
            x = torch.full((ALIGNMENT,), rank + 1, dtype=dtype, device=torch.cuda.current_device())
            communicator.all_reduce_(x)
            if not bool((x == ranks * (ranks + 1) // 2).all()):
                return f"the one-shot's first {dtype} sum was wrong"
    except RuntimeError as error:
        return f"the one-shot's first sum failed: {error}"
    return None


def _rendezvous(group, max_bytes: int) -> tuple[SymmetricMemoryAllReduce | None, str | None]:
    """Allocate this rank's buffer and map its peers'; each step ends with the ranks agreeing, so a
    failure on one rank sends every rank to NCCL."""
    import torch.distributed._symmetric_memory as symm_mem

    # Only peer loads are used: no multicast object for rendezvous to create (or fail on).
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    buffer, failure = None, None
    try:
        buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=torch.cuda.current_device())
    except RuntimeError as error:
        failure = f"symmetric memory allocation failed: {error}"
    if not _agree(failure is None, group):
        return None, failure or "symmetric memory allocation failed on another rank"
    try:
        symm_mem.rendezvous(buffer, group.group_name)
    except RuntimeError as error:
        failure = f"symmetric memory rendezvous failed: {error}"
    if not _agree(failure is None, group):
        return None, failure or "symmetric memory rendezvous failed on another rank"
    return SymmetricMemoryAllReduce(buffer, group.group_name), None
