"""The tensor-parallel group of this process and the collectives the model layers call.

The state has one writer: the executor's rank (`corectl.executor.rank.RankWorker`) calls
`init_tensor_parallel` once, before it builds the model, and `destroy_tensor_parallel` when it
stops. The model layers read it at construction (which slice of each weight a rank holds) and in
`forward` (whether to reduce). Without a group (world size 1: the engine's own process) nothing is
initialised and the collectives return their input untouched, so one device pays nothing.

Core never names a collectives backend: the rank passes the one its platform names
(`Platform.distributed_backend()`).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1


_state = TensorParallel()


def get_tp() -> TensorParallel:
    return _state


def init_tensor_parallel(rank: int, world_size: int, backend: str, init_method: str,
                         timeout_s: float = 600.0) -> None:
    """Join the group of `world_size` ranks (the default torch.distributed group) as `rank`."""
    global _state
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    _state = TensorParallel(rank, world_size)


def destroy_tensor_parallel() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = TensorParallel()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the same bits."""
    if _state.world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dimension, in rank order."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


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
