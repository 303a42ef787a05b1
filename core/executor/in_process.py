"""One worker in the engine's own process: each call goes straight to it (tensor-parallel size 1)."""
from __future__ import annotations

from ..step_messages import GrammarBitmask, SchedulerOutput
from ..worker.worker import ModelInfo
from .base import Executor, StepHandle, WorkerSpec


class InProcessExecutor(Executor):
    def __init__(self, spec: WorkerSpec):
        self.worker = spec.build()

    def load_model(self) -> ModelInfo:
        return self.worker.load_model()

    def profile_num_kv_blocks(self) -> int:
        return self.worker.profile_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def warmup(self) -> None:
        self.worker.warmup()

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        return self.worker.launch(sched)

    def sample_pending(self, bitmask: GrammarBitmask | None) -> None:
        self.worker.sample_pending(bitmask)

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self, tags: list[str] | None) -> None:
        self.worker.wake_up(tags)

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Nothing runs beside the engine's own thread."""
