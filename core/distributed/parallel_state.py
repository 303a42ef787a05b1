"""The parallel layout of this process: its tensor-parallel group, its pipeline stage, and the
collectives and point-to-point transfers the model layers and the worker call.

An engine runs `tp x pp` ranks: global rank `stage * tp + tp_rank`. The ranks of one stage form
a tensor-parallel group (its all-reduces and all-gathers); rank r of stage s sends its
activations to rank r of stage s + 1, and rank r of the last stage sends the ids it samples back
to rank r of the first (`send_to_first_stage`), which embeds them in a later step.

The state has one writer: the executor's rank (`corectl.executor.rank.RankWorker`) calls
`init_parallel_state` once, before it builds the model, and `destroy_parallel_state` when it
stops. The model layers read it at construction (which slice of each weight, which layers a rank
holds) and in `forward` (whether to reduce). Without a group (one rank: the engine's own process)
nothing is initialised and the collectives return their input untouched, so one device pays
nothing.

Core never names a collectives backend: the rank passes the one its platform names
(`Platform.distributed_backend()`), and may attach the platform's own all-reduce for small
messages (`attach_device_communicator`, `Platform.device_communicator`): `all_reduce` sends it the
messages it takes and the rest to the group's collective.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import envs
from .communicator import DeviceCommunicator

if TYPE_CHECKING:
    from ..platform import Platform


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    # The stage's process group; None: the default group (all ranks are one stage).
    group: Any = None


@dataclass(frozen=True)
class PipelineParallel:
    """This rank's stage among `world_size` stages, the global ranks it receives from and sends
    to (`ring_rank`: the first stage's peer on the last, the last's on the first, for sampled
    ids), and each stage's layer count when the user gave them (None: an even split)."""

    rank: int = 0
    world_size: int = 1
    prev_rank: int | None = None
    next_rank: int | None = None
    partition: tuple[int, ...] | None = None
    ring_rank: int | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


_state = TensorParallel()
_pp = PipelineParallel()
# The platform's all-reduce for small messages, when it gave one (`attach_device_communicator`).
_communicator: DeviceCommunicator | None = None


def get_tp() -> TensorParallel:
    return _state


def get_pp() -> PipelineParallel:
    return _pp


def init_parallel_state(rank: int, tp_size: int, pp_size: int, backend: str, init_method: str,
                        partition: tuple[int, ...] | None = None, timeout_s: float = 600.0) -> None:
    """Join the `tp_size x pp_size` ranks as global `rank`; every rank creates every stage's group
    (torch.distributed requires all ranks to take part in each `new_group`)."""
    global _state, _pp
    world_size = tp_size * pp_size
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    stage, tp_rank = divmod(rank, tp_size)
    group = None
    if pp_size > 1:
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        group = groups[stage]
    _state = TensorParallel(tp_rank, tp_size, group)
    last = pp_size - 1
    ring_rank = {0: last * tp_size + tp_rank, last: tp_rank}.get(stage) if pp_size > 1 else None
    _pp = PipelineParallel(stage, pp_size, prev_rank=rank - tp_size if stage > 0 else None,
                           next_rank=rank + tp_size if stage < last else None, partition=partition,
                           ring_rank=ring_rank)


@contextlib.contextmanager
def _viewed(pp: PipelineParallel, tp: TensorParallel | None = None) -> Iterator[None]:
    """Within, this process reads as `pp` (and `tp`, when given) say; its own layout comes back on
    leaving."""
    global _pp, _state
    saved = _pp, _state
    _pp, _state = pp, _state if tp is None else tp
    try:
        yield
    finally:
        _pp, _state = saved


