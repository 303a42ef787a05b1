"""The engine's side of ranks that run elsewhere (worker processes, Ray actors).

Subclasses move bytes; this class keeps the order of replies. A step's reply is carried by the
next request sent to the ranks: the following step's launch, or a flush sent when the engine reads
a step with nothing launched after it (`RankWorker` says why).
"""
from __future__ import annotations

import abc
from typing import Any

import msgspec

from ..step_messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from ..worker.worker import ModelInfo
from .base import Executor

Reply = Any  # what a subclass needs to read the output rank's reply to one request


class RankStep:
    """A step launched on the ranks (a `StepHandle`)."""

    def __init__(self, executor: RemoteRanksExecutor):
        self._executor = executor
        self.reply: Reply | None = None  # set once a later request carries this step's ids
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._finish(self)
        return self._output


class RemoteRanksExecutor(Executor):
    def __init__(self) -> None:
        self._last: RankStep | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)

    @abc.abstractmethod
    def _call_all(self, method: str, *args) -> list:
        """Run a startup call on every rank; their results in rank order (a rank's error re-raised)."""

    @abc.abstractmethod
    def _send_step(self, payload: bytes) -> Reply:
        ...

    @abc.abstractmethod
    def _send_bitmask(self, payload: bytes) -> None:
        """Send every rank a pending step's masks; no reply (a rank that fails answers the next request with its error)."""

    @abc.abstractmethod
    def _send_flush(self) -> Reply:
        ...

    @abc.abstractmethod
    def _wait(self, reply: Reply) -> bytes:
        """The output rank's reply; raises EngineDeadError when a rank died or failed."""

    def load_model(self) -> ModelInfo:
        return self._call_all("load_model")[0]

    def profile_num_kv_blocks(self) -> int:
        return min(self._call_all("profile_num_kv_blocks"))

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call_all("init_kv_cache", num_blocks)

    def warmup(self) -> None:
        self._call_all("warmup")

    def sleep(self, level: int) -> None:
        self._call_all("sleep", level)

    def wake_up(self, tags: list[str] | None) -> None:
        self._call_all("wake_up", tags)

    def launch(self, sched: SchedulerOutput) -> RankStep:
        reply = self._send_step(self._encoder.encode(sched))
        if self._last is not None and self._last.reply is None:
            self._last.reply = reply
        self._last = RankStep(self)
        return self._last

    def sample_pending(self, bitmask: GrammarBitmask | None) -> None:
        self._send_bitmask(self._encoder.encode(bitmask))

    def _finish(self, step: RankStep) -> ModelRunnerOutput:
        if step.reply is None:
            step.reply = self._send_flush()
        return self._decoder.decode(self._wait(step.reply))
