"""Executors: how the engine core starts its tensor-parallel ranks and feeds them (see base.py)."""
from __future__ import annotations

from ..errors import ConfigError
from ..models.parallel import check_tensor_parallel
from .base import Executor, StepHandle, WorkerSpec

__all__ = ["Executor", "StepHandle", "WorkerSpec", "create_executor", "executor_backend"]


def executor_backend(config) -> str:
    """"in_process", "mp" or "ray": the configured backend, else the engine's own process at
    tensor-parallel size 1 and "mp" above it."""
    if config.distributed_executor_backend is not None:
        return config.distributed_executor_backend
    return "mp" if config.tensor_parallel_size > 1 else "in_process"


def create_executor(spec: WorkerSpec) -> Executor:
    """Start the ranks the config asks for (raises ConfigError when the model cannot be split so)."""
    check_tensor_parallel(spec.source.hf_config, spec.config.tensor_parallel_size)
    backend = executor_backend(spec.config)
    if backend == "in_process":
        from .in_process import InProcessExecutor

        return InProcessExecutor(spec)
    if backend == "mp":
        from .multiproc import MultiprocExecutor

        return MultiprocExecutor(spec)
    try:
        from .ray_executor import RayExecutor
    except ImportError as exc:
        raise ConfigError("distributed_executor_backend",
                          f"the ray backend needs Ray ({exc}): pip install 'corectl[ray]'") from None
    return RayExecutor(spec)
