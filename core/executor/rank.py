"""What one rank runs, in a worker process (mp) or a Ray actor alike.

An engine's ranks are `tensor_parallel_size` ranks per pipeline stage (`world_size` in all,
`corectl.distributed.parallel_state` numbers them). Every rank gets every step; the first rank of
the last stage returns the outputs (its stage samples). A rank joins the group, builds its
platform's `Worker` and then serves four kinds of request:
a startup call by name, a step (a `SchedulerOutput` as msgspec bytes), the grammar masks of a step
launched with them pending (a `GrammarBitmask`, no reply), and a flush. Steps are
pipelined as in the engine's own process: a step is launched before the previous one is read,
so the reply to step N (the output rank's `ModelRunnerOutput` as bytes) comes with step N+1's
request, or with a flush when the engine reads N before it has anything else to launch. Every rank reads its
own results (they advance its request states); only the output rank returns them.
"""
from __future__ import annotations

import os
import socket

import msgspec
import torch

from ..config import EngineConfig, parse_layer_partition
from ..distributed import attach_device_communicator, destroy_parallel_state, init_parallel_state
from ..step_messages import GrammarBitmask, SchedulerOutput
from .base import StepHandle, WorkerSpec


class RankWorker:
    def __init__(self, spec: WorkerSpec, rank: int, world_size: int, init_method: str, device_index: int):
        config = spec.config
        # Ranks share the host's cores; oversubscribing them (each taking all) slows every rank.
        torch.set_num_threads(config.num_threads or max(1, len(os.sched_getaffinity(0)) // world_size))
        # Unseeded sampling draws from the global generator: every rank must draw the same.
        torch.manual_seed(config.seed)
        spec.platform.device_for_rank(device_index)
        partition = config.pipeline_layer_partition
        init_parallel_state(rank, config.tensor_parallel_size, config.pipeline_parallel_size,
                            spec.platform.distributed_backend(), init_method,
                            None if partition is None else
                            parse_layer_partition(partition, config.pipeline_parallel_size, "pipeline_layer_partition"))
        attach_device_communicator(spec.platform, enabled=not config.disable_custom_all_reduce)
        self.is_output_rank = rank == output_rank(config)
        self.worker = spec.build()
        self._in_flight: StepHandle | None = None
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self._bitmask_decoder = msgspec.msgpack.Decoder(GrammarBitmask | None)
        self._encoder = msgspec.msgpack.Encoder()

    def call(self, method: str, *args):
        """A startup call (`load_model`, `profile_num_kv_blocks`, `init_kv_cache`, `warmup`) or a sleep-mode
        one (`sleep`, `wake_up`)."""
        return getattr(self.worker, method)(*args)

    def step(self, payload: bytes | memoryview) -> bytes | None:
        """Launch a step; returns the previous step's output (the output rank) if one was in flight."""
        pending = self.worker.launch(self._decoder.decode(payload))
        previous, self._in_flight = self._in_flight, pending
        return None if previous is None else self._finish(previous)

    def sample_pending(self, payload: bytes | memoryview) -> None:
        self.worker.sample_pending(self._bitmask_decoder.decode(payload))

    def flush(self) -> bytes | None:
        """Finish the step in flight; returns its output (the output rank)."""
        previous, self._in_flight = self._in_flight, None
        return None if previous is None else self._finish(previous)

    def _finish(self, pending: StepHandle) -> bytes | None:
        output = pending.result()
        return self._encoder.encode(output) if self.is_output_rank else None

    def shutdown(self) -> None:
        destroy_parallel_state()


def output_rank(config: EngineConfig) -> int:
    """The rank whose replies carry the steps' outputs: the first of the last stage."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


def rank_name(config: EngineConfig, rank: int) -> str:
    """How logs and errors name a rank: its tensor-parallel rank, and its stage when there are several."""
    stage, tp_rank = divmod(rank, config.tensor_parallel_size)
    if config.pipeline_parallel_size == 1:
        return f"tensor-parallel rank {rank}"
    return f"rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"


def free_port() -> int:
    """A TCP port free on this host now, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
