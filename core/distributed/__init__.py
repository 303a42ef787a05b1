"""Parallel state (tensor-parallel groups, pipeline stages) and its collectives (torch.distributed),
shared by the model layers, the worker and the executors."""
from .communicator import DeviceCommunicator
from .parallel_state import (
    PipelineParallel,
    TensorParallel,
    all_gather,
    all_reduce,
    attach_device_communicator,
    destroy_parallel_state,
    first_rank_copy,
    get_pp,
    get_tp,
    init_parallel_state,
    receive_from_last_stage,
    receive_from_previous_stage,
    send_to_first_stage,
    send_to_next_stage,
    shard_range,
    viewed_as_stage,
    viewed_whole,
)

__all__ = ["DeviceCommunicator", "PipelineParallel", "TensorParallel", "all_gather", "all_reduce",
           "attach_device_communicator", "destroy_parallel_state", "first_rank_copy", "get_pp", "get_tp", "init_parallel_state",
           "receive_from_last_stage", "receive_from_previous_stage", "send_to_first_stage", "send_to_next_stage",
           "shard_range", "viewed_as_stage", "viewed_whole"]