def viewed_as_stage(stage: int, num_stages: int,
                    partition: tuple[int, ...] | None = None) -> contextlib.AbstractContextManager[None]:
    """Within, this process reads as pipeline stage `stage` of `num_stages` without joining any group,
    so a model built here holds that stage's layers (a deployment plan sizes each stage on the meta
    device). Not for a rank, whose stage `init_parallel_state` set."""
    if _pp.world_size > 1:
        raise RuntimeError("a pipeline rank cannot be viewed as another stage")
    return _viewed(PipelineParallel(stage, num_stages, partition=partition))


def viewed_whole(alone: bool = False) -> contextlib.AbstractContextManager[None]:
    """Within, a pipeline rank reads as the only stage, so a model built here holds every layer
    (the first stage's draft model); `alone`: as the only tensor-parallel rank too, so the model
    holds every row and its layers sum nothing over ranks (a draft at draft_tensor_parallel_size 1
    beside a split target, which every rank runs whole). Nothing collective runs here."""
    return _viewed(PipelineParallel(), TensorParallel() if alone else None)


def attach_device_communicator(platform: "Platform", enabled: bool = True) -> None:
    """Ask `platform` for its all-reduce for the stage's small messages; every rank of the group
    calls it together, after `init_parallel_state` (the platform may run collectives on the group).
    Not `enabled` (`--disable-custom-all-reduce`) or CORECTL_CUSTOM_ALLREDUCE=0, the group's
    collective sums every size."""
    global _communicator
    if _state.world_size > 1 and enabled and envs.custom_allreduce_enabled():
        _communicator = platform.device_communicator(_state)


def destroy_parallel_state() -> None:
    global _state, _pp, _communicator
    _communicator = None  # its peer buffers belong to the group destroyed below
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = TensorParallel()
    _pp = PipelineParallel()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the stage's ranks, in place; every rank gets the same bits."""
    if _state.world_size > 1:
        if _communicator is not None and _communicator.takes(x):
            _communicator.all_reduce_(x)
        else:
            dist.all_reduce(x, group=_state.group)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dimension, in rank order."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.cat(parts, dim=-1)


def first_rank_copy(x: torch.Tensor) -> torch.Tensor:
    """`x` (1-D, the same length on every rank) as the stage's first tensor-parallel rank holds it,
    on every rank: what ranks that compute the same thing alone agree to use, whatever their last
    bits."""
    if _state.world_size == 1:
        return x
    return all_gather(x)[: x.shape[-1]]


def send_to_next_stage(tensors: list[torch.Tensor]) -> None:
    """Send activations to this rank's peer in the next stage, in order (NCCL queues the sends
    on the device; gloo returns once the peer has them)."""
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=_pp.next_rank)


def receive_from_previous_stage(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fill `buffers` with the activations the peer in the previous stage sent, in order."""
    for buffer in buffers:
        dist.recv(buffer, src=_pp.prev_rank)
    return buffers


def send_to_first_stage(ids: torch.Tensor) -> dist.Work:
    """Start sending a step's sampled ids from the last stage to this rank's peer in the first;
    the transfer runs behind the sampling, and the returned work holds `ids` until it is done."""
    return dist.isend(ids, dst=_pp.ring_rank)


def receive_from_last_stage(buffer: torch.Tensor) -> dist.Work:
    """Start receiving the ids the last stage's peer sampled into `buffer`; `wait()` on the work
    before reading it (NCCL: the current stream waits, not the host; gloo: the host waits)."""
    return dist.irecv(buffer, src=_pp.ring_rank)


def shard_range(num_units: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first unit, unit count) of `rank`'s share of `num_units` (attention heads, rows).

    With at least as many units as ranks each rank holds an equal run; with fewer (KV heads under
    a larger tensor-parallel size) each rank holds one unit and consecutive ranks share it.
    """
    if num_units >= world_size:
        if num_units % world_size:
            raise ValueError(f"{num_units} units do not split evenly over {world_size} ranks")
        per_rank = num_units // world_size
        return rank * per_rank, per_rank
    if world_size % num_units:
        raise ValueError(f"{world_size} ranks cannot share {num_units} units evenly")
    return rank * num_units // world_size, 1
