"""Data parallelism: M engine cores behind one `EngineTransport`, so one client serves them all.

    async with anyio.create_task_group() as tg:
        transport = await start_engines(config, tg, lambda cfg, index: RemoteEngine.start(cfg, tg))
        async with EngineClient.serving(transport, config, tg) as client:
            ...

`start_engines` starts `config.data_parallel_size` engines at once (each with its own executor,
hence its own tensor-parallel group) and, above one, wraps them in `DataParallelEngines`. That
transport sends each request to the engine its `Router` picks (`router.py`: prefix affinity, else
the least loaded), keeps the `n` samples of a request together (they come in one `add_requests`
call and share prompt blocks), sends an abort to the engine that holds the request, and merges
the engines' step reports into one stream: each report keeps its engine's outputs and carries the
stats of all engines added up, so the client's queue bound and gauges see the whole server.

Devices: engine i of an engine process gets `engine_devices(i, tp x pp)`, the i-th run of its ranks' devices
among those visible to the server (`Platform.visible_devices`), through the environment its
platform's `confine_process_env` names (`CUDA_VISIBLE_DEVICES` on CUDA and ROCm; nothing on the
CPU, whose engines share the host), set in its process before any device is touched; its
tensor-parallel ranks inherit it. With the Ray executor on a cluster (`RAY_ADDRESS` set) Ray
places every engine's ranks instead. On the CPU the engines share the cores: each rank of each
engine takes `cores / (M * tp)` torch threads unless `num_threads` is set.

Liveness: one engine's death fails the whole transport, as a rank's death fails an engine: every
request gets `EngineDeadError`, and the server answers 503 on /health and exits non-zero.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import msgspec
from anyio.abc import TaskGroup

from ..config import EngineConfig
from ..discovery import resolve_platform
from ..errors import ConfigError, EngineDeadError
from .messages import (
    EngineControl,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineSnapshot,
    SchedulerStats,
)
from .router import Router
from .transport import EngineTransport

StartEngine = Callable[[EngineConfig, int], Awaitable[EngineTransport]]


def engine_config(config: EngineConfig, index: int) -> EngineConfig:
    """The config engine `index` runs: one engine's share of the host's cores (when the user set
    none), and a data-parallel size of 1, since each engine core is a whole engine."""
    num_threads = config.num_threads
    if num_threads is None and config.data_parallel_size > 1:
        ranks = config.data_parallel_size * config.world_size
        num_threads = max(1, len(os.sched_getaffinity(0)) // ranks)
    return config.replace(data_parallel_size=1, num_threads=num_threads)


def engine_devices(index: int, ranks: int, visible: str | None) -> str:
    """The devices of engine `index`, comma separated: its run among `visible` (the server's own
    `Platform.visible_devices`; None: every device, numbered from 0)."""
    first = index * ranks
    if visible is None:
        return ",".join(str(d) for d in range(first, first + ranks))
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    mine = devices[first:first + ranks]
    if len(mine) < ranks:
        raise ConfigError("data_parallel_size", f"engine {index} needs devices {first}..{first + ranks - 1} "
                          f"of the visible devices {visible!r}, which lists {len(devices)}")
    return ",".join(mine)


@dataclasses.dataclass(frozen=True)
class EngineProcessInit:
    """Runs first in engine `index`'s process (picklable): confine it to its devices, then run
    `then` (e.g. the server's logging setup).

    `env` is computed where the init is built (the API process): resolving the platform in the
    engine's own process would start its device runtime, which reads the confinement only once."""

    index: int
    config: EngineConfig
    then: Callable[[], None] | None = None
    env: dict[str, str] = dataclasses.field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.config.data_parallel_size > 1 and not _ray_places_devices(self.config):
            platform = resolve_platform(self.config.platform)
            devices = engine_devices(self.index, self.config.world_size, platform.visible_devices())
            object.__setattr__(self, "env", platform.confine_process_env(devices.split(",")))

    def __call__(self) -> None:
        os.environ.update(self.env)
        if self.then is not None:
            self.then()


def _ray_places_devices(config: EngineConfig) -> bool:
    return config.distributed_executor_backend == "ray" and bool(os.environ.get("RAY_ADDRESS"))


async def start_engines(config: EngineConfig, task_group: TaskGroup, start: StartEngine) -> EngineTransport:
    """Start `config.data_parallel_size` engines with `start(engine_config, index)`, all at once;
    if any fails, stop the others and raise the first failure (by engine index)."""
    size = config.data_parallel_size
    if size == 1:
        return await start(engine_config(config, 0), 0)
    engines: list[EngineTransport | None] = [None] * size
    errors: list[BaseException | None] = [None] * size

    async def start_one(index: int) -> None:
        # Kept, not raised: every engine usually fails alike (a bad option), and the user should
        # see that error once, not a group of M copies.
        try:
            engines[index] = await start(engine_config(config, index), index)
        except Exception as exc:  # noqa: BLE001
            errors[index] = exc

    try:
        async with anyio.create_task_group() as starting:
            for index in range(size):
                starting.start_soon(start_one, index)
        failure = next((e for e in errors if e is not None), None)
        if failure is not None:
            raise failure
        _check_same_platform(engines)
    except BaseException:
        with anyio.CancelScope(shield=True):
            for engine in engines:
                if engine is not None:
                    await engine.close()
        raise
    return DataParallelEngines(engines, task_group)


def _check_same_platform(engines: list[EngineTransport]) -> None:
    first = engines[0].info
    for index, engine in enumerate(engines[1:], start=1):
        if (engine.info.platform, engine.info.device) != (first.platform, first.device):
            raise ConfigError("data_parallel_size", f"engine {index} runs on {engine.info.platform} "
                              f"({engine.info.device}) but engine 0 on {first.platform} ({first.device}): "
                              f"{len(engines)} engines need data_parallel_size x tensor_parallel_size devices")


class DataParallelEngines(EngineTransport):
    """One transport over several engine cores; see the module docstring."""

    def __init__(self, engines: list[EngineTransport], task_group: TaskGroup):
        self.engines = engines
        first = engines[0].info
        self.info = dataclasses.replace(first, num_kv_blocks=sum(e.info.num_kv_blocks for e in engines))
        self.router = Router(len(engines), first.block_size)
        self._owners: dict[str, int] = {}  # core request id -> the engine that holds it
        self._snapshots: list[EngineSnapshot | None] = [None] * len(engines)
        # Each engine's (sleep level, controls done): all are asleep, or awake, once every one is.
        self._sleep: list[tuple[int, int]] = [(0, 0)] * len(engines)
        self._error: EngineDeadError | None = None
        self._closed = False
        send, self._reports = anyio.create_memory_object_stream[tuple[int, EngineCoreOutputs | EngineDeadError]](
            math.inf)
        with send:
            for index, engine in enumerate(engines):
                task_group.start_soon(self._forward, index, engine, send.clone())

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        route = self.router.choose(requests[0].prompt_token_ids)
        self.router.sent(route, len(requests))
        try:
            await self.engines[route.engine].add_requests(requests)
        except BaseException:
            self.router.unsent(route, len(requests))
            raise
        self.router.remember(route)
        for request in requests:
            self._owners[request.request_id] = route.engine

    async def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self._owners.pop(request_id, None)
            if engine is not None:
                by_engine.setdefault(engine, []).append(request_id)
        for engine, ids in by_engine.items():
            await self.engines[engine].abort_requests(ids)

    async def control(self, message: EngineControl) -> None:
        self._check_alive()
        for engine in self.engines:
            await engine.control(message)

    async def outputs(self) -> AsyncIterator[EngineCoreOutputs]:
        async for index, report in self._reports:
            if isinstance(report, EngineDeadError):
                self._error = self._error or report
                raise self._error
            yield self._combine(index, report)

    async def close(self) -> None:
        self._closed = True
        async with anyio.create_task_group() as tg:
            for engine in self.engines:
                tg.start_soon(engine.close)

    def is_alive(self) -> bool:
        return self._error is None and not self._closed and all(e.is_alive() for e in self.engines)

    def engine_stats(self, latest: SchedulerStats) -> list[SchedulerStats]:
        return [load.stats for load in self.router.loads]

    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise EngineDeadError("the engines are shut down")
        dead = [i for i, engine in enumerate(self.engines) if not engine.is_alive()]
        if dead:
            raise EngineDeadError(f"data-parallel engine {dead[0]} is dead")

    async def _forward(self, index: int, engine: EngineTransport, send) -> None:
        with send:
            try:
                async for batch in engine.outputs():
                    send.send_nowait((index, batch))
            except Exception as exc:  # noqa: BLE001 - however its stream failed, this engine is dead
                send.send_nowait((index, EngineDeadError(f"data-parallel engine {index}: {exc}")))
            else:
                if not self._closed:
                    send.send_nowait((index, EngineDeadError(f"data-parallel engine {index} stopped")))

    def _combine(self, index: int, batch: EngineCoreOutputs) -> EngineCoreOutputs:
        """One engine's report as the client should see it: its outputs, everyone's stats."""
        self.router.observe(index, batch.stats, batch.num_requests_received)
        for output in batch.outputs:
            if output.finish_reason is not None:
                self._owners.pop(output.req_id, None)
        loads = self.router.loads
        if batch.snapshot is not None:
            self._snapshots[index] = batch.snapshot
        self._sleep[index] = (batch.sleep_level, batch.controls_done)
        return EngineCoreOutputs(
            outputs=batch.outputs, stats=_total(self.engines, [load.stats for load in loads]),
            timestamp=batch.timestamp, num_requests_received=sum(load.num_received for load in loads),
            snapshot=self._combined_snapshot() if batch.snapshot is not None else None,
            sleep_level=max(level for level, _ in self._sleep), controls_done=min(done for _, done in self._sleep),
            control_errors=batch.control_errors,
        )

    def _combined_snapshot(self) -> EngineSnapshot | None:
        """Engine 0's steps and block map, with the running requests of every engine (so a live
        view marks each request's state right)."""
        first = self._snapshots[0]
        if first is None:
            return None
        running = [rid for snap in self._snapshots if snap is not None for rid in snap.running_ids]
        return msgspec.structs.replace(first, running_ids=running)


def _total(engines: list[EngineTransport], stats: list[SchedulerStats]) -> SchedulerStats:
    """Every engine's stats added up; KV usage as the share of all engines' blocks in use."""
    blocks = [engine.info.num_kv_blocks for engine in engines]
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats), num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage * b for s, b in zip(stats, blocks)) / max(1, sum(blocks)),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
    )
