"""The `ray` executor: one Ray actor per rank (tensor-parallel rank of a pipeline stage), placed by
a placement group.

It joins the cluster `RAY_ADDRESS` names (`ray start --head` on one machine, `ray start
--address=...` on the others), or starts a local one when none is set; a process that has
already called `ray.init` keeps its own. The placement group reserves one bundle per rank (the
platform's `ray_resources_per_rank`: a GPU each on CUDA, a CPU on the CPU platform) and packs them
onto as few machines as it can (pipeline stages included: they span machines when one cannot
hold every rank, Ray choosing which bundle goes where). The group's rendezvous is rank 0's node
address and a port free there. Actors are owned by the engine process: when it exits, however it ends, Ray ends them too.

Steps go to every actor as the same msgspec bytes (Ray puts them in its object store once per
call); the output rank's return value carries the previous step's output, as with the mp executor.
"""
from __future__ import annotations

import contextlib
import os

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..errors import ConfigError, CorectlError, EngineDeadError
from .base import WorkerSpec
from .rank import RankWorker, free_port, output_rank
from .remote_ranks import RemoteRanksExecutor

_PLACEMENT_TIMEOUT_S = 60.0
_PING_TIMEOUT_S = 2.0


class RankActor:
    """A `RankWorker` inside a Ray actor (Ray restricts the actor to its bundle's device)."""

    def __init__(self) -> None:
        self.rank_worker: RankWorker | None = None

    def rendezvous(self) -> str:
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, spec: WorkerSpec, rank: int, world_size: int, init_method: str) -> None:
        self.rank_worker = RankWorker(spec, rank, world_size, init_method, device_index=0)

    def call(self, method: str, *args):
        return self.rank_worker.call(method, *args)

    def step(self, payload: bytes) -> bytes | None:
        return self.rank_worker.step(payload)

    def sample_pending(self, payload: bytes) -> None:
        self.rank_worker.sample_pending(payload)

    def flush(self) -> bytes | None:
        return self.rank_worker.flush()


def _actor_resources(bundle: dict[str, float]) -> dict:
    """A rank actor's options for its bundle: Ray takes its own CPU and GPU counts as keywords and
    every other resource (a TPU, a custom accelerator) in `resources`."""
    others = {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")}
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0), "resources": others}


class RayExecutor(RemoteRanksExecutor):
    def __init__(self, spec: WorkerSpec):
        super().__init__()
        bundle = spec.platform.ray_resources_per_rank()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"))
        world_size = spec.config.world_size
        self._output_rank = output_rank(spec.config)
        self._group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        self._actors: list = []
        self._error: EngineDeadError | None = None
        try:
            self._place(bundle, world_size)
            actor_cls = ray.remote(RankActor)
            self._actors = [
                actor_cls.options(**_actor_resources(bundle),
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      self._group, placement_group_bundle_index=rank)).remote()
                for rank in range(world_size)
            ]
            init_method = ray.get(self._actors[0].rendezvous.remote())
            self._get([a.start.remote(spec, r, world_size, init_method) for r, a in enumerate(self._actors)],
                      startup=True)
        except BaseException:
            self.shutdown()
            raise

    def _place(self, bundle: dict, world_size: int) -> None:
        try:
            ray.get(self._group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise ConfigError("tensor_parallel_size", f"the Ray cluster cannot place {world_size} ranks of "
                              f"{bundle} within {_PLACEMENT_TIMEOUT_S:g} s; it has {ray.cluster_resources()}") from None

    def _call_all(self, method: str, *args) -> list:
        return self._get([a.call.remote(method, *args) for a in self._actors], startup=True)

    def _send_step(self, payload: bytes):
        replies = [a.step.remote(payload) for a in self._actors]
        return replies[self._output_rank]  # every rank runs the step; one reply carries the output

    def _send_bitmask(self, payload: bytes) -> None:
        # An actor runs its calls in order, so the next step's reply comes after these; a rank
        # that failed here fails that reply too.
        for actor in self._actors:
            actor.sample_pending.remote(payload)

    def _send_flush(self):
        replies = [a.flush.remote() for a in self._actors]
        return replies[self._output_rank]

    def _wait(self, reply) -> bytes:
        return self._get(reply, startup=False)

    def _get(self, refs, startup: bool):
        if self._error is not None:
            raise self._error
        try:
            return ray.get(refs)
        except RayTaskError as exc:
            cause = exc.cause
            if startup and isinstance(cause, CorectlError):
                raise cause from None
            raise self._dead(f"a tensor-parallel rank failed: {type(cause).__name__}: {cause}") from None
        except RayError as exc:
            raise self._dead(f"a tensor-parallel rank's actor is gone: {exc}") from None

    def _dead(self, reason: str) -> EngineDeadError:
        if self._error is None:
            self._error = EngineDeadError(reason)
        return self._error

    def is_alive(self) -> bool:
        return self._error is None

    def check_alive(self) -> None:
        """Each actor answers a no-op; a dead one's answer is how it died (a slow answer is no death)."""
        if self._error is None:
            with contextlib.suppress(GetTimeoutError):
                try:
                    ray.get([actor.__ray_ready__.remote() for actor in self._actors], timeout=_PING_TIMEOUT_S)
                except RayActorError as exc:
                    self._dead(f"a tensor-parallel rank's actor died while the engine was idle: {exc}")
        if self._error is not None:
            raise self._error

    def shutdown(self) -> None:
        for actor in self._actors:
            with contextlib.suppress(RayError):
                ray.kill(actor)
        self._actors = []
        if self._group is not None:
            with contextlib.suppress(RayError):
                remove_placement_group(self._group)
            self._group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
