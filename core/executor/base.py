"""The executor contract: how the engine core starts its ranks, feeds them steps and stops them.

`EngineCore` reaches its workers only through an `Executor`. Each rank holds one `Worker` (a
platform's) with its slice of the model; the executor
  - starts the ranks (`create_executor` picks the implementation from the config),
  - runs the startup calls on every rank: `load_model`, `profile_num_kv_blocks` (the smallest
    count over the ranks, so every rank's cache holds the blocks the scheduler hands out),
    `init_kv_cache`, `warmup`,
  - launches each step on every rank and returns a `StepHandle` whose `result()` is the output
    rank's `ModelRunnerOutput` (rank 0, or the first of the last pipeline stage; every rank of
    the sampling stage samples the same ids from the same gathered logits); a step
    whose grammar masks are pending samples when `sample_pending` brings them,
  - reports liveness and stops the ranks.
Steps may stay in flight while the next is launched (async scheduling; a micro-batch per stage
under pipeline parallelism), as with one worker.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol

from ..config import EngineConfig
from ..errors import EngineDeadError
from ..loaders import ModelSource
from ..platform import Platform
from ..quantization.base import QuantizationConfig
from ..step_messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from ..worker.worker import ModelInfo, Worker


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to build its `Worker`; pickled once per rank when the ranks start."""

    config: EngineConfig
    platform: Platform
    source: ModelSource
    dtype: str
    max_model_len: int
    eos_token_id: int | None
    attention_backend_cls: type
    quantization: QuantizationConfig | None = None

    def build(self) -> Worker:
        return self.platform.worker_cls()(
            self.config, self.platform, self.source, dtype=self.dtype, max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id, attention_backend_cls=self.attention_backend_cls,
            quantization=self.quantization,
        )


class StepHandle(Protocol):
    """A launched step; `result()` waits for its sampled ids (once; later calls return the same)."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(abc.ABC):
    @abc.abstractmethod
    def load_model(self) -> ModelInfo:
        """Build and load the model on every rank; rank 0's description."""

    @abc.abstractmethod
    def profile_num_kv_blocks(self) -> int:
        """The KV blocks every rank can hold (the minimum over the ranks)."""

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None:
        ...

    @abc.abstractmethod
    def warmup(self) -> None:
        ...

    @abc.abstractmethod
    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Start a step on every rank; earlier steps may still be unread (read them in launch order)."""

    @abc.abstractmethod
    def sample_pending(self, bitmask: GrammarBitmask | None) -> None:
        """Give the last launched step (`grammar_pending`) its masks: every rank samples it now."""

    @abc.abstractmethod
    def sleep(self, level: int) -> None:
        """Sleep mode on every rank (`Worker.sleep`): the KV cache freed, the weights offloaded or dropped."""

    @abc.abstractmethod
    def wake_up(self, tags: list[str] | None) -> None:
        """Bring back the weights and/or KV cache (`tags`; None: both) on every rank."""

    @abc.abstractmethod
    def is_alive(self) -> bool:
        ...

    def check_alive(self) -> None:
        """Raise EngineDeadError when a rank has died. The engine loop asks while it is idle too, so a
        rank that dies with no step in flight is noticed within a second, not at the next request."""
        if not self.is_alive():
            raise EngineDeadError("the engine's workers are gone")

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every rank; idempotent."""
