"""Tensor-parallel state and collectives (torch.distributed), shared by the model layers and executors."""
from .parallel_state import (
    TensorParallel,
    all_gather,
    all_reduce,
    destroy_tensor_parallel,
    get_tp,
    init_tensor_parallel,
    shard_range,
)

__all__ = ["TensorParallel", "all_gather", "all_reduce", "destroy_tensor_parallel", "get_tp",
           "init_tensor_parallel", "shard_range"]
